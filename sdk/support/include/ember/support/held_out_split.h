// `val_split`: the samples a data module holds out of its training set for validation, chosen by a
// permutation from a generator seeded with trainer.seed, so the split is the same in every run
// and on every rank and never overlaps what trains (fashion_mnist, image_folder,
// text_classification and tensor_files share it).
#pragma once
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace ember {

struct HeldOutSplit {
  at::Tensor perm;     // int64 [n]: a permutation of 0 .. n-1
  int64_t n_val = 0;   // its first n_val are held out
  at::Tensor val() const { return perm.narrow(0, 0, n_val); }
  at::Tensor train() const { return perm.narrow(0, n_val, perm.size(0) - n_val); }
};

// round(fraction * n) of `n` samples held out, at most n - 1 (something always trains).
inline HeldOutSplit held_out_split(int64_t n, double fraction, uint64_t seed) {
  HeldOutSplit out;
  out.n_val = std::max<int64_t>(0, std::min<int64_t>(n - 1, std::llround(fraction * static_cast<double>(n))));
  at::Generator gen = at::detail::createCPUGenerator(seed);
  out.perm = at::randperm(n, gen, at::kLong);
  return out;
}

}  // namespace ember
