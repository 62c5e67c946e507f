// PyTorch's pruning methods (torch.nn.utils.prune) as mask updates: which entries of a tensor, or
// of several tensors taken together, to prune next. A mask is a bool tensor of its tensor's shape,
// true where the entry is kept. As in PyTorch's PruningContainer, an amount applies to what is not
// pruned yet (pruning 0.5 twice keeps a quarter), and entries pruned before stay pruned. The same
// scores, the same at::topk calls and Python's rounding make the same choice as PyTorch on the same
// tensors (tests/pruning_test.cpp compares them).
#pragma once
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace ember::pruning {

enum class Method { l1_unstructured, random_unstructured, ln_structured, random_structured };

// "l1_unstructured" -> Method::l1_unstructured; throws std::invalid_argument for another name.
Method method_named(const std::string& name);
bool is_structured(Method m);

// How much to prune at once: a count of entries (channels, when structured), or a fraction of
// those not pruned yet (rounded as Python's round() does: half to even).
struct Amount {
  bool is_count = false;
  int64_t count = 0;
  double fraction = 0.0;
  // How many of `available` to prune. Throws std::invalid_argument when a count exceeds them.
  int64_t of(int64_t available) const;
};

// Unstructured methods on one tensor (l1: the smallest magnitudes; random: uniformly).
void prune_unstructured(Method method, const at::Tensor& values, at::Tensor& mask, const Amount& amount, at::Generator& gen);

// Unstructured methods over several tensors as one (torch.nn.utils.prune.global_unstructured).
void prune_global_unstructured(Method method, const std::vector<at::Tensor>& values, std::vector<at::Tensor>& masks,
                               const Amount& amount, at::Generator& gen);

// What pruning across ranks needs: this rank's place, and an element-wise sum over the ranks that
// hold the parts of the tensors (every rank, under a sharding strategy).
struct ShardedRanks {
  int64_t rank = 0, world = 1;
  std::function<at::Tensor(const at::Tensor&)> sum;
};

// Unstructured methods when this rank holds a part (a 1-D shard) of each tensor, all ranks' parts
// in rank order making the flattened whole. The scores (magnitudes; for random, uniform draws from
// `gen`, which each rank seeds differently) are ranked across the ranks by bisection over their
// float32 bit patterns (about 32 sums per pruning), and the k smallest are pruned, ties broken by
// position (tensor, then rank, then index). For l1 that is the choice prune_unstructured and
// prune_global_unstructured make on the whole tensors wherever no two magnitudes tie.
void prune_sharded_unstructured(Method method, const std::vector<at::Tensor>& values, std::vector<at::Tensor>& masks, const Amount& amount,
                                bool global, at::Generator& gen, const ShardedRanks& ranks);

// Structured methods: whole slices along `dim` (output channels for dim 0), ranked by their
// L`norm` norm over the other dimensions (ln) or at random. Channels pruned before are left out.
// Throws std::invalid_argument for a tensor of fewer than two dimensions or a `dim` outside it.
void prune_structured(Method method, const at::Tensor& values, at::Tensor& mask, const Amount& amount, int64_t dim, double norm,
                      at::Generator& gen);

}  // namespace ember::pruning
