// trainer.cuda_graph: the training step's forward, loss, zero_grad and backward (the loop's
// micro-batch) captured once as a CUDA graph and replayed for every later batch of the same shapes,
// so the host launches one graph instead of hundreds of kernels (small models on fast GPUs wait on
// those launches). The optimizer step, the loss scaler, clipping, schedulers and hooks stay outside
// the graph and run as usual around each replay.
//
// What the training loop does with it (docs/step.md, "CUDA graphs"):
//   - the first `warmup` steps run as usual (cuDNN/cuBLAS pick their algorithms and workspaces,
//     the optimizer makes its state);
//   - the next step's micro-batch is captured on a side stream with its batch in static tensors
//     (the metrics the model logs are recorded, not logged, during capture), then replayed once:
//     that is the step itself;
//   - every later step copies its batch into the static tensors and replays; the recorded
//     metrics are logged from the tensors the replay refreshed;
//   - a batch of other shapes (the last, smaller one of an epoch) runs as usual.
// This file holds the CUDA side only; it compiles without a GPU (LibTorch's CUDA build).
#pragma once
#include <ember/types.h>

#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <memory>

namespace ember::engine {

class StepGraph {
 public:
  StepGraph(c10::Device device, int64_t warmup_steps);
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  enum class Mode { eager, capture, replay };
  // What the step with this batch does: warm-up (and batches whose shapes differ from the
  // captured one) eager, then one capture, then replays.
  Mode mode_for(const Batch& batch) const;
  // The static batch (valid after load): what the captured step reads.
  const Batch& batch() const { return static_batch_; }
  // Copies `batch` into the static batch (made from it on first use).
  void load(const Batch& batch);
  // Runs `step` under capture on a side stream (autocast's cast cache off, as capture needs).
  // A step that cannot be captured is one RunError naming what failed.
  void capture(const std::function<void()>& step);
  // Runs the captured step on the current stream.
  void replay();
  void count_eager() { ++eager_; }
  int64_t replays() const { return replays_; }
  int64_t eager_steps() const { return eager_; }
  bool captured() const { return captured_; }
  // Whether a replay can take `batch` in place of `captured`: the same tensors, shapes, dtypes and
  // devices, and the same sample count (any strides: load() copies into the captured layout).
  static bool same_layout(const Batch& batch, const Batch& captured);

 private:
  struct Cuda;  // the CUDA graph, kept out of this header; made at the capture
  std::unique_ptr<Cuda> cuda_;
  c10::Device device_;
  int64_t warmup_;
  Batch static_batch_;
  bool captured_ = false;
  int64_t replays_ = 0, eager_ = 0;
};

}  // namespace ember::engine
