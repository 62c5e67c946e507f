// Coalesced collectives' common part (communicator.cpp, device_mesh.cpp): one collective per
// dtype over the tensors flattened into one buffer instead of one per tensor.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

namespace ember_dist {

// Runs `collective(flat, dtype)` once per dtype on the tensors of that dtype flattened into one
// buffer, then copies the result back into each tensor.
template <class F>
void for_each_dtype_flattened(const std::vector<at::Tensor>& tensors, const F& collective) {
  std::vector<at::ScalarType> dtypes;
  for (const auto& t : tensors)
    if (std::find(dtypes.begin(), dtypes.end(), t.scalar_type()) == dtypes.end()) dtypes.push_back(t.scalar_type());
  at::NoGradGuard no_grad;
  for (const auto dtype : dtypes) {
    std::vector<at::Tensor> group;
    for (const auto& t : tensors)
      if (t.scalar_type() == dtype) group.push_back(t.detach().reshape({-1}));
    at::Tensor flat = at::cat(group);
    collective(flat, dtype);
    int64_t offset = 0;
    for (const auto& t : tensors) {
      if (t.scalar_type() != dtype) continue;
      t.detach().copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

}  // namespace ember_dist
