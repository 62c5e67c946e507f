// The last leg of the data path: a loader pass's host batches, moved to the training device and
// prepared for the step (precision's input cast, channels-last). On CUDA, host batches are copied
// from pinned memory with non_blocking on a side stream, one batch ahead, so the copy of batch
// i+1 overlaps the step of batch i (PyTorch's pin_memory=True plus a prefetcher).
#pragma once
#include <ember/types.h>

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <optional>

#include "data/data_loader.h"

namespace torch::nn { class Module; }

namespace ember::engine {

class Runtime;

struct FeedOptions {
  bool pin_memory = true;      // data.pin_memory: pinned, asynchronous, one batch ahead (CUDA only)
  bool channels_last = false;  // trainer.channels_last: 4-d floating inputs in NHWC
};

class DeviceFeed {
 public:
  // Batches go to the device through the runtime (the strategy's placement, then the precision
  // handler's input cast).
  DeviceFeed(DataLoader::Pass& pass, Runtime& runtime, const FeedOptions& options);
  ~DeviceFeed();
  DeviceFeed(const DeviceFeed&) = delete;
  DeviceFeed& operator=(const DeviceFeed&) = delete;
  // The next batch, on the device and ready for the step; false at the end of the pass.
  bool next(Batch& out);

 private:
  struct Staged {
    Batch batch;
    std::optional<c10::Event> copied;  // recorded on the side stream after the copy
  };
  bool stage();  // takes the next host batch and starts its copy; false at the end of the pass
  Batch prepare(Batch batch);

  DataLoader::Pass& pass_;
  Runtime& runtime_;
  FeedOptions options_;
  c10::Device device_;
  bool async_ = false;                 // CUDA and pin_memory
  std::optional<c10::Stream> side_;    // the copy stream
  std::optional<Staged> staged_;
};

// Converts the 4-d floating parameters and buffers of `module` to channels-last memory format
// (PyTorch's module.to(memory_format=torch.channels_last)).
void to_channels_last(torch::nn::Module& module);

// Converts 4-d floating tensors of `batch` to channels-last.
Batch batch_to_channels_last(Batch batch);

}  // namespace ember::engine
