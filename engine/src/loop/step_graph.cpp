#include "loop/step_graph.h"

#include <ember/error.h>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <exception>
#include <string>

namespace ember::engine {

struct StepGraph::Cuda {
  at::cuda::CUDAGraph graph;
};

StepGraph::StepGraph(c10::Device device, int64_t warmup_steps) : device_(device), warmup_(warmup_steps) {}

StepGraph::~StepGraph() = default;

bool StepGraph::same_layout(const Batch& a, const Batch& b) {
  if (a.tensors.size() != b.tensors.size() || a.size != b.size) return false;
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const auto& x = a.tensors[i];
    const auto& y = b.tensors[i];
    if (x.defined() != y.defined()) return false;
    if (!x.defined()) continue;
    // Strides need not match: load() copies into the static tensors, whose layout the graph was
    // captured with.
    if (x.sizes() != y.sizes() || x.scalar_type() != y.scalar_type() || x.device() != y.device()) return false;
  }
  return true;
}

StepGraph::Mode StepGraph::mode_for(const Batch& batch) const {
  if (!captured_) return eager_ < warmup_ ? Mode::eager : Mode::capture;
  return same_layout(batch, static_batch_) ? Mode::replay : Mode::eager;
}

void StepGraph::load(const Batch& batch) {
  if (static_batch_.tensors.empty()) {
    static_batch_.size = batch.size;
    for (const auto& t : batch.tensors)
      static_batch_.tensors.push_back(t.defined() ? t.clone(at::MemoryFormat::Preserve) : at::Tensor());
    return;
  }
  for (size_t i = 0; i < batch.tensors.size(); ++i)
    if (batch.tensors[i].defined()) static_batch_.tensors[i].copy_(batch.tensors[i], /*non_blocking=*/true);
}

void StepGraph::capture(const std::function<void()>& step) {
  const auto index = device_.index() < 0 ? c10::cuda::current_device() : device_.index();
  c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(index);
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index);
  at::cuda::CUDAEvent before, after;
  before.record(current);  // the side stream starts after what is queued (the static batch's copy)
  before.block(side);
  cuda_ = std::make_unique<Cuda>();
  const bool cache = at::autocast::is_autocast_cache_enabled();
  std::string failure;
  {
    c10::cuda::CUDAStreamGuard guard(side);
    at::autocast::set_autocast_cache_enabled(false);
    try {
      // Thread-local: a data-loading thread that pins host memory meanwhile is not an error; this
      // thread's (and the capture's) unsafe calls still are.
      cuda_->graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
      try {
        step();
      } catch (const std::exception& e) {
        failure = e.what();
      }
      try {
        cuda_->graph.capture_end();
      } catch (const std::exception& e) {
        if (failure.empty()) failure = e.what();
      }
    } catch (const std::exception& e) {
      failure = e.what();
    }
    at::autocast::set_autocast_cache_enabled(cache);
  }
  if (!failure.empty()) {
    // The first line of LibTorch's message says what was refused (a synchronization, a host read).
    const auto nl = failure.find('\n');
    throw RunError("trainer.cuda_graph: the training step could not be captured as a CUDA graph: " +
                   failure.substr(0, nl) + " (set trainer.cuda_graph = false to train without it)");
  }
  after.record(side);
  after.block(current);
  captured_ = true;
}

void StepGraph::replay() {
  cuda_->graph.replay();
  ++replays_;
}

}  // namespace ember::engine
