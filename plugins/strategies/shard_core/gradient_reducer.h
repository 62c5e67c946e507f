// Gradients from whole to this rank's shard while backward runs: a hook on every parameter's
// gradient accumulator counts its group down, and each group that is ready is reduce-scattered
// (averaged over the ranks; under hybrid sharding then over the replicas) in a fixed order, the same on every rank; this rank's part joins the
// shard's gradient (stage 1: a view of its slice of the whole gradient; offload: copied to the
// host fp32 buffer, asynchronously on a GPU). Stage 3 frees a unit's parameters once its
// gradients are on their way. One rank: the gradient is its part, nothing is reduced.
#pragma once
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <vector>

#include "parameter_gather.h"
#include "shard_table.h"
#include "zero_context.h"

namespace ember_shard {

class GradientReducer {
 public:
  GradientReducer(ShardTable& table, ZeroContext ctx, ParameterGather& gather) : t_(table), c_(ctx), gather_(gather) {}
  GradientReducer(const GradientReducer&) = delete;  // the hooks hold `this`
  GradientReducer& operator=(const GradientReducer&) = delete;

  // Installs the hooks (once, after the shards exist). Throws ember::RunError for a parameter
  // that is not a leaf requiring grad.
  void hook_gradients(const std::string& strategy_name);
  // Around one micro-batch's backward. `syncing` = false: gradients stay whole and local
  // (stage 1 while accumulating); abandon() after a backward that threw.
  void begin(bool syncing);
  void end();
  void abandon();

 private:
  void on_gradient_ready(size_t k);
  void launch_scatter(size_t g);
  // Waits for group g's reduce-scatter and hands this rank's part of each gradient on.
  void finish_scatter(size_t g);
  // This rank's reduced gradient part of p (on the compute device) joins p's shard gradient.
  void deliver(ShardedParam& p, const at::Tensor& part);
  void average_over_replicas(at::Tensor& part, const std::string& what);
  // Offload: the host fp32 gradient buffer becomes (or accumulates) the shard's gradient.
  void land_on_host(ShardedParam& p, const at::Tensor& host_part);

  ShardTable& t_;
  ZeroContext c_;
  ParameterGather& gather_;
  bool in_backward_ = false, syncing_ = false;
  size_t next_ = 0, pending_params_ = 0;
  std::vector<size_t> landed_;  // offload on a GPU: fp32 gradient copies in flight to host_grad
  std::vector<size_t> staged_;  // offload on a GPU: accumulating gradient copies in flight to staging
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
};

}  // namespace ember_shard
