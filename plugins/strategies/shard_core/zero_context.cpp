#include "zero_context.h"

#include <ember/error.h>

namespace ember_shard {

void HostBudget::take(int64_t bytes, const std::string& what) {
  const HostMemory m = host_memory_available(o_.max_host_bytes, taken_);
  if (bytes > m.available)
    throw ember::RunError(o_.name + ": not enough host memory for " + what + ": " + describe_bytes(bytes) + " needed, " +
                          describe_bytes(m.available) + " available (" + m.source +
                          (o_.max_host_bytes > 0 ? ", " + o_.where_max_host : std::string()) +
                          "); use a smaller model, more ranks (each offloads its shard), or a host with more memory");
  taken_ += bytes;
}

}  // namespace ember_shard
