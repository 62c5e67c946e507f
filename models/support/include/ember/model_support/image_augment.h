// Random horizontal flips and random crops after padding (torchvision's RandomHorizontalFlip and
// RandomCrop(padding=p)) for batches of images [N, C, H, W], applied per sample on the device the
// batch is on. Shared by the image data plugins; header-only, so each plugin .so compiles its own
// copy and nothing is shared at run time.
//
// Deterministic: the random draws come from a CPU generator seeded by the caller (the data plugins
// seed it with trainer.seed, the epoch and the batch's sample indices), so a run, a resumed run
// and a run with loader workers see the same augmented batches.
#pragma once
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "ember/model_support/device_copy.h"

#include <cstdint>

namespace ember_models {

struct ImageAugment {
  bool flip = false;         // flip each image left-right with probability 1/2
  int64_t crop_padding = 0;  // pad each side by this many pixels, then crop back to H x W at a random offset
  double pad_value = 0.0;    // value of the padding (the data's value of a black pixel)
  bool enabled() const { return flip || crop_padding > 0; }
};

// FNV-1a over the sample indices: which samples a batch holds, and so (with the shuffle seeded
// by seed and epoch) which batch of which epoch it is.
inline uint64_t hash_indices(const int64_t* indices, int64_t count) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t i = 0; i < count; ++i) {
    h ^= static_cast<uint64_t>(indices[i]);
    h *= 1099511628211ull;
  }
  return h;
}

// Returns the augmented batch (a new tensor; `images` is not changed).
inline at::Tensor augment_images(const at::Tensor& images, const ImageAugment& a, uint64_t seed) {
  if (!a.enabled()) return images;
  const int64_t n = images.size(0), c = images.size(1), h = images.size(2), w = images.size(3), p = a.crop_padding;
  at::Generator gen = at::detail::createCPUGenerator(seed);
  const auto device = images.device();
  const auto long_opts = at::TensorOptions().dtype(at::kLong);
  // Column source of every output pixel: offset + x, or offset + (w - 1 - x) when flipped. The
  // flip and the horizontal crop are then one gather.
  at::Tensor cols = at::arange(w, long_opts).unsqueeze(0).expand({n, w});
  if (a.flip) {
    const at::Tensor flipped = at::rand({n}, gen) < 0.5;
    cols = at::where(flipped.unsqueeze(1), (w - 1) - cols, cols);
  }
  at::Tensor x = images;
  at::Tensor rows;
  if (p > 0) {
    const at::Tensor offsets = at::randint(0, 2 * p + 1, {n, 2}, gen, long_opts);
    rows = offsets.select(1, 0).unsqueeze(1) + at::arange(h, long_opts);
    cols = offsets.select(1, 1).unsqueeze(1) + cols;
    x = at::constant_pad_nd(images, {p, p, p, p}, a.pad_value);
    x = x.gather(2, to_device_without_sync(rows, device).view({n, 1, h, 1}).expand({n, c, h, w + 2 * p}));
  }
  return x.gather(3, to_device_without_sync(cols, device).view({n, 1, 1, w}).expand({n, c, h, w}));
}

}  // namespace ember_models
