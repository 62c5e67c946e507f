// Small host tensors (a batch's sample indices, its augmentation offsets) sent to the device the
// data lives on, without stopping the host. A plain `.to(cuda)` from pageable memory is LibTorch's
// memcpy_and_sync: the host waits for everything queued on the stream, once per batch, and the
// GPU idles while the next step's kernels are queued. Staged in pinned memory, the copy is queued
// like a kernel; the caching host allocator keeps the pinned block until the copy has run.
#pragma once
#include <ATen/ATen.h>

namespace ember_models {

inline at::Tensor to_device_without_sync(const at::Tensor& host, const c10::Device& device) {
  if (!device.is_cuda() || !host.is_cpu()) return host.to(device);
  return host.pin_memory().to(device, /*non_blocking=*/true);
}

}  // namespace ember_models
