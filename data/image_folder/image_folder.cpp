// image_folder: your own images in torchvision's ImageFolder layout, <root>/<class>/**/*.{jpg,jpeg,png}
// (class = the sub-folder, classes in sorted order, files in sorted walk order: torchvision's), with
// optional val_root / test_root folders of the same classes, or val_split of root held out.
// Decoded with libjpeg-turbo and libpng on the loader's threads (data.num_workers), never through
// Python; transformed as torchvision's ImageNet recipe does (train: random resized crop and flip;
// eval: resize and centre crop; then normalised). Every file's header is read at setup: a file that
// is not a readable JPEG or PNG stops the run naming it (bad_images = "stop") or is left out and
// counted (bad_images = "skip").
#include <ember/data.h>
#include <ember/error.h>
#include <ember/plugin.h>
#include <ember/support/table_file.h>
#include <ember/predict.h>
#include <ember/trainer.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "image_decode.h"
#include "image_transforms.h"

namespace fs = std::filesystem;

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::String("root", nullptr, "Folder of one sub-folder per class holding .jpg/.jpeg/.png images (torchvision's ImageFolder layout), or a .csv / .jsonl list of path and label (paths relative to the list's folder)."),
    ember::key::String("val_root", "\"\"", "Folder (or list) of validation images of the same classes; empty = val_split of root."),
    ember::key::String("test_root", "\"\"", "Folder (or list) of test images of the same classes; empty = no test split."),
    ember::key::String("path_column", "\"path\"", "Lists: the CSV column / JSONL field holding each image's path."),
    ember::key::String("label_column", "\"label\"", "Lists: the CSV column / JSONL field holding each image's class (a name, or an index 0..C-1 when every label is one)."),
    ember::key::Float("val_split", "0.0", "Without val_root: the fraction of root's images held out for validation (chosen by a permutation seeded with trainer.seed).").at_least(0.0).below(1.0),
    ember::key::Int("image_size", "224", "Side of the square images a batch holds.").at_least(1),
    ember::key::Int("resize", "0", "Evaluation: the shorter side is resized to this before the centre crop of image_size; 0 = image_size / 0.875 (256 for 224, torchvision's ImageNet recipe); image_size = no crop.").at_least(0),
    ember::key::Bool("augment", "true", "Training images: random resized crop (scale, ratio) and a left-right flip (torchvision's RandomResizedCrop + RandomHorizontalFlip); false = the evaluation transform."),
    ember::key::FloatList("scale", "[0.08, 1.0]", "Random resized crop: the range of the crop's area, as a fraction of the image's.").at_least(0.0).at_most(1.0),
    ember::key::FloatList("ratio", "[0.75, 1.3333333333333333]", "Random resized crop: the range of the crop's aspect ratio (width / height).").above(0.0),
    ember::key::Bool("flip", "true", "With augment: flip training images left-right with probability 1/2."),
    ember::key::FloatList("mean", "[0.485, 0.456, 0.406]", "Per-channel mean subtracted after scaling pixels to [0, 1] (ImageNet's)."),
    ember::key::FloatList("std", "[0.229, 0.224, 0.225]", "Per-channel standard deviation divided by (ImageNet's).").above(0.0),
    ember::key::String("bad_images", "\"stop\"", "A file whose header is not a readable JPEG or PNG: stop (one line naming it) or skip (left out, counted in the log).").choices("stop|skip"),
};

bool image_extension(const fs::path& p) {
  std::string ext = p.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return ext == ".jpg" || ext == ".jpeg" || ext == ".png";
}

struct Sample {
  std::string path;
  int64_t label = 0;
};

class ImageFolder final : public ember::IDataModule, public ember::ITrainerAware, public ember::IPredictionNames {
 public:
  ImageFolder(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host),
        section_(cfg.section()),
        root_(cfg.get_string("root")),
        val_root_(cfg.get_string("val_root")),
        test_root_(cfg.get_string("test_root")),
        path_column_(cfg.get_string("path_column")),
        label_column_(cfg.get_string("label_column")),
        val_split_(cfg.get_float("val_split")),
        size_(cfg.get_int("image_size")),
        augment_(cfg.get_bool("augment")),
        flip_(cfg.get_bool("flip")),
        skip_bad_(cfg.get_string("bad_images") == "skip") {
    auto pair = [&](const char* key) {
      const auto v = cfg.get_float_list(key);
      if (v.size() != 2 || v[0] > v[1])
        throw ember::ConfigError(cfg.where(key) + ": " + section_ + "." + key + " must be [low, high] with low <= high");
      return std::array<double, 2>{v[0], v[1]};
    };
    scale_ = pair("scale");
    ratio_ = pair("ratio");
    auto triple = [&](const char* key) {
      const auto v = cfg.get_float_list(key);
      if (v.size() != 3) throw ember::ConfigError(cfg.where(key) + ": " + section_ + "." + key + " needs one value per channel (R, G, B)");
      return v;
    };
    const at::Tensor mean = at::tensor(triple("mean"), at::kFloat).view({3, 1, 1});
    const at::Tensor std = at::tensor(triple("std"), at::kFloat).view({3, 1, 1});
    scale_per_channel_ = 1.0 / (255.0 * std);
    shift_per_channel_ = mean / std;
    const int64_t resize = cfg.get_int("resize");
    resize_ = resize > 0 ? resize : static_cast<int64_t>(static_cast<double>(size_) / 0.875);
    if (resize_ < size_)
      throw ember::ConfigError(cfg.where("resize") + ": " + section_ + ".resize = " + std::to_string(resize_) +
                               " is smaller than image_size = " + std::to_string(size_) + ": the centre crop would not fit");
    if (!val_root_.empty() && val_split_ > 0)
      throw ember::ConfigError(cfg.where("val_split") + ": " + section_ + ".val_split and val_root both choose the validation images: keep one");
  }

  void setup(const ember::DataSetup& setup) override {
    seed_ = setup.seed;
    std::vector<Sample> train;
    if (ember::support::is_table_file(root_)) {
      train = from_list(root_, "root", /*define_classes=*/true);
    } else {
      if (!fs::is_directory(root_))
        throw ember::RunError("image_folder: root " + root_.string() + " is not a folder or a .csv/.jsonl list: set [" + section_ +
                              "] root to a folder of one sub-folder per class, or to a list of path and label");
      for (const auto& e : fs::directory_iterator(root_))
        if (e.is_directory()) classes_.push_back(e.path().filename().string());
      std::sort(classes_.begin(), classes_.end());  // torchvision: sorted(entry.name ...)
      if (classes_.empty())
        throw ember::RunError("image_folder: " + root_.string() + " has no class sub-folders: put each class's images in <root>/<class>/");
      train = scan(root_, "root");
    }
    if (train.empty())
      throw ember::RunError("image_folder: no readable .jpg, .jpeg or .png file under " + root_.string() +
                            (skipped_ > 0 ? " (" + std::to_string(skipped_) + " unreadable files skipped, first: " + first_skipped_ + ")" : ""));
    if (!val_root_.empty()) {
      splits_[1] = ember::support::is_table_file(val_root_) ? from_list(val_root_, "val_root", false) : scan(val_root_, "val_root");
    } else if (val_split_ > 0) {
      // A permutation seeded with trainer.seed: the same split in every run and on every rank.
      const auto n = static_cast<int64_t>(train.size());
      const int64_t n_val = std::min<int64_t>(n - 1, std::llround(val_split_ * static_cast<double>(n)));
      at::Generator gen = at::detail::createCPUGenerator(setup.seed);
      const at::Tensor perm = at::randperm(n, gen, at::kLong);
      std::vector<bool> held(static_cast<size_t>(n), false);
      for (int64_t i = 0; i < n_val; ++i) held[static_cast<size_t>(perm[i].item<int64_t>())] = true;
      std::vector<Sample> kept;
      for (int64_t i = 0; i < n; ++i) (held[static_cast<size_t>(i)] ? splits_[1] : kept).push_back(train[static_cast<size_t>(i)]);
      train = std::move(kept);
    }
    if (!test_root_.empty())
      splits_[2] = ember::support::is_table_file(test_root_) ? from_list(test_root_, "test_root", false) : scan(test_root_, "test_root");
    splits_[0] = std::move(train);
    host_.log(ember::LogLevel::info, "image_folder: " + std::to_string(classes_.size()) + " classes, " + std::to_string(splits_[0].size()) +
                                         " train, " + std::to_string(splits_[1].size()) + " val, " + std::to_string(splits_[2].size()) +
                                         " test images, " + std::to_string(size_) + "x" + std::to_string(size_) +
                                         (skipped_ > 0 ? ", " + std::to_string(skipped_) + " unreadable files skipped (first: " + first_skipped_ + ")" : ""));
  }

  int64_t size(ember::Split split) const override { return static_cast<int64_t>(splits_[static_cast<size_t>(split)].size()); }

  // Decodes and transforms each sample on the intra-op threads; safe from several loader threads.
  ember::Batch get_batch(ember::Split split, const int64_t* indices, int64_t count) const override {
    const auto& samples = splits_[static_cast<size_t>(split)];
    at::Tensor images = at::empty({count, 3, size_, size_}, at::kFloat);
    at::Tensor labels = at::empty({count}, at::kLong);
    const bool train = split == ember::Split::train && augment_;
    const int64_t epoch = trainer_ != nullptr ? trainer_->current_epoch() : 0;
    at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t index = indices[i];
        if (index < 0 || index >= static_cast<int64_t>(samples.size())) throw ember::RunError("image_folder: sample index out of range (an engine bug)");
        const Sample& s = samples[static_cast<size_t>(index)];
        images[i].copy_(load(s.path, train, index, epoch));
        labels[i] = s.label;
      }
    });
    ember::Batch batch;
    batch.tensors = {images, labels};
    batch.size = count;
    return batch;
  }

  void* query_interface(const char* iid) override {
    if (std::strcmp(iid, ember::kTrainerAwareIid) == 0) return static_cast<ember::ITrainerAware*>(this);
    if (std::strcmp(iid, ember::kPredictionNamesIid) == 0) return static_cast<ember::IPredictionNames*>(this);
    return nullptr;
  }
  void attach_trainer(ember::ITrainer* trainer) override { trainer_ = trainer; }
  std::vector<std::string> class_names() const override { return classes_; }
  // Predictions name each image by its path.
  std::string sample_id(ember::Split split, int64_t index) const override { return splits_[static_cast<size_t>(split)].at(static_cast<size_t>(index)).path; }

 private:
  // torchvision's make_dataset: for each class in order, its folder walked (sorted directories,
  // sorted file names) for files with an image extension; every header read once.
  std::vector<Sample> scan(const fs::path& root, const char* key) {
    if (!fs::is_directory(root)) throw ember::RunError("image_folder: " + std::string(key) + " " + root.string() + " is not a folder");
    for (const auto& e : fs::directory_iterator(root))
      if (e.is_directory() && !std::binary_search(classes_.begin(), classes_.end(), e.path().filename().string()))
        throw ember::RunError("image_folder: " + e.path().string() + " is a class that " + root_.string() +
                              " does not have: every split needs the training classes (labels are their sorted order)");
    std::vector<Sample> out;
    for (size_t c = 0; c < classes_.size(); ++c) {
      const fs::path dir = root / classes_[c];
      if (!fs::is_directory(dir)) continue;
      std::vector<std::string> dirs = {dir.string()};
      for (const auto& e : fs::recursive_directory_iterator(dir, fs::directory_options::follow_directory_symlink))
        if (e.is_directory()) dirs.push_back(e.path().string());
      std::sort(dirs.begin(), dirs.end());
      for (const auto& d : dirs) {
        std::vector<std::string> files;
        for (const auto& e : fs::directory_iterator(d))
          if (e.is_regular_file() && image_extension(e.path())) files.push_back(e.path().filename().string());
        std::sort(files.begin(), files.end());
        for (const auto& f : files) out.push_back({(fs::path(d) / f).string(), static_cast<int64_t>(c)});
      }
    }
    return readable(std::move(out));
  }

  // A list of path and label (Ember::table_file: CSV with a header row, or JSON Lines), in its
  // order; paths relative to the list's folder. The training list defines the classes: when every
  // label is an integer they are the class indices (classes "0".."max"), otherwise the sorted
  // names, as torchvision sorts class folders. Other lists may only use those classes.
  std::vector<Sample> from_list(const fs::path& list, const char* key, bool define_classes) {
    const auto records = ember::support::read_table(list, {{path_column_, section_ + ".path_column"}, {label_column_, section_ + ".label_column"}});
    if (records.empty()) throw ember::RunError("image_folder: " + std::string(key) + " " + list.string() + " lists no images");
    auto index_of = [](const std::string& s) -> int64_t {
      if (s.empty() || s.size() > 9 || !std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c); })) return -1;
      return std::stoll(s);
    };
    if (define_classes) {
      const bool indices = std::all_of(records.begin(), records.end(), [&](const auto& r) { return index_of(r.values[1]) >= 0; });
      if (indices) {
        int64_t top = 0;
        for (const auto& r : records) top = std::max(top, index_of(r.values[1]));
        for (int64_t c = 0; c <= top; ++c) classes_.push_back(std::to_string(c));
      } else {
        for (const auto& r : records) classes_.push_back(r.values[1]);
        std::sort(classes_.begin(), classes_.end());
        classes_.erase(std::unique(classes_.begin(), classes_.end()), classes_.end());
      }
    }
    std::vector<Sample> out;
    const fs::path base = list.parent_path();
    for (const auto& r : records) {
      const auto it = std::lower_bound(classes_.begin(), classes_.end(), r.values[1], [&](const std::string& a, const std::string& b) {
        const int64_t ia = index_of(a), ib = index_of(b);
        return ia >= 0 && ib >= 0 ? ia < ib : a < b;
      });
      if (it == classes_.end() || *it != r.values[1])
        throw ember::RunError(list.string() + ":" + std::to_string(r.line) + ": label '" + r.values[1] +
                              "' is not a class of the training list " + root_.string() + " (every split uses the training classes)");
      const fs::path image = fs::path(r.values[0]).is_absolute() ? fs::path(r.values[0]) : base / r.values[0];
      out.push_back({image.string(), static_cast<int64_t>(it - classes_.begin())});
    }
    return readable(std::move(out));
  }

  // The samples whose file is an image this plugin reads; the others stop the run with their path
  // (bad_images = "stop") or are counted and left out ("skip").
  std::vector<Sample> readable(std::vector<Sample> out) {
    // Headers, in parallel: a file that is not an image is found now, not mid-epoch.
    std::vector<std::string> errors(out.size());
    at::parallel_for(0, static_cast<int64_t>(out.size()), 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        try {
          (void)ember_image::probe_image(ember_image::read_file(out[static_cast<size_t>(i)].path), out[static_cast<size_t>(i)].path);
        } catch (const std::exception& e) {
          errors[static_cast<size_t>(i)] = e.what();
        }
      }
    });
    std::vector<Sample> good;
    for (size_t i = 0; i < out.size(); ++i) {
      if (errors[i].empty()) {
        good.push_back(std::move(out[i]));
        continue;
      }
      if (!skip_bad_) throw ember::RunError(errors[i]);
      if (skipped_++ == 0) first_skipped_ = out[i].path;
    }
    return good;
  }

  // One image: decoded (a JPEG shrunk in the DCT when the output is at most half its size),
  // cropped, resized, maybe flipped, normalised: float [3, size, size].
  at::Tensor load(const std::string& path, bool train, int64_t index, int64_t epoch) const {
    const std::string bytes = ember_image::read_file(path);
    const auto info = ember_image::probe_image(bytes, path);
    std::mt19937_64 rng(seed_ * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(index) * 0xBF58476D1CE4E5B9ull ^
                        static_cast<uint64_t>(epoch + 1) * 0x94D049BB133111EBull);
    ember_image::CropBox box;
    int64_t out_h = size_, out_w = size_;
    if (train) {
      box = ember_image::random_resized_crop(info.height, info.width, scale_, ratio_, rng);
    } else {
      // Resize the shorter side to resize_, then the centre crop: the same as cropping the
      // corresponding box of the original and resizing it straight to size x size.
      const auto shape = ember_image::resized_shape(info.height, info.width, resize_);
      const auto c = ember_image::center_crop(shape[0], shape[1], size_);
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
    const at::Tensor pixels = ember_image::decode_image(bytes, path, denominator);
    // The box in the decoded image's pixels (libjpeg rounds a scaled size up).
    const double ry = static_cast<double>(pixels.size(0)) / static_cast<double>(info.height), rx = static_cast<double>(pixels.size(1)) / static_cast<double>(info.width);
    const int64_t top = std::min<int64_t>(pixels.size(0) - 1, static_cast<int64_t>(box.top * ry));
    const int64_t left = std::min<int64_t>(pixels.size(1) - 1, static_cast<int64_t>(box.left * rx));
    const int64_t h = std::clamp<int64_t>(static_cast<int64_t>(std::llround(box.height * ry)), 1, pixels.size(0) - top);
    const int64_t w = std::clamp<int64_t>(static_cast<int64_t>(std::llround(box.width * rx)), 1, pixels.size(1) - left);
    at::Tensor planes = ember_image::resize_to_planes(pixels.narrow(0, top, h).narrow(1, left, w), out_h, out_w);
    if (train && flip_ && std::uniform_int_distribution<int>(0, 1)(rng) == 1) planes = planes.flip(-1);
    // (x / 255 - mean) / std as one multiply and one subtract.
    return planes.mul_(scale_per_channel_).sub_(shift_per_channel_);
  }

  ember::IHost& host_;
  std::string section_;
  fs::path root_, val_root_, test_root_;
  std::string path_column_, label_column_;
  double val_split_;
  int64_t size_, resize_ = 0;
  bool augment_, flip_, skip_bad_;
  std::array<double, 2> scale_{}, ratio_{};
  at::Tensor scale_per_channel_, shift_per_channel_;  // 1 / (255 std), mean / std
  uint64_t seed_ = 0;
  std::vector<std::string> classes_;
  std::array<std::vector<Sample>, 3> splits_;
  int64_t skipped_ = 0;
  std::string first_skipped_;
  ember::ITrainer* trainer_ = nullptr;
};

ember::IDataModule* make(ember::IHost& host, const ember::IConfig& cfg) { return new ImageFolder(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::IDataModule, "image_folder", "0.1.0", "Apache-2.0",
             "Your images in torchvision's ImageFolder layout (<root>/<class>/*.jpg|png), decoded with libjpeg-turbo / libpng, "
             "ImageNet transforms (random resized crop, flip, resize, centre crop, normalise).",
             EMBER_CONFIG_KEYS(kKeys), make)
