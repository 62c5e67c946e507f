#include "gradient_reducer.h"

#include <ember/error.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>

namespace ember_shard {

void GradientReducer::hook_gradients(const std::string& strategy_name) {
  for (size_t k = 0; k < t_.params.size(); ++k) {
    if (!t_.params[k].trainable) continue;
    auto acc = torch::autograd::impl::grad_accumulator(t_.params[k].param);
    if (!acc) throw ember::RunError(strategy_name + ": parameter '" + t_.params[k].name + "' is not a leaf tensor that requires grad");
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, k](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list& /*inputs*/) {
          on_gradient_ready(k);
          return outputs;
        }));
    accumulators_.push_back(std::move(acc));
  }
}

void GradientReducer::begin(bool syncing) {
  syncing_ = syncing;
  in_backward_ = true;
  next_ = 0;
  for (auto& grp : t_.groups) {
    grp.pending = 0;
    for (size_t k : grp.params)
      if (t_.params[k].trainable) ++grp.pending;
    grp.ready = grp.pending == 0;
    grp.launched = false;
    grp.scatter_work.reset();
  }
  pending_params_ = 0;
  for (const auto& p : t_.params)
    if (p.trainable) ++pending_params_;
}

void GradientReducer::on_gradient_ready(size_t k) {
  if (!in_backward_ || !syncing_) return;
  auto& grp = t_.groups[t_.params[k].group];
  if (grp.ready) return;
  --pending_params_;
  if (--grp.pending == 0) grp.ready = true;
  // Strictly in the fixed order, the same on every rank.
  while (next_ < t_.order.size() && t_.groups[t_.order[next_]].ready) launch_scatter(t_.order[next_++]);
  // Offload: parts whose reduce-scatter already completed go to the host while backward runs.
  // Not under hybrid sharding: finishing one starts its all-reduce over the replicas, and those
  // must start in the same order on every rank (one MPI thread runs every group's collectives in
  // the order they came; a rank that finished early would wait on one its peers queued later).
  if (c_.o.offload && c_.world() > 1 && c_.replicas.size == 1)
    for (size_t i = 0; i < next_; ++i) {
      auto& grp = t_.groups[t_.order[i]];
      if (grp.scatter_work && grp.scatter_work->isCompleted()) finish_scatter(t_.order[i]);
    }
}

void GradientReducer::launch_scatter(size_t g) {
  auto& grp = t_.groups[g];
  at::NoGradGuard no_grad;
  grp.launched = true;
  ++c_.stats.scatters;
  if (pending_params_ > 0) ++c_.stats.scatters_early;
  if (c_.world() == 1) {
    // Nothing to reduce: each gradient is this rank's part, delivered now (offload: its copy
    // to the host starts while backward goes on); averaged over the replicas first, if any.
    for (size_t k : grp.params) {
      auto& p = t_.params[k];
      if (!p.trainable || !p.param.grad().defined()) continue;
      at::Tensor part = p.param.grad().reshape({-1});
      average_over_replicas(part, p.name);
      deliver(p, part);
      if (c_.o.stage >= 2) p.param.mutable_grad() = at::Tensor();
    }
    if (c_.o.stage == 3 && grp.unit >= 0 && !t_.has_frozen(g)) gather_.release(g);
    return;
  }
  const auto& first = t_.params[grp.params.front()];
  grp.scatter_in = at::zeros({c_.world(), grp.row}, first.param.options().requires_grad(false));
  for (size_t k : grp.params) {
    auto& p = t_.params[k];
    if (!p.trainable || !p.param.grad().defined()) continue;
    at::Tensor padded = at::zeros({c_.world() * p.chunk}, grp.scatter_in.options());
    padded.narrow(0, 0, p.numel).copy_(p.param.grad().reshape({-1}));
    grp.scatter_in.narrow(1, p.offset, p.chunk).copy_(padded.view({c_.world(), p.chunk}));
    // Stage 2 and 3 keep no whole gradient.
    if (c_.o.stage >= 2) p.param.mutable_grad() = at::Tensor();
  }
  grp.scatter_out = at::empty({grp.row}, grp.scatter_in.options());
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::AVG;
  c_.comm.label("reduce-scatter of " + grp.name);
  at::Tensor flat = grp.scatter_in.view({-1});
  grp.scatter_work = c_.backend()._reduce_scatter_base(grp.scatter_out, flat, opts);
  // Stage 3: this unit's backward is done, its parameters can go. Not when the unit holds frozen
  // parameters (LoRA's base weights): its backward still needs them for the input's gradient
  // after the last trainable gradient arrived; the earlier unit's backward releases them.
  if (c_.o.stage == 3 && grp.unit >= 0 && !t_.has_frozen(g)) gather_.release(g);
}

void GradientReducer::finish_scatter(size_t g) {
  auto& grp = t_.groups[g];
  at::NoGradGuard no_grad;
  grp.scatter_work->wait();
  average_over_replicas(grp.scatter_out, grp.name);
  for (size_t k : grp.params) {
    auto& p = t_.params[k];
    if (p.trainable) deliver(p, grp.scatter_out.narrow(0, p.offset, p.valid));
  }
  grp.scatter_work.reset();
  grp.scatter_in = grp.scatter_out = at::Tensor();
}

// Hybrid sharding: a shard's reduced gradient is its replica's mean; the replicas holding the same
// shard average theirs, so every rank ends with the mean over all data-parallel ranks.
void GradientReducer::average_over_replicas(at::Tensor& part, const std::string& what) {
  if (c_.replicas.size == 1) return;
  std::vector<at::Tensor> one = {part};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::AVG;
  c_.comm.label("all-reduce over the replicas of " + what);
  c_.replicas.backend->allreduce(one, opts)->wait();
}

void GradientReducer::deliver(ShardedParam& p, const at::Tensor& part) {
  if (c_.o.offload) {
    ++c_.stats.host_copies;
    if (in_backward_ && pending_params_ > 0) ++c_.stats.host_copies_early;
    c_.stats.host_bytes += part.numel() * static_cast<int64_t>(part.element_size());
    if (c_.copies.async()) {
      const size_t k = static_cast<size_t>(&p - t_.params.data());
      if (!p.shard.grad().defined()) {
        // The step's first gradient: converted to fp32 on the device (cheap there) and copied
        // straight into the pinned fp32 buffer, which becomes the shard's gradient once the
        // copies landed (end_backward). No compute-dtype staging copy on the host: 2 bytes a
        // parameter less, and no conversion on the host.
        c_.copies.to_host(p.host_grad, part.to(p.host_grad.scalar_type()));
        c_.stats.host_bytes += part.numel() * static_cast<int64_t>(p.host_grad.element_size() - part.element_size());
        landed_.push_back(k);
      } else {
        // Accumulating (accumulate_grad_batches > 1): staged in the compute dtype and added into
        // the fp32 gradient on the host once landed. The staging buffer is made at the first
        // accumulating step (pinned, so the copy stays asynchronous).
        if (!p.staging.defined()) {
          c_.budget.take(p.valid * static_cast<int64_t>(part.element_size()), "the gradient staging buffer of '" + p.name + "'");
          p.staging = c_.copies.host_zeros(p.valid, part.scalar_type(), "the gradient staging buffer of '" + p.name + "'");
        }
        c_.copies.to_host(p.staging, part);
        staged_.push_back(k);
      }
    } else {
      land_on_host(p, part);
    }
    return;
  }
  if (c_.o.stage == 1 && p.param.grad().defined() && p.param.grad().is_contiguous()) {
    // Stage 1 keeps whole gradients: this rank's reduced part goes into its own slice of the
    // whole gradient, and the shard's gradient is a view of that slice (no extra copy).
    at::Tensor mine = p.param.grad().view({-1}).narrow(0, std::min(c_.rank() * p.chunk, p.numel), p.valid);
    if (!mine.is_same(part)) mine.copy_(part);
    p.shard.mutable_grad() = mine;
  } else if (p.shard.grad().defined()) {
    p.shard.mutable_grad().add_(part);
  } else {
    p.shard.mutable_grad() = part.clone();
  }
}

void GradientReducer::land_on_host(ShardedParam& p, const at::Tensor& host_part) {
  if (p.shard.grad().defined()) {
    p.shard.mutable_grad().add_(host_part);
  } else {
    p.host_grad.copy_(host_part);
    p.shard.mutable_grad() = p.host_grad;
  }
}

void GradientReducer::end() {
  if (!syncing_) {
    in_backward_ = false;
    if (c_.o.stage == 3) gather_.release_all();
    return;
  }
  // Backward has returned: what starts now does not overlap it. Groups whose parameters got
  // no gradient (unused in this step) reduce zeros, in order.
  pending_params_ = 0;
  for (; next_ < t_.order.size(); ++next_) launch_scatter(t_.order[next_]);
  if (c_.world() > 1)
    for (size_t g : t_.order)
      if (t_.groups[g].scatter_work) finish_scatter(g);
  if (!staged_.empty() || !landed_.empty()) {
    c_.copies.wait_host();
    for (size_t k : landed_) t_.params[k].shard.mutable_grad() = t_.params[k].host_grad;
    for (size_t k : staged_) land_on_host(t_.params[k], t_.params[k].staging);
    landed_.clear();
    staged_.clear();
  }
  in_backward_ = false;
  if (c_.o.stage == 3) gather_.release_all();
}

void GradientReducer::abandon() {
  for (auto& grp : t_.groups)
    if (grp.scatter_work) grp.scatter_work->wait();
  c_.copies.wait_host();
  landed_.clear();
  staged_.clear();
  in_backward_ = false;
  if (c_.o.stage == 3) gather_.release_all();
}

}  // namespace ember_shard
