#include <ember/support/image_transforms.h>

#include <ember/error.h>
#include <ember/support/image_decode.h>

namespace ember::image {

ImageTransform::ImageTransform(const ember::IConfig& cfg)
    : size_(cfg.get_int("image_size")), augment_(cfg.get_bool("augment")), flip_(cfg.get_bool("flip")) {
  const std::string section = cfg.section();
  auto pair = [&](const char* key) {
    const auto v = cfg.get_float_list(key);
    if (v.size() != 2 || v[0] > v[1])
      throw ember::ConfigError(cfg.where(key) + ": " + section + "." + key + " must be [low, high] with low <= high");
    return std::array<double, 2>{v[0], v[1]};
  };
  scale_ = pair("scale");
  ratio_ = pair("ratio");
  auto triple = [&](const char* key) {
    const auto v = cfg.get_float_list(key);
    if (v.size() != 3) throw ember::ConfigError(cfg.where(key) + ": " + section + "." + key + " needs one value per channel (R, G, B)");
    return v;
  };
  const at::Tensor mean = at::tensor(triple("mean"), at::kFloat).view({3, 1, 1});
  const at::Tensor std = at::tensor(triple("std"), at::kFloat).view({3, 1, 1});
  scale_per_channel_ = 1.0 / (255.0 * std);
  shift_per_channel_ = mean / std;
  const int64_t resize = cfg.get_int("resize");
  resize_ = resize > 0 ? resize : static_cast<int64_t>(static_cast<double>(size_) / 0.875);
  if (resize_ < size_)
    throw ember::ConfigError(cfg.where("resize") + ": " + section + ".resize = " + std::to_string(resize_) +
                             " is smaller than image_size = " + std::to_string(size_) + ": the centre crop would not fit");
}

at::Tensor ImageTransform::operator()(const std::string& bytes, const std::string& name, bool train, uint64_t seed, int64_t sample,
                                      int64_t epoch) const {
  train = train && augment_;
  const auto info = probe_image(bytes, name);
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(sample) * 0xBF58476D1CE4E5B9ull ^
                      static_cast<uint64_t>(epoch + 1) * 0x94D049BB133111EBull);
  CropBox box;
  const int64_t out_h = size_, out_w = size_;
  if (train) {
    box = random_resized_crop(info.height, info.width, scale_, ratio_, rng);
  } else {
    // Resize the shorter side to resize_, then the centre crop: the same as cropping the
    // corresponding box of the original and resizing it straight to size x size.
    const auto shape = resized_shape(info.height, info.width, resize_);
    const auto c = center_crop(shape[0], shape[1], size_);
    const double sy = static_cast<double>(info.height) / static_cast<double>(shape[0]), sx = static_cast<double>(info.width) / static_cast<double>(shape[1]);
    box = {static_cast<int64_t>(std::llround(c.top * sy)), static_cast<int64_t>(std::llround(c.left * sx)),
           std::max<int64_t>(1, static_cast<int64_t>(std::llround(c.height * sy))), std::max<int64_t>(1, static_cast<int64_t>(std::llround(c.width * sx)))};
    box.height = std::min(box.height, info.height - box.top);
    box.width = std::min(box.width, info.width - box.left);
  }
  int denominator = 1;
  if (info.jpeg)
    for (int d : {8, 4, 2})
      if (box.height / d >= out_h && box.width / d >= out_w) {
        denominator = d;
        break;
      }
  const at::Tensor pixels = decode_image(bytes, name, denominator);
  // The box in the decoded image's pixels (libjpeg rounds a scaled size up).
  const double ry = static_cast<double>(pixels.size(0)) / static_cast<double>(info.height), rx = static_cast<double>(pixels.size(1)) / static_cast<double>(info.width);
  const int64_t top = std::min<int64_t>(pixels.size(0) - 1, static_cast<int64_t>(box.top * ry));
  const int64_t left = std::min<int64_t>(pixels.size(1) - 1, static_cast<int64_t>(box.left * rx));
  const int64_t h = std::clamp<int64_t>(static_cast<int64_t>(std::llround(box.height * ry)), 1, pixels.size(0) - top);
  const int64_t w = std::clamp<int64_t>(static_cast<int64_t>(std::llround(box.width * rx)), 1, pixels.size(1) - left);
  at::Tensor planes = resize_to_planes(pixels.narrow(0, top, h).narrow(1, left, w), out_h, out_w);
  if (train && flip_ && std::uniform_int_distribution<int>(0, 1)(rng) == 1) planes = planes.flip(-1);
  // (x / 255 - mean) / std as one multiply and one subtract.
  return planes.mul_(scale_per_channel_).sub_(shift_per_channel_);
}

}  // namespace ember::image
