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
#include <ember/support/image_decode.h>
#include <ember/support/held_out_split.h>
#include <ember/support/image_list.h>
#include <ember/support/image_transforms.h>
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


namespace fs = std::filesystem;

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::String("root", nullptr, "Folder of one sub-folder per class holding .jpg/.jpeg/.png images (torchvision's ImageFolder layout), or a .csv / .jsonl list of path and label (paths relative to the list's folder)."),
    ember::key::String("val_root", "\"\"", "Folder (or list) of validation images of the same classes; empty = val_split of root."),
    ember::key::String("test_root", "\"\"", "Folder (or list) of test images of the same classes; empty = no test split."),
    ember::key::String("path_column", "\"path\"", "Lists: the CSV column / JSONL field holding each image's path."),
    ember::key::String("label_column", "\"label\"", "Lists: the CSV column / JSONL field holding each image's class (a name, or an index 0..C-1 when every label is one and they are dense; sparse integers are names in numeric order)."),
    ember::key::Bool("multilabel", "false", "Lists: each image has any number of classes (none included), separated by label_separator in its label field (JSONL: or an array): the targets are 0/1 per class [N, classes] (resnet / cnn: task = \"multilabel\")."),
    ember::key::String("label_separator", "\";\"", "What separates a multilabel image's classes (\"cat;dog\"); spaces around each are dropped."),
    ember::key::StringList("classes", "[]", "The classes in output order (a checkpoint's: `engine checkpoint info` lists them); empty: the training root's sorted sub-folders, or its list's labels (0..C-1 when they are dense integers, else sorted names). A folder or label outside them is one line."),
    ember::key::Float("val_split", "0.0", "Without val_root: the fraction of root's images held out for validation (chosen by a permutation seeded with trainer.seed).").at_least(0.0).below(1.0),
    ember::key::String("bad_images", "\"stop\"", "A file whose header is not a readable JPEG or PNG: stop (one line naming it) or skip (left out, counted in the log).").choices("stop|skip"),
    EMBER_IMAGE_TRANSFORM_KEYS,
};

using Sample = ember::image::LabelledImage;

class ImageFolder final : public ember::IDataModule, public ember::ITrainerAware, public ember::IPredictionNames {
 public:
  ImageFolder(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host),
        section_(cfg.section()),
        root_(cfg.get_string("root")),
        val_root_(cfg.get_string("val_root")),
        test_root_(cfg.get_string("test_root")),
        list_options_{cfg.get_string("path_column"), cfg.get_string("label_column"), cfg.section()},
        val_split_(cfg.get_float("val_split")),
        transform_(cfg),
        skip_bad_(cfg.get_string("bad_images") == "skip") {
    if (cfg.get_bool("multilabel")) {
      list_options_.label_separator = cfg.get_string("label_separator");
      if (list_options_.label_separator.empty())
        throw ember::ConfigError(cfg.where("label_separator") + ": " + section_ + ".label_separator is empty: multilabel lists need a separator, e.g. \";\"");
    }
    classes_ = cfg.get_string_list("classes");
    for (size_t i = 0; i < classes_.size(); ++i)
      for (size_t j = 0; j < i; ++j)
        if (classes_[i] == classes_[j])
          throw ember::ConfigError(cfg.where("classes") + ": " + section_ + ".classes names \"" + classes_[i] + "\" twice (outputs " +
                                   std::to_string(j) + " and " + std::to_string(i) + "): list each class once, in output order");
    if (!val_root_.empty() && val_split_ > 0)
      throw ember::ConfigError(cfg.where("val_split") + ": " + section_ + ".val_split and val_root both choose the validation images: keep one");
  }

  void setup(const ember::DataSetup& setup) override {
    seed_ = setup.seed;
    std::vector<Sample> train = readable(ember::image::list_images(root_, classes_, "root", list_options_));
    if (train.empty())
      throw ember::RunError("image_folder: no readable .jpg, .jpeg or .png file under " + root_.string() +
                            (skipped_ > 0 ? " (" + std::to_string(skipped_) + " unreadable files skipped, first: " + first_skipped_ + ")" : ""));
    if (!val_root_.empty()) {
      splits_[1] = readable(ember::image::list_images(val_root_, classes_, "val_root", list_options_));
    } else if (val_split_ > 0) {
      // Held out in the files' order (ember/support/held_out_split.h: seeded with trainer.seed).
      const auto n = static_cast<int64_t>(train.size());
      const auto split = ember::held_out_split(n, val_split_, setup.seed);
      const at::Tensor val = split.val().contiguous();
      std::vector<bool> held(static_cast<size_t>(n), false);
      for (int64_t i = 0; i < split.n_val; ++i) held[static_cast<size_t>(val.data_ptr<int64_t>()[i])] = true;
      std::vector<Sample> kept;
      for (int64_t i = 0; i < n; ++i) (held[static_cast<size_t>(i)] ? splits_[1] : kept).push_back(train[static_cast<size_t>(i)]);
      train = std::move(kept);
    }
    if (!test_root_.empty())
      splits_[2] = readable(ember::image::list_images(test_root_, classes_, "test_root", list_options_));
    splits_[0] = std::move(train);
    host_.log(ember::LogLevel::info, "image_folder: " + std::to_string(classes_.size()) + " classes, " + std::to_string(splits_[0].size()) +
                                         " train, " + std::to_string(splits_[1].size()) + " val, " + std::to_string(splits_[2].size()) +
                                         " test images" + (multilabel() ? " (multilabel)" : "") + ", " + std::to_string(transform_.size()) + "x" +
                                         std::to_string(transform_.size()) +
                                         (skipped_ > 0 ? ", " + std::to_string(skipped_) + " unreadable files skipped (first: " + first_skipped_ + ")" : ""));
  }

  int64_t size(ember::Split split) const override { return static_cast<int64_t>(splits_[static_cast<size_t>(split)].size()); }

  // Decodes and transforms each sample on the intra-op threads; safe from several loader threads.
  ember::Batch get_batch(ember::Split split, const int64_t* indices, int64_t count) const override {
    const auto& samples = splits_[static_cast<size_t>(split)];
    const int64_t side = transform_.size();
    at::Tensor images = at::empty({count, 3, side, side}, at::kFloat);
    // Class indices, or (multilabel) one 0/1 row per image.
    at::Tensor labels = multilabel() ? at::zeros({count, static_cast<int64_t>(classes_.size())}, at::kLong) : at::empty({count}, at::kLong);
    const bool train = split == ember::Split::train;
    const int64_t epoch = trainer_ != nullptr ? trainer_->current_epoch() : 0;
    at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t index = indices[i];
        if (index < 0 || index >= static_cast<int64_t>(samples.size())) throw ember::RunError("image_folder: sample index out of range (an engine bug)");
        const Sample& s = samples[static_cast<size_t>(index)];
        images[i].copy_(transform_(ember::image::read_file(s.path), s.path, train, seed_, index, epoch));
        if (multilabel())
          for (int64_t c : s.labels) labels[i][c] = 1;
        else
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
  bool multilabel() const { return !list_options_.label_separator.empty(); }

  // The samples whose file is an image this plugin reads; the others stop the run with their path
  // (bad_images = "stop") or are counted and left out ("skip").
  std::vector<Sample> readable(std::vector<Sample> out) {
    // Headers (a file's first 64 KiB), in parallel: a file that is not an image is found now, not mid-epoch.
    std::vector<std::string> errors(out.size());
    at::parallel_for(0, static_cast<int64_t>(out.size()), 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        try {
          (void)ember::image::probe_image_file(out[static_cast<size_t>(i)].path);
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

  ember::IHost& host_;
  std::string section_;
  fs::path root_, val_root_, test_root_;
  ember::image::ImageListOptions list_options_;
  double val_split_;
  ember::image::ImageTransform transform_;
  bool skip_bad_;
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
