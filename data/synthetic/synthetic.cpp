// synthetic: a small generated data set for tests and smoke runs. Needs no files, and is a pure
// function of its config and trainer.seed, so it is identical across runs, ranks and processes.
//
//   classification: every class has a random centroid of the sample shape; a sample is its
//                   class's centroid + noise * randn, labels int64 [N] (balanced, shuffled).
//   regression:     x ~ randn(shape), y = flatten(x) @ W + noise * randn with a fixed random W,
//                   targets float [N, num_classes].
// Batch: tensors[0] = inputs float [N, shape...], tensors[1] = labels or targets.
#include <array>
#include <cmath>
#include <limits>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/StringUtil.h>
#include <torch/types.h>

#include <ember/config.h>
#include <ember/data.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/plugin.h>

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::Int("seed", "0", "Seed of the generated data, combined with trainer.seed.").at_least(0),
    ember::key::Int("num_train", "512", "Samples in the training split.").at_least(1),
    ember::key::Int("num_val", "128", "Samples in the validation split (0: no validation).").at_least(0),
    ember::key::Int("num_test", "128", "Samples in the test split (0: no test split).").at_least(0),
    ember::key::IntList("shape", "[1, 28, 28]", "Shape of one input sample, e.g. [1, 28, 28] for an image or [32] for a vector.").at_least(1),
    ember::key::Int("num_classes", "10", "Classes (classification) or target width (regression).").at_least(1),
    ember::key::String("task", "\"classification\"", "Class labels around random centroids, or float targets of a random linear map.").choices("classification|regression"),
    ember::key::Float("noise", "0.5", "Standard deviation of the Gaussian noise added to every sample (classification) or target (regression).").at_least(0.0),
    ember::key::IntList("nan_samples", "[]", "Training samples whose inputs are NaN: a planted non-finite loss, for testing guards (spike_guard).").at_least(0),
    ember::key::IntList("spike_samples", "[]", "Training samples whose inputs are multiplied by spike_scale: a planted loss spike, for testing guards.").at_least(0),
    ember::key::Float("spike_scale", "1000.0", "What spike_samples' inputs are multiplied by.").above(0.0),
};

enum class Task { classification, regression };

// SplitMix64: mixes the two seeds so that nearby values (seed 0 and 1, trainer.seed 0 and 1)
// give unrelated data sets, and (a, b) differs from (b, a).
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

struct Samples {
  at::Tensor inputs;   // float [N, shape...]
  at::Tensor targets;  // int64 [N] or float [N, num_classes]
};

class Synthetic final : public ember::IDataModule {
 public:
  Synthetic(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host),
        seed_(static_cast<uint64_t>(cfg.get_int("seed"))),
        counts_{cfg.get_int("num_train"), cfg.get_int("num_val"), cfg.get_int("num_test")},
        shape_(cfg.get_int_list("shape")),
        num_classes_(cfg.get_int("num_classes")),
        task_(cfg.get_string("task") == "regression" ? Task::regression : Task::classification),
        noise_(cfg.get_float("noise")),
        nan_samples_(cfg.get_int_list("nan_samples")),
        spike_samples_(cfg.get_int_list("spike_samples")),
        spike_scale_(cfg.get_float("spike_scale")) {
    // Constraints the schema cannot express.
    const std::string s = c10::str("[", cfg.section(), "] ");
    if (shape_.empty()) {
      throw ember::ConfigError(c10::str(s, "shape = [] (", cfg.where("shape"),
                                        ") gives samples no features: use e.g. [1, 28, 28] or [32]"));
    }
    if (task_ == Task::classification && num_classes_ < 2) {
      throw ember::ConfigError(c10::str(s, "num_classes = ", num_classes_, " (", cfg.where("num_classes"),
                                        ") is too few for task = \"classification\": use at least 2, or task = \"regression\""));
    }
    for (const auto* list : {&nan_samples_, &spike_samples_})
      for (int64_t i : *list)
        if (i >= counts_[0])
          throw ember::ConfigError(c10::str(s, list == &nan_samples_ ? "nan_samples" : "spike_samples", " names sample ", i, " (",
                                            cfg.where(list == &nan_samples_ ? "nan_samples" : "spike_samples"), ") but num_train = ", counts_[0],
                                            ": give indices below num_train"));
    if (task_ == Task::classification && counts_[0] < num_classes_) {
      throw ember::ConfigError(c10::str(s, "num_train = ", counts_[0], " (", cfg.where("num_train"),
                                        ") is smaller than num_classes = ", num_classes_, " (", cfg.where("num_classes"),
                                        "): every class needs a training sample, raise num_train"));
    }
  }

  void setup(const ember::DataSetup& setup) override {
    // One generator, drawn from in a fixed order (the task's parameters, then train, val, test):
    // the data depends on nothing but the seeds and the config.
    at::Generator gen = at::detail::createCPUGenerator(splitmix64(splitmix64(seed_) ^ setup.seed));
    int64_t features = 1;
    for (int64_t d : shape_) features *= d;

    if (task_ == Task::classification) {
      std::vector<int64_t> centroid_shape{num_classes_};
      centroid_shape.insert(centroid_shape.end(), shape_.begin(), shape_.end());
      const at::Tensor centroids = torch::randn(centroid_shape, gen, torch::kFloat);
      for (size_t i = 0; i < splits_.size(); ++i) {
        const int64_t n = counts_[i];
        // Balanced classes (0, 1, ..., C-1, 0, 1, ...), then shuffled so batches mix classes.
        at::Tensor labels = torch::arange(n, torch::kLong).remainder(num_classes_);
        labels = labels.index_select(0, torch::randperm(n, gen, torch::kLong));
        at::Tensor inputs = centroids.index_select(0, labels) + noise_ * torch::randn(sample_shape(n), gen, torch::kFloat);
        splits_[i] = {std::move(inputs), std::move(labels)};
      }
    } else {
      // Scaled by 1/sqrt(features) so targets have unit variance whatever the input size: the
      // loss starts near 1 + noise^2 and falls towards noise^2 as the model learns W.
      const at::Tensor w = torch::randn({features, num_classes_}, gen, torch::kFloat) / std::sqrt(static_cast<double>(features));
      for (size_t i = 0; i < splits_.size(); ++i) {
        const int64_t n = counts_[i];
        at::Tensor inputs = torch::randn(sample_shape(n), gen, torch::kFloat);
        at::Tensor targets = inputs.reshape({n, features}).matmul(w) + noise_ * torch::randn({n, num_classes_}, gen, torch::kFloat);
        splits_[i] = {std::move(inputs), std::move(targets)};
      }
    }
    // Planted faults, after every draw: the other samples are the same as without them.
    at::Tensor& train = splits_[0].inputs;
    for (int64_t i : spike_samples_) train[i].mul_(spike_scale_);
    for (int64_t i : nan_samples_) train[i].fill_(std::numeric_limits<float>::quiet_NaN());
    ready_ = true;
    host_.log(ember::LogLevel::info, c10::str("synthetic: ", counts_[0], " train, ", counts_[1], " val, ", counts_[2],
                                              " test samples of shape ", c10::IntArrayRef(shape_),
                                              task_ == Task::classification ? " (classification)" : " (regression)"));
  }

  int64_t size(ember::Split split) const override {
    const auto i = static_cast<size_t>(split);
    return ready_ && i < splits_.size() ? counts_[i] : 0;
  }

  // Only reads the tensors made by setup(), so the engine's loader threads may call it at once.
  ember::Batch get_batch(ember::Split split, const int64_t* indices, int64_t count) const override {
    if (size(split) == 0) {
      throw ember::RunError(c10::str("synthetic: get_batch on split ", static_cast<int>(split),
                                     " before setup() or on a split of size 0"));
    }
    const Samples& s = splits_[static_cast<size_t>(split)];
    // Wraps the caller's indices without copying; index_select only reads them (and checks bounds).
    const at::Tensor idx = torch::from_blob(const_cast<int64_t*>(indices), {count}, torch::kLong);
    ember::Batch batch;
    batch.tensors = {s.inputs.index_select(0, idx), s.targets.index_select(0, idx)};
    batch.size = count;
    return batch;
  }

 private:
  std::vector<int64_t> sample_shape(int64_t n) const {
    std::vector<int64_t> out{n};
    out.insert(out.end(), shape_.begin(), shape_.end());
    return out;
  }

  ember::IHost& host_;
  uint64_t seed_;
  std::array<int64_t, 3> counts_;  // indexed by ember::Split
  std::vector<int64_t> shape_;
  int64_t num_classes_;
  Task task_;
  double noise_;
  std::vector<int64_t> nan_samples_, spike_samples_;
  double spike_scale_;
  std::array<Samples, 3> splits_;
  bool ready_ = false;
};

ember::IDataModule* make(ember::IHost& host, const ember::IConfig& cfg) { return new Synthetic(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::IDataModule, "synthetic", "0.1.0", "Apache-2.0",
             "Generated classification or regression data, deterministic from its seed, for tests.",
             EMBER_CONFIG_KEYS(kKeys), make)
