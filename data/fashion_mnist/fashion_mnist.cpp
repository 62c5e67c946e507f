// fashion_mnist: Zalando's Fashion-MNIST (70,000 28x28 grayscale images of 10 clothing classes)
// read from the gzip-compressed idx files of the Debian package dataset-fashion-mnist.
//
// Splits: train and val come from the 60,000 training images (val_split of them, picked by a
// permutation seeded with trainer.seed), test is the 10,000 t10k images (val_on_test = true
// validates on them instead: what a speed-run measures).
// Batch: tensors[0] = images float [N, 1, 28, 28], tensors[1] = labels int64 [N].
//
// By default the images are kept as normalized float32, so a batch costs one index_select per
// tensor; `store = "uint8"` keeps a quarter of the memory and converts each batch. Training
// batches can be augmented (augment_flip, augment_crop_padding), deterministically. With
// data.on_device the engine moves the samples to the training device (ember::IDeviceData), where
// batches are then gathered and augmented.
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/StringUtil.h>
#include <torch/types.h>

#include <ember/config.h>
#include <ember/data.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/predict.h>
#include <ember/trainer.h>
#include <ember/support/held_out_split.h>

#include <ember/model_support/device_copy.h>
#include <ember/model_support/image_augment.h>

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::String("root", "\"/usr/share/datasets/fashion-mnist\"", "Folder holding the four *-ubyte.gz idx files."),
    ember::key::Float("val_split", "0.1", "Fraction of the 60,000 training images held out for validation, in [0, 1).").at_least(0.0).below(1.0),
    ember::key::Bool("normalize", "true", "Standardize pixels with the data set's mean and std (0.2860, 0.3530)."),
    ember::key::Int("limit_train_samples", "0", "Keep at most this many training samples (after the validation split); 0 keeps all.").at_least(0),
    ember::key::Bool("val_on_test", "false", "Validate on the 10,000 test images (time-to-test-accuracy speed-runs); set val_split = 0 with it to train on all 60,000."),
    ember::key::String("store", "\"float32\"", "In-memory form of the images: float32 (normalized once at load; a batch is one index_select; 4 bytes a pixel) or uint8 (a quarter of the memory; each batch converted).").choices("float32|uint8"),
    ember::key::Bool("augment_flip", "false", "Flip training images left-right with probability 1/2 (seeded by trainer.seed, the epoch and the batch)."),
    ember::key::Int("augment_crop_padding", "0", "Pad training images by this many pixels (black) and crop them back to 28x28 at a random offset; 0 = no crop.").at_least(0).at_most(14),
};

constexpr uint32_t kImagesMagic = 2051;  // idx: unsigned bytes, 3 dimensions
constexpr uint32_t kLabelsMagic = 2049;  // idx: unsigned bytes, 1 dimension
constexpr int64_t kSide = 28;
constexpr int64_t kNumClasses = 10;
// Mean and std of the training pixels scaled to [0, 1].
constexpr double kMean = 0.2860;
constexpr double kStd = 0.3530;

// A gzip file open for reading; closed on every way out, exceptions included.
class GzFile {
 public:
  GzFile(const std::filesystem::path& path, const std::string& section) : path_(path.string()) {
    if (!std::filesystem::is_regular_file(path)) {
      throw ember::RunError(c10::str(path_, " not found: install the Debian package dataset-fashion-mnist "
                                     "(apt-get install dataset-fashion-mnist) or set [", section, "] root"));
    }
    file_ = gzopen(path_.c_str(), "rb");
    if (file_ == nullptr) {
      throw ember::RunError(c10::str(path_, ": cannot open: ", std::strerror(errno), ": check its permissions"));
    }
  }
  ~GzFile() { gzclose(file_); }
  GzFile(const GzFile&) = delete;
  GzFile& operator=(const GzFile&) = delete;

  const std::string& path() const { return path_; }

  // The most bytes the file can decompress to: deflate never expands its input more than
  // 1032-fold, and gzread passes a file that is not gzip through as it is. A header counting more
  // than this is refused before anything is allocated for it.
  uint64_t max_decompressed_bytes() const {
    std::error_code ec;
    const uintmax_t size = std::filesystem::file_size(path_, ec);
    return ec ? UINT64_MAX : static_cast<uint64_t>(size) * 1032;
  }

  // Reads up to `size` bytes (in chunks: gzread counts in int) and returns how many it got.
  size_t read_some(void* out, size_t size) {
    auto* bytes = static_cast<unsigned char*>(out);
    size_t done = 0;
    while (done < size) {
      const auto chunk = static_cast<unsigned>(std::min<size_t>(size - done, INT_MAX));
      const int n = gzread(file_, bytes + done, chunk);
      if (n < 0) {
        int code = 0;
        throw ember::RunError(c10::str(path_, ": corrupt gzip data (", gzerror(file_, &code),
                                       "): reinstall dataset-fashion-mnist"));
      }
      if (n == 0) break;
      done += static_cast<size_t>(n);
    }
    return done;
  }

  // Reads exactly `size` bytes of `what`, or says how short the file is.
  void read(void* out, size_t size, const char* what) {
    const size_t got = read_some(out, size);
    if (got != size) {
      throw ember::RunError(c10::str(path_, ": truncated: expected ", size, " bytes of ", what, ", found ",
                                     got, ": reinstall dataset-fashion-mnist"));
    }
  }

  // idx headers are big-endian 32-bit integers.
  uint32_t read_u32(const char* what) {
    std::array<unsigned char, 4> b{};
    read(b.data(), b.size(), what);
    return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
  }

  // A header that undercounts its data is as wrong as a truncated file.
  void expect_end(const char* what) {
    unsigned char extra = 0;
    if (read_some(&extra, 1) != 0) {
      throw ember::RunError(c10::str(path_, ": more data than its header's count of ", what,
                                     ": the file is corrupt, reinstall dataset-fashion-mnist"));
    }
  }

 private:
  std::string path_;
  gzFile file_ = nullptr;
};

// Images as read: uint8 [N, 1, 28, 28]; setup() converts them when store = "float32".
struct Samples {
  at::Tensor images;  // uint8 or normalized float32 [N, 1, 28, 28]
  at::Tensor labels;  // int64 [N]
};

Samples load(const std::filesystem::path& root, const char* images_file, const char* labels_file,
             const std::string& section) {
  Samples s;
  int64_t count = 0;
  {
    GzFile f(root / images_file, section);
    const uint32_t magic = f.read_u32("header");
    if (magic != kImagesMagic) {
      throw ember::RunError(c10::str(f.path(), ": bad magic number ", magic, " (expected ", kImagesMagic,
                                     " for idx3 images): not a Fashion-MNIST image file"));
    }
    count = f.read_u32("header");
    const uint32_t rows = f.read_u32("header");
    const uint32_t cols = f.read_u32("header");
    if (count == 0 || rows != kSide || cols != kSide) {
      throw ember::RunError(c10::str(f.path(), ": holds ", count, " images of ", rows, "x", cols,
                                     ", expected at least one image of ", kSide, "x", kSide));
    }
    const uint64_t pixels = static_cast<uint64_t>(count) * kSide * kSide;
    if (pixels > f.max_decompressed_bytes()) {
      throw ember::RunError(c10::str(f.path(), ": truncated: its header counts ", count, " images (", pixels,
                                     " bytes of pixels), more than the file can hold: reinstall dataset-fashion-mnist"));
    }
    s.images = torch::empty({count, 1, kSide, kSide}, torch::kUInt8);
    f.read(s.images.data_ptr<uint8_t>(), static_cast<size_t>(s.images.numel()), "pixels");
    f.expect_end("images");
  }
  {
    GzFile f(root / labels_file, section);
    const uint32_t magic = f.read_u32("header");
    if (magic != kLabelsMagic) {
      throw ember::RunError(c10::str(f.path(), ": bad magic number ", magic, " (expected ", kLabelsMagic,
                                     " for idx1 labels): not a Fashion-MNIST label file"));
    }
    const int64_t labels = f.read_u32("header");
    if (labels != count) {
      throw ember::RunError(c10::str(f.path(), ": holds ", labels, " labels but ", (root / images_file).string(),
                                     " holds ", count, " images: the files are from different sets"));
    }
    at::Tensor raw = torch::empty({count}, torch::kUInt8);
    f.read(raw.data_ptr<uint8_t>(), static_cast<size_t>(count), "labels");
    f.expect_end("labels");
    // A label of 10 or more would surface much later as an index error inside the loss.
    const auto* l = raw.data_ptr<uint8_t>();
    const auto* bad = std::find_if(l, l + count, [](uint8_t v) { return v >= kNumClasses; });
    if (bad != l + count) {
      throw ember::RunError(c10::str(f.path(), ": label ", int{*bad}, " at index ", bad - l, " is outside [0, ",
                                     kNumClasses - 1, "]: the file is corrupt, reinstall dataset-fashion-mnist"));
    }
    s.labels = raw.to(torch::kLong);
  }
  return s;
}

class FashionMnist final : public ember::IDataModule, public ember::IDeviceData, public ember::ITrainerAware,
                           public ember::IPredictionNames {
 public:
  FashionMnist(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host),
        section_(cfg.section()),
        root_(cfg.get_string("root")),
        val_split_(cfg.get_float("val_split")),
        normalize_(cfg.get_bool("normalize")),
        limit_train_(cfg.get_int("limit_train_samples")),
        val_on_test_(cfg.get_bool("val_on_test")),
        store_float_(cfg.get_string("store") == "float32") {
    augment_.flip = cfg.get_bool("augment_flip");
    augment_.crop_padding = cfg.get_int("augment_crop_padding");
    // Padding is black: 0 before normalization.
    augment_.pad_value = normalize_ ? -kMean / kStd : 0.0;
    // The schema's maximum is inclusive; a split of 1 would leave nothing to train on.
    if (val_split_ >= 1.0) {
      throw ember::ConfigError(c10::str("[", section_, "] val_split = ", val_split_, " (", cfg.where("val_split"),
                                        ") leaves no training images: use a fraction in [0, 1), e.g. 0.1"));
    }
  }

  void setup(const ember::DataSetup& setup) override {
    Samples train = load(root_, "train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", section_);
    Samples test = load(root_, "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", section_);

    // The validation images are chosen by a permutation from a generator seeded with
    // trainer.seed: the same split in every run and on every rank, and never overlapping train.
    const auto split = ember::held_out_split(train.images.size(0), val_split_, setup.seed);
    const at::Tensor val_idx = split.val();
    at::Tensor train_idx = split.train();
    // The limit applies after the split, so the validation set does not change with it.
    if (limit_train_ > 0 && limit_train_ < train_idx.size(0)) train_idx = train_idx.narrow(0, 0, limit_train_);

    seed_ = setup.seed;
    slot(ember::Split::train) = {stored(train.images.index_select(0, train_idx)), train.labels.index_select(0, train_idx)};
    slot(ember::Split::test) = {stored(test.images), test.labels};
    if (val_on_test_) slot(ember::Split::val) = slot(ember::Split::test);  // shares the tensors
    else slot(ember::Split::val) = {stored(train.images.index_select(0, val_idx)), train.labels.index_select(0, val_idx)};
    host_.log(ember::LogLevel::info,
              c10::str("fashion_mnist: ", size(ember::Split::train), " train, ", size(ember::Split::val), " val, ",
                       size(ember::Split::test), " test images from ", root_.string(),
                       val_on_test_ ? " (validating on the test images)" : ""));
  }

  int64_t size(ember::Split split) const override {
    const Samples* s = find(split);
    return s != nullptr && s->labels.defined() ? s->labels.size(0) : 0;
  }

  // Only reads the tensors loaded by setup(), so the engine's loader threads may call it at once.
  ember::Batch get_batch(ember::Split split, const int64_t* indices, int64_t count) const override {
    const Samples* s = find(split);
    if (s == nullptr || !s->labels.defined()) {
      throw ember::RunError(c10::str("fashion_mnist: get_batch on split ", static_cast<int>(split),
                                     " before setup() or on a split that does not exist"));
    }
    // Wraps the caller's indices without copying; index_select only reads them (and checks bounds).
    at::Tensor idx = torch::from_blob(const_cast<int64_t*>(indices), {count}, torch::kLong);
    if (!s->labels.device().is_cpu()) idx = ember_models::to_device_without_sync(idx, s->labels.device());
    at::Tensor images = s->images.index_select(0, idx);
    if (!store_float_) images = pixels(images);
    if (split == ember::Split::train && augment_.enabled()) {
      // The same samples in the same epoch get the same augmentation, however the batch was
      // loaded (worker thread, resumed run).
      const int64_t epoch = trainer_ != nullptr ? trainer_->current_epoch() : 0;
      const uint64_t seed = ember_models::hash_indices(indices, count) ^ (seed_ * 0x9E3779B97F4A7C15ull) ^
                            (static_cast<uint64_t>(epoch) * 0xBF58476D1CE4E5B9ull);
      images = ember_models::augment_images(images, augment_, seed);
    }
    ember::Batch batch;
    batch.tensors = {std::move(images), s->labels.index_select(0, idx)};
    batch.size = count;
    return batch;
  }

 void* query_interface(const char* iid) override {
    if (std::strcmp(iid, ember::kDeviceDataIid) == 0) return static_cast<ember::IDeviceData*>(this);
    if (std::strcmp(iid, ember::kTrainerAwareIid) == 0) return static_cast<ember::ITrainerAware*>(this);
    if (std::strcmp(iid, ember::kPredictionNamesIid) == 0) return static_cast<ember::IPredictionNames*>(this);
    return nullptr;
  }
  // Zalando's class names, in label order (the data set's README).
  std::vector<std::string> class_names() const override {
    return {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"};
  }
  std::string sample_id(ember::Split, int64_t) const override { return ""; }  // the index within the split
  void attach_trainer(ember::ITrainer* trainer) override { trainer_ = trainer; }

  int64_t device_bytes() const override {
    int64_t bytes = 0;
    for (size_t i = 0; i < splits_.size(); ++i) {
      if (val_on_test_ && i == static_cast<size_t>(ember::Split::val)) continue;  // shared with test
      if (splits_[i].labels.defined()) bytes += splits_[i].images.nbytes() + splits_[i].labels.nbytes();
    }
    return bytes;
  }
  void move_to(const c10::Device& device) override {
    for (auto& s : splits_)
      if (s.labels.defined()) s = {s.images.to(device), s.labels.to(device)};
  }

 private:
  // uint8 pixels -> float32 in [0, 1], normalized when asked.
  at::Tensor pixels(const at::Tensor& raw) const {
    at::Tensor images = raw.to(torch::kFloat).div_(255.0);
    if (normalize_) images.sub_(kMean).div_(kStd);
    return images;
  }
  at::Tensor stored(const at::Tensor& raw) const { return store_float_ ? pixels(raw) : raw; }

  const Samples* find(ember::Split split) const {
    const auto i = static_cast<size_t>(split);
    return i < splits_.size() ? &splits_[i] : nullptr;
  }
  Samples& slot(ember::Split split) { return splits_.at(static_cast<size_t>(split)); }

  ember::IHost& host_;
  std::string section_;
  std::filesystem::path root_;
  double val_split_;
  bool normalize_;
  int64_t limit_train_;
  bool val_on_test_;
  bool store_float_;
  ember_models::ImageAugment augment_;
  uint64_t seed_ = 0;
  ember::ITrainer* trainer_ = nullptr;
  std::array<Samples, 3> splits_;  // indexed by ember::Split
};

ember::IDataModule* make(ember::IHost& host, const ember::IConfig& cfg) { return new FashionMnist(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::IDataModule, "fashion_mnist", "0.1.0", "Apache-2.0",
             "Fashion-MNIST (70k 28x28 clothing images, 10 classes) from the dataset-fashion-mnist Debian package.",
             EMBER_CONFIG_KEYS(kKeys), make)
