// torchvision's ImageNet transforms on decoded pixels (uint8 [H, W, 3]):
//   train: RandomResizedCrop(size, scale, ratio) + RandomHorizontalFlip(0.5)
//   eval:  Resize(resize) (the shorter side) + CenterCrop(size)
// then ToTensor + Normalize(mean, std): float32 [3, size, size]. Resizing is antialiased bilinear
// on the uint8 pixels (ATen's _upsample_bilinear2d_aa, torchvision v2's path). The random choices come from a
// generator seeded per sample (trainer.seed, epoch, sample index), so a sample gets the same crop
// in the same epoch however batches are loaded.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <random>

namespace ember_image {

struct CropBox {
  int64_t top = 0, left = 0, height = 0, width = 0;
};

// torchvision's RandomResizedCrop.get_params: 10 tries at an area in `scale` and a log-uniform
// aspect ratio in `ratio`, else the whole image cropped to the nearest ratio in range.
inline CropBox random_resized_crop(int64_t height, int64_t width, std::array<double, 2> scale, std::array<double, 2> ratio,
                                   std::mt19937_64& rng) {
  const double area = static_cast<double>(height * width);
  const double log_lo = std::log(ratio[0]), log_hi = std::log(ratio[1]);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target = area * (scale[0] + (scale[1] - scale[0]) * unit(rng));
    const double aspect = std::exp(log_lo + (log_hi - log_lo) * unit(rng));
    const auto w = static_cast<int64_t>(std::llround(std::sqrt(target * aspect)));
    const auto h = static_cast<int64_t>(std::llround(std::sqrt(target / aspect)));
    if (w > 0 && h > 0 && w <= width && h <= height) {
      std::uniform_int_distribution<int64_t> top(0, height - h), left(0, width - w);
      const int64_t t = top(rng);
      return {t, left(rng), h, w};
    }
  }
  const double in_ratio = static_cast<double>(width) / static_cast<double>(height);
  int64_t w = width, h = height;
  if (in_ratio < ratio[0]) h = static_cast<int64_t>(std::llround(static_cast<double>(w) / ratio[0]));
  else if (in_ratio > ratio[1]) w = static_cast<int64_t>(std::llround(static_cast<double>(h) * ratio[1]));
  return {(height - h) / 2, (width - w) / 2, h, w};
}

// The shorter side to `resize`, the longer in proportion (torchvision's Resize(int): the long side
// truncated), then the centre `size` x `size` (torchvision's CenterCrop rounding).
inline std::array<int64_t, 2> resized_shape(int64_t height, int64_t width, int64_t resize) {
  if (height <= width) return {resize, static_cast<int64_t>(static_cast<double>(resize) * static_cast<double>(width) / static_cast<double>(height))};
  return {static_cast<int64_t>(static_cast<double>(resize) * static_cast<double>(height) / static_cast<double>(width)), resize};
}
inline CropBox center_crop(int64_t height, int64_t width, int64_t size) {
  return {static_cast<int64_t>(std::llround(static_cast<double>(height - size) / 2.0)),
          static_cast<int64_t>(std::llround(static_cast<double>(width - size) / 2.0)), size, size};
}

// uint8 pixels [h, w, 3] resized to [3, height, width] float in [0, 255]. The resize runs on the
// uint8 pixels in channels-last layout (an HWC image is one), where ATen has a vectorised
// antialiased bilinear kernel (what torchvision's v2 transforms use), and only the output is
// converted to float.
inline at::Tensor resize_to_planes(const at::Tensor& hwc, int64_t height, int64_t width) {
  at::Tensor nchw = hwc.unsqueeze(0).permute({0, 3, 1, 2});  // channels-last strides
  if (nchw.size(2) != height || nchw.size(3) != width)
    nchw = at::_upsample_bilinear2d_aa(nchw.contiguous(at::MemoryFormat::ChannelsLast), {height, width}, /*align_corners=*/false);
  return nchw.squeeze(0).to(at::kFloat);
}

}  // namespace ember_image
