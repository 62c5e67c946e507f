#include "data/device_feed.h"

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/nn/module.h>

#include "runtime/accelerator.h"
#include "runtime/runtime.h"

namespace ember::engine {

void to_channels_last(torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  for (auto& p : module.parameters())
    if (p.dim() == 4 && p.is_floating_point()) p.set_data(p.data().contiguous(at::MemoryFormat::ChannelsLast));
  for (auto& b : module.buffers())
    if (b.dim() == 4 && b.is_floating_point()) b.set_data(b.data().contiguous(at::MemoryFormat::ChannelsLast));
}

Batch batch_to_channels_last(Batch batch) {
  for (auto& t : batch.tensors)
    if (t.defined() && t.dim() == 4 && t.is_floating_point()) t = t.contiguous(at::MemoryFormat::ChannelsLast);
  return batch;
}

DeviceFeed::DeviceFeed(DataLoader::Pass& pass, Runtime& runtime, const FeedOptions& options)
    : pass_(pass), runtime_(runtime), options_(options), device_(runtime.root_device()) {
  async_ = accelerator_for(device_.type()).copies_ahead() && options_.pin_memory;
  if (async_) {
    c10::impl::VirtualGuardImpl impl(device_.type());
    side_ = impl.getStreamFromGlobalPool(device_, /*isHighPriority=*/false);
  }
}

DeviceFeed::~DeviceFeed() = default;

bool DeviceFeed::stage() {
  Batch host;
  if (!pass_.next(host)) return false;
  Staged s;
  bool copying = false;
  for (auto& t : host.tensors) {
    if (!t.defined() || !t.is_cpu()) continue;  // already on the device (data.on_device)
    if (!copying) copying = true;
    if (!t.is_pinned()) t = t.pin_memory();
  }
  if (copying) {
    // The copies are queued on the side stream and return at once; the allocator remembers
    // the pinned sources until the copies are done.
    c10::StreamGuard guard(*side_);
    for (auto& t : host.tensors)
      if (t.defined() && t.is_cpu()) t = t.to(device_, /*non_blocking=*/true);
    s.copied.emplace(device_.type());
    s.copied->record(*side_);
  }
  s.batch = std::move(host);
  staged_ = std::move(s);
  return true;
}

Batch DeviceFeed::prepare(Batch batch) {
  Batch b = runtime_.to_device(std::move(batch));
  return options_.channels_last ? batch_to_channels_last(std::move(b)) : b;
}

bool DeviceFeed::next(Batch& out) {
  if (!async_) {
    Batch host;
    if (!pass_.next(host)) return false;
    out = prepare(std::move(host));
    return true;
  }
  if (!staged_ && !stage()) return false;
  Staged current = std::move(*staged_);
  staged_.reset();
  if (current.copied) {
    c10::impl::VirtualGuardImpl impl(device_.type());
    const c10::Stream compute = impl.getStream(device_);
    current.copied->block(compute);  // the step waits for its batch's copy, the host does not
    // Memory allocated on the side stream is now used on the compute stream.
    for (auto& t : current.batch.tensors)
      if (t.defined() && t.device() == device_) t.record_stream(compute);
  }
  stage();  // the next batch's copy overlaps this batch's step
  out = prepare(std::move(current.batch));
  return true;
}

}  // namespace ember::engine
