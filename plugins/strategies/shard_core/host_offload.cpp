#include "host_offload.h"

#include <ember/error.h>

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <unistd.h>

namespace ember_shard {

HostMemory host_memory_available(int64_t cap_bytes, int64_t already_taken) {
  HostMemory m;
  // MemAvailable: what the kernel estimates can be allocated without swapping.
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  bool found = false;
  while (meminfo >> key >> kib) {
    std::getline(meminfo, unit);
    if (key == "MemAvailable:") {
      m.available = kib * 1024;
      m.source = "MemAvailable in /proc/meminfo";
      found = true;
      break;
    }
  }
  if (!found) {
    m.available = static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
    m.source = "free physical pages";
  }
  if (cap_bytes > 0 && cap_bytes - already_taken < m.available) {
    m.available = std::max<int64_t>(0, cap_bytes - already_taken);
    m.source = "the cap offload.max_host_memory_mb";
  }
  return m;
}

std::string describe_bytes(int64_t bytes) {
  char buf[64];
  const double gib = static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0);
  if (gib >= 1.0) std::snprintf(buf, sizeof buf, "%.2f GiB", gib);
  else std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return std::string(buf) + " (" + std::to_string(bytes) + " bytes)";
}

HostCopies::HostCopies(c10::Device device, bool pin) : device_(device), pin_(pin) {}

at::Tensor HostCopies::host_zeros(int64_t numel, at::ScalarType dtype, const std::string& what) {
  auto options = at::TensorOptions().dtype(dtype).device(at::kCPU).pinned_memory(pinned());
  try {
    return at::zeros({numel}, options);
  } catch (const std::exception& e) {
    std::string why = e.what();
    throw ember::RunError("offload: could not allocate " + std::string(pinned() ? "pinned " : "") + "host memory for " + what + ": " +
                          describe_bytes(numel * static_cast<int64_t>(c10::elementSize(dtype))) + " needed (" +
                          why.substr(0, why.find('\n')) + "); lower the model size, use more ranks, or set offload.pin_memory = false");
  }
}

c10::Stream HostCopies::side_stream(std::optional<c10::Stream>& slot) {
  if (!slot) {
    c10::impl::VirtualGuardImpl impl(device_.type());
    slot = impl.getStreamFromGlobalPool(device_, /*isHighPriority=*/false);
  }
  return *slot;
}

void HostCopies::side_after_current(const c10::Stream& side) {
  c10::impl::VirtualGuardImpl impl(device_.type());
  c10::Event ready(device_.type());
  ready.record(impl.getStream(device_));
  ready.block(side);
}

void HostCopies::to_host(const at::Tensor& dst, const at::Tensor& src) {
  if (!async()) {
    dst.copy_(src);
    return;
  }
  const c10::Stream side = side_stream(d2h_);
  side_after_current(side);
  {
    c10::StreamGuard guard(side);
    dst.copy_(src, /*non_blocking=*/true);
  }
  // The caching allocator must not hand src's memory to the compute stream before the copy ran.
  src.record_stream(side);
  if (!d2h_done_) d2h_done_ = std::make_shared<c10::Event>(device_.type());
  d2h_done_->record(side);
}

void HostCopies::wait_host() {
  // Events on one stream complete in order: the last one covers every copy before it.
  if (d2h_done_ && d2h_done_->was_marked_for_recording()) d2h_done_->synchronize();
}

std::shared_ptr<c10::Event> HostCopies::to_device(const at::Tensor& dst, const at::Tensor& src) {
  if (!async()) {
    dst.copy_(src);
    return nullptr;
  }
  const c10::Stream side = side_stream(h2d_);
  // dst was allocated on the current stream: its memory may still be read by work queued there.
  side_after_current(side);
  {
    c10::StreamGuard guard(side);
    dst.copy_(src, /*non_blocking=*/true);
  }
  auto copied = std::make_shared<c10::Event>(device_.type());
  copied->record(side);
  return copied;
}

void HostCopies::use_on_device(const std::shared_ptr<c10::Event>& copied) {
  if (!copied) return;
  c10::impl::VirtualGuardImpl impl(device_.type());
  copied->block(impl.getStream(device_));
}

}  // namespace ember_shard
