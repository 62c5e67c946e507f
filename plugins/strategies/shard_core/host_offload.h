// The host side of offloaded training (ZeRO-Offload): how much host memory a run may take, host
// tensors (pinned when the compute device is a GPU, so copies are asynchronous), and the copies
// between device and host on a side stream ordered by events.
//
// The CUDA path uses c10's device-generic Stream/Event API (VirtualGuardImpl), so it compiles
// without CUDA headers and runs wherever LibTorch's CUDA library is loaded. On a CPU compute
// device every copy is a plain synchronous copy.
#pragma once
#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ember_shard {

// Bytes of host memory a run may still take: MemAvailable from /proc/meminfo, lowered to
// `cap_bytes - already_taken` when a cap is set (cap_bytes > 0). `source` says which bound it was.
struct HostMemory {
  int64_t available = 0;
  std::string source;
};
HostMemory host_memory_available(int64_t cap_bytes, int64_t already_taken);

// "1.2 GiB (1288490188 bytes)".
std::string describe_bytes(int64_t bytes);

class HostCopies {
 public:
  // `device` is the compute device; `pin` pins host tensors when it is a GPU.
  HostCopies(c10::Device device, bool pin);

  bool async() const { return device_.is_cuda(); }
  bool pinned() const { return pin_ && device_.is_cuda(); }

  // A host tensor (zeros), pinned when pinned(). Throws ember::RunError with the bytes asked for
  // when the memory cannot be had (`what` names it in that line).
  at::Tensor host_zeros(int64_t numel, at::ScalarType dtype, const std::string& what);

  // Device -> host: `dst` (host) receives `src` (device) once the work the current stream has
  // queued so far (backward that produced `src`) is done; the copy runs on the side stream and
  // `src`'s memory is kept until it finished. Synchronous on a CPU device.
  void to_host(const at::Tensor& dst, const at::Tensor& src);
  // The host waits until every to_host so far has landed.
  void wait_host();

  // Host -> device on the side stream (a prefetch); returns an event for use_on_device, or none
  // when the copy was synchronous.
  std::shared_ptr<c10::Event> to_device(const at::Tensor& dst, const at::Tensor& src);
  // The current stream waits for that copy before it reads `dst`.
  void use_on_device(const std::shared_ptr<c10::Event>& copied);

 private:
  c10::Stream side_stream(std::optional<c10::Stream>& slot);
  // The side stream waits for what the current stream queued so far.
  void side_after_current(const c10::Stream& side);

  c10::Device device_;
  bool pin_;
  std::optional<c10::Stream> d2h_, h2d_;
  std::shared_ptr<c10::Event> d2h_done_;
};

}  // namespace ember_shard
