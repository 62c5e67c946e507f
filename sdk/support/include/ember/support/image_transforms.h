// torchvision's ImageNet transforms on decoded pixels (uint8 [H, W, 3]):
//   train: RandomResizedCrop(size, scale, ratio) + RandomHorizontalFlip(0.5)
//   eval:  Resize(resize) (the shorter side) + CenterCrop(size)
// then ToTensor + Normalize(mean, std): float32 [3, size, size]. Resizing is antialiased bilinear
// on the uint8 pixels (ATen's _upsample_bilinear2d_aa, torchvision v2's path). The random choices come from a
// generator seeded per sample (trainer.seed, epoch, sample index), so a sample gets the same crop
// in the same epoch however batches are loaded.
//
// ImageTransform (below) is the whole per-sample recipe, read from the keys of
// EMBER_IMAGE_TRANSFORM_KEYS: Ember::image, which image_folder and webdataset link.
#pragma once
#include <ATen/ATen.h>
#include <ember/config.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>

namespace ember::image {

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

// torchvision's ImageNet recipe on encoded image bytes (JPEG or PNG): decode (a JPEG shrunk in the
// DCT when the output is at most half its size), crop, resize, maybe flip, normalise. Thread-safe.
class ImageTransform {
 public:
  // Reads and checks the EMBER_IMAGE_TRANSFORM_KEYS of `cfg`; throws ember::ConfigError with the
  // key's file:line.
  explicit ImageTransform(const ember::IConfig& cfg);
  int64_t size() const { return size_; }
  // float [3, size, size]. `train`: the random transform (when the augment key is on), drawn from
  // a generator seeded by (seed, sample, epoch) so a sample gets the same crop in the same epoch
  // however batches are loaded. `name` (a path, a shard:key) goes into error messages.
  at::Tensor operator()(const std::string& bytes, const std::string& name, bool train, uint64_t seed, int64_t sample,
                        int64_t epoch) const;

 private:
  int64_t size_, resize_ = 0;
  bool augment_, flip_;
  std::array<double, 2> scale_{}, ratio_{};
  at::Tensor scale_per_channel_, shift_per_channel_;  // 1 / (255 std), mean / std
};

}  // namespace ember::image

// The config keys ImageTransform reads, for a data plugin's key list:
//   constexpr EmberConfigKey kKeys[] = { ...its own keys..., EMBER_IMAGE_TRANSFORM_KEYS };
#define EMBER_IMAGE_TRANSFORM_KEYS                                                                                                     \
  ember::key::Int("image_size", "224", "Side of the square images a batch holds.").at_least(1),                                         \
      ember::key::Int("resize", "0",                                                                                                   \
                      "Evaluation: the shorter side is resized to this before the centre crop of image_size; 0 = image_size / 0.875 " \
                      "(256 for 224, torchvision's ImageNet recipe); image_size = no crop.")                                           \
          .at_least(0),                                                                                                                 \
      ember::key::Bool("augment", "true",                                                                                              \
                       "Training images: random resized crop (scale, ratio) and a left-right flip (torchvision's RandomResizedCrop + " \
                       "RandomHorizontalFlip); false = the evaluation transform."),                                                    \
      ember::key::FloatList("scale", "[0.08, 1.0]", "Random resized crop: the range of the crop's area, as a fraction of the image's.") \
          .at_least(0.0)                                                                                                                \
          .at_most(1.0),                                                                                                                \
      ember::key::FloatList("ratio", "[0.75, 1.3333333333333333]", "Random resized crop: the range of the crop's aspect ratio (width / height).") \
          .above(0.0),                                                                                                                  \
      ember::key::Bool("flip", "true", "With augment: flip training images left-right with probability 1/2."),                         \
      ember::key::FloatList("mean", "[0.485, 0.456, 0.406]", "Per-channel mean subtracted after scaling pixels to [0, 1] (ImageNet's)."), \
      ember::key::FloatList("std", "[0.229, 0.224, 0.225]", "Per-channel standard deviation divided by (ImageNet's).").above(0.0)

