// What a model's tensor-parallel plan is built from (ember/tensor_parallel.h): Megatron-LM's
// differentiable collectives (with and without sequence parallelism), the vocabulary-parallel
// embedding and cross-entropy, the randomness of dropout in split regions (its second
// generator), and the slicing of a whole tensor into a rank's shard and back.
//
//   column-parallel linear:  y_r = copy_to_tensor_parallel(x) W_r^T + b_r    (W split on dim 0)
//   row-parallel linear:     y   = reduce_from_tensor_parallel(x_r W_r^T) + b (W split on dim 1)
//
// A column-parallel layer followed by a row-parallel one (attention's q/k/v then its output
// projection; the feed-forward block's two layers) costs one all-reduce forward and one backward.
// Header-only.
#pragma once
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "ember/error.h"
#include "ember/model.h"
#include "ember/tensor_parallel.h"

namespace ember {

namespace tensor_parallel_detail {

inline int64_t group_handle(ITensorParallelGroup& g) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(&g)); }
inline ITensorParallelGroup& group_of(const torch::autograd::AutogradContext* ctx) {
  return *reinterpret_cast<ITensorParallelGroup*>(static_cast<intptr_t>(ctx->saved_data.at("group").toInt()));
}
inline at::Tensor summed(const at::Tensor& t, ITensorParallelGroup& g) {
  at::Tensor out = t.contiguous().clone();
  g.all_reduce_sum(out);
  return out;
}

// Megatron's f: identity forward; backward sums the gradient over the ranks (each rank's slice
// of the next layer contributed a part of the input's gradient).
struct CopyToTensorParallel : torch::autograd::Function<CopyToTensorParallel> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    return {summed(grads[0], group_of(ctx)), at::Tensor()};
  }
};

// Megatron's g: forward sums the ranks' partial results; backward is the identity (every rank
// needs the whole gradient of the sum).
struct ReduceFromTensorParallel : torch::autograd::Function<ReduceFromTensorParallel> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    (void)ctx;
    return summed(x, *reinterpret_cast<ITensorParallelGroup*>(static_cast<intptr_t>(group)));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

}  // namespace tensor_parallel_detail

// The input of a column-parallel layer (Megatron's f). Identity on a group of one.
inline at::Tensor copy_to_tensor_parallel(const at::Tensor& x, ITensorParallelGroup& group) {
  if (group.size() == 1) return x;
  return tensor_parallel_detail::CopyToTensorParallel::apply(x, tensor_parallel_detail::group_handle(group));
}

// The output of a row-parallel layer, before its bias (Megatron's g). Identity on a group of one.
inline at::Tensor reduce_from_tensor_parallel(const at::Tensor& x, ITensorParallelGroup& group) {
  if (group.size() == 1) return x;
  return tensor_parallel_detail::ReduceFromTensorParallel::apply(x, tensor_parallel_detail::group_handle(group));
}

// ---- sequence parallelism (Megatron's): outside the split layers activations hold 1 / size of
// the positions. A column-parallel layer's input is gathered along the sequence (its gradient
// reduce-scattered), a row-parallel layer's output reduce-scattered instead of all-reduced.
namespace tensor_parallel_detail {

inline void check_sequence(const at::Tensor& x, int64_t dim, ITensorParallelGroup& g) {
  if (x.size(dim) % g.size() != 0)
    throw RunError(c10::str("a sequence of ", x.size(dim), " positions cannot be split over tensor_parallel = ", g.size(),
                            " ranks (parallelism.sequence_parallel): make the length a multiple of ", g.size(),
                            ", or set sequence_parallel = false"));
}
inline at::Tensor split_along(const at::Tensor& x, int64_t dim, ITensorParallelGroup& g) {
  check_sequence(x, dim, g);
  return x.chunk(g.size(), dim)[g.rank()].contiguous();
}
inline at::Tensor gather_along(const at::Tensor& x, int64_t dim, ITensorParallelGroup& g) {
  return g.all_gather(x.movedim(dim, 0).contiguous()).flatten(0, 1).movedim(0, dim).contiguous();
}
inline at::Tensor reduce_scatter_along(const at::Tensor& x, int64_t dim, ITensorParallelGroup& g) {
  check_sequence(x, dim, g);
  return g.reduce_scatter_sum(x.movedim(dim, 0).contiguous()).movedim(0, dim).contiguous();
}
inline ITensorParallelGroup& group_at(int64_t handle) { return *reinterpret_cast<ITensorParallelGroup*>(static_cast<intptr_t>(handle)); }

struct ScatterToSequence : torch::autograd::Function<ScatterToSequence> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t dim, int64_t group) {
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["group"] = group;
    return split_along(x, dim, group_at(group));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    return {gather_along(grads[0], ctx->saved_data.at("dim").toInt(), group_of(ctx)), at::Tensor(), at::Tensor()};
  }
};

struct GatherFromSequence : torch::autograd::Function<GatherFromSequence> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t dim, int64_t group, bool partial) {
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["group"] = group;
    ctx->saved_data["partial"] = partial;
    return gather_along(x, dim, group_at(group));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const int64_t dim = ctx->saved_data.at("dim").toInt();
    auto& g = group_of(ctx);
    // A split layer's input gradient is a partial sum per rank; a replicated consumer's is whole.
    at::Tensor grad = ctx->saved_data.at("partial").toBool() ? reduce_scatter_along(grads[0], dim, g) : split_along(grads[0], dim, g);
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct ReduceScatterToSequence : torch::autograd::Function<ReduceScatterToSequence> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t dim, int64_t group) {
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["group"] = group;
    return reduce_scatter_along(x, dim, group_at(group));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    return {gather_along(grads[0], ctx->saved_data.at("dim").toInt(), group_of(ctx)), at::Tensor(), at::Tensor()};
  }
};

}  // namespace tensor_parallel_detail

// This rank's positions of a whole (replicated) activation along `dim`.
inline at::Tensor scatter_to_sequence_parallel(const at::Tensor& x, int64_t dim, ITensorParallelGroup& group) {
  if (group.size() == 1) return x;
  return tensor_parallel_detail::ScatterToSequence::apply(x, dim, tensor_parallel_detail::group_handle(group));
}
// The whole sequence from every rank's positions. `into_split_layer`: the result feeds a
// column-parallel layer (backward reduce-scatters the ranks' partial gradients); false: a
// replicated computation (backward keeps this rank's positions of the whole gradient).
inline at::Tensor gather_from_sequence_parallel(const at::Tensor& x, int64_t dim, ITensorParallelGroup& group, bool into_split_layer) {
  if (group.size() == 1) return x;
  return tensor_parallel_detail::GatherFromSequence::apply(x, dim, tensor_parallel_detail::group_handle(group), into_split_layer);
}
// A row-parallel layer's partial output summed over the ranks, this rank keeping its positions.
inline at::Tensor reduce_scatter_to_sequence_parallel(const at::Tensor& x, int64_t dim, ITensorParallelGroup& group) {
  if (group.size() == 1) return x;
  return tensor_parallel_detail::ReduceScatterToSequence::apply(x, dim, tensor_parallel_detail::group_handle(group));
}

// The input of a column-parallel layer and the output of a row-parallel one, with or without
// sequence parallelism (group.sequence_parallel()): what a block's plan calls.
inline at::Tensor enter_tensor_parallel(const at::Tensor& x, int64_t sequence_dim, ITensorParallelGroup& group) {
  return group.sequence_parallel() ? gather_from_sequence_parallel(x, sequence_dim, group, true) : copy_to_tensor_parallel(x, group);
}
inline at::Tensor leave_tensor_parallel(const at::Tensor& x, int64_t sequence_dim, ITensorParallelGroup& group) {
  return group.sequence_parallel() ? reduce_scatter_to_sequence_parallel(x, sequence_dim, group) : reduce_from_tensor_parallel(x, group);
}

namespace tensor_parallel_detail {

// Cross-entropy over logits whose vocabulary is split over the group (Megatron's
// vocab_parallel_cross_entropy): the softmax's maximum and denominator and the target's logit are
// reduced over the ranks, so no rank ever holds the whole [rows, vocabulary] logits. Mean over rows.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets, int64_t group) {
    auto& g = *reinterpret_cast<ITensorParallelGroup*>(static_cast<intptr_t>(group));
    const int64_t local = logits.size(1), start = g.rank() * local;
    at::Tensor x = logits.to(at::kFloat);
    at::Tensor max = g.all_gather(std::get<0>(x.max(1)).contiguous()).amax(0);
    at::Tensor shifted = x - max.unsqueeze(1);
    at::Tensor exp = shifted.exp();
    at::Tensor sum = exp.sum(1).contiguous();
    g.all_reduce_sum(sum);
    const at::Tensor outside = (targets < start).logical_or(targets >= start + local);
    const at::Tensor local_targets = (targets - start).masked_fill(outside, 0);
    at::Tensor target_logit = shifted.gather(1, local_targets.unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0).contiguous();
    g.all_reduce_sum(target_logit);
    at::Tensor softmax = exp / sum.unsqueeze(1);
    ctx->save_for_backward({softmax, local_targets, outside});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return (sum.log() - target_logit).mean();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad = saved[0].clone();
    const at::Tensor inside = saved[2].logical_not().to(grad.scalar_type());
    grad.scatter_add_(1, saved[1].unsqueeze(1), -inside.unsqueeze(1));
    grad.mul_(grads[0] / static_cast<double>(grad.size(0)));
    return {grad.to(static_cast<at::ScalarType>(ctx->saved_data.at("dtype").toInt())), at::Tensor(), at::Tensor()};
  }
};

}  // namespace tensor_parallel_detail

// The rows of an embedding whose vocabulary (weight's dimension 0) is split over the group: each
// rank looks up the ids in its range, the others give zeros, and the sum joins them (under
// sequence parallelism each rank keeps its positions of dimension `sequence_dim` of the result).
inline at::Tensor vocab_parallel_embedding(const at::Tensor& ids, const at::Tensor& weight_slice, ITensorParallelGroup& group,
                                           int64_t sequence_dim) {
  if (group.size() == 1) return at::embedding(weight_slice, ids);
  const int64_t local = weight_slice.size(0), start = group.rank() * local;
  const at::Tensor outside = (ids < start).logical_or(ids >= start + local);
  at::Tensor rows = at::embedding(weight_slice, (ids - start).masked_fill(outside, 0));
  rows = rows.masked_fill(outside.unsqueeze(-1), 0.0);
  return leave_tensor_parallel(rows, sequence_dim, group);
}

// Mean cross-entropy of logits [rows, vocabulary / size] (this rank's columns, in rank order)
// against targets [rows] (whole vocabulary ids); the same value on every rank.
inline at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, ITensorParallelGroup& group) {
  if (group.size() == 1) return at::cross_entropy_loss(logits, targets);
  return tensor_parallel_detail::VocabParallelCrossEntropy::apply(logits, targets, tensor_parallel_detail::group_handle(group));
}

// ---- Megatron's second generator (its RNG tracker's fork) ----
// Dropout in a split region, where each rank of the group holds other values (its heads, a
// column-parallel layer's outputs, a sequence-parallel rank's positions), must draw masks that are
// independent over the ranks, as one device's would be; dropout on replicated activations must
// draw the same mask on every rank of the group (else their copies drift apart), which the
// default generators do: every rank seeds them alike and draws alike. While a
// SplitRegionRandomness lives, `device`'s default generator is seeded from one draw of the
// default CPU generator (the same draw on every rank, so the generators stay in step) mixed with
// the rank; when it ends, the generator goes on from where that draw left it. Everything derives
// from the default generators, which checkpoints keep, so a resumed run draws the same masks.
// Nothing happens on a group of one.
class SplitRegionRandomness {
 public:
  SplitRegionRandomness(ITensorParallelGroup& group, c10::Device device) {
    if (group.size() == 1) return;
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    uint64_t seed = 0;
    {
      std::lock_guard<std::mutex> lock(cpu.mutex());
      seed = at::check_generator<at::CPUGeneratorImpl>(cpu)->random64();
    }
    generator_ = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(generator_.mutex());
    saved_ = generator_.get_state();
    // splitmix64's increment spreads the ranks' seeds apart.
    generator_.set_current_seed(seed ^ (0x9E3779B97F4A7C15ull * static_cast<uint64_t>(group.rank() + 1)));
  }
  ~SplitRegionRandomness() {
    if (!saved_.defined()) return;
    std::lock_guard<std::mutex> lock(generator_.mutex());
    generator_.set_state(saved_);
  }
  SplitRegionRandomness(const SplitRegionRandomness&) = delete;
  SplitRegionRandomness& operator=(const SplitRegionRandomness&) = delete;

 private:
  at::Generator generator_;
  at::Tensor saved_;
};

// fn() in a split region (SplitRegionRandomness) when it draws anything (`draws`: training with a
// dropout probability above 0; not drawing leaves the generators untouched), else fn() as it is.
template <class Fn>
at::Tensor in_split_region(ITensorParallelGroup* group, c10::Device device, bool draws, Fn&& fn) {
  if (!group || !draws || group->size() == 1) return fn();
  SplitRegionRandomness fork(*group, device);
  return fn();
}

// Throws ember::ConfigError unless `whole` splits as `shard` says over `size` ranks.
inline void check_splits(const at::Tensor& whole, const TensorShard& shard, int64_t size) {
  if (shard.dim < 0 || shard.dim >= whole.dim() || shard.blocks < 1 || whole.size(shard.dim) % (shard.blocks * size) != 0)
    throw ConfigError(c10::str("'", shard.name, "' of shape ", whole.sizes(), " cannot be split ", size, " ways along dimension ",
                               shard.dim, (shard.blocks > 1 ? c10::str(" in ", shard.blocks, " blocks") : std::string()),
                               ": choose a tensor_parallel degree that divides it"));
}

// Rank `rank`'s slice of the whole tensor (a view where possible; clone it to own it).
inline at::Tensor shard_of(const at::Tensor& whole, const TensorShard& shard, int64_t rank, int64_t size) {
  check_splits(whole, shard, size);
  std::vector<at::Tensor> pieces;
  for (const auto& block : whole.chunk(shard.blocks, shard.dim)) pieces.push_back(block.chunk(size, shard.dim)[rank]);
  return pieces.size() == 1 ? pieces.front() : at::cat(pieces, shard.dim);
}

// The whole tensor from every rank's slice (slices[r] is rank r's, e.g. ITensorParallelGroup::
// all_gather's result unbound along dimension 0).
inline at::Tensor whole_of(const std::vector<at::Tensor>& slices, const TensorShard& shard) {
  std::vector<at::Tensor> blocks;
  for (int64_t b = 0; b < shard.blocks; ++b) {
    std::vector<at::Tensor> pieces;
    for (const auto& s : slices) pieces.push_back(s.chunk(shard.blocks, shard.dim)[b]);
    blocks.push_back(at::cat(pieces, shard.dim));
  }
  return blocks.size() == 1 ? blocks.front() : at::cat(blocks, shard.dim);
}

// Replaces a parameter's values by this rank's slice: the same Variable (registered name,
// requires_grad) with a smaller shape. A parameter without storage (deferred initialisation,
// ember/deferred_init.h: the strategy kept its slice as the model was built) gets the slice's
// shape and stays without storage.
inline void keep_shard(at::Tensor& parameter, const TensorShard& shard, int64_t rank, int64_t size) {
  at::NoGradGuard no_grad;
  if (parameter.numel() > 0 && parameter.storage().data_ptr().get() == nullptr) {
    const auto shape = shard_of(at::empty(parameter.sizes(), parameter.options().device(at::kMeta)), shard, rank, size).sizes().vec();
    at::Tensor slice = at::empty(shape, parameter.options());
    auto* storage = slice.storage().unsafeGetStorageImpl();
    storage->set_data_ptr_noswap(at::DataPtr(nullptr, slice.device()));
    storage->set_nbytes(0);
    parameter.set_data(slice);
    return;
  }
  parameter.set_data(shard_of(parameter.detach(), shard, rank, size).clone());
}

// The model's tensor-parallel plan, for a strategy whose mesh has tensor_parallel > 1; a model
// without one is one line that says what to change.
inline ITensorParallelModel& tensor_parallel_plan_of(IModel& model, int64_t tensor_parallel) {
  auto* plan = static_cast<ITensorParallelModel*>(model.query_interface(kTensorParallelModelIid));
  if (!plan)
    throw ConfigError("parallelism.tensor_parallel = " + std::to_string(tensor_parallel) +
                      ": the model has no tensor-parallel plan (it does not implement ember::ITensorParallelModel); set "
                      "tensor_parallel = 1, or use a model that has one (transformer, gpt; docs/parallelism.md)");
  return *plan;
}

}  // namespace ember
