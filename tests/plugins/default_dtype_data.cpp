// Test data module: builds every batch with the process's default dtype, as a data module that
// calls at::ones/at::randn without options does, and records (once per dtype) the default dtype
// its get_batch saw. get_batch samples it for `sample_ms` so that, with loader workers, it runs
// while the main thread is inside a training step (DefaultDtype tests).
#include <ember/data.h>
#include <ember/plugin.h>

#include <ATen/ATen.h>
#include <c10/core/DefaultDtype.h>

#include <chrono>
#include <fstream>
#include <mutex>
#include <set>
#include <string>

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::String("path", "\"loader_dtypes.txt\"", "File the default dtypes seen by get_batch are written to."),
    ember::key::Int("num_samples", "128", "Samples in train, val and test.").at_least(1),
    ember::key::Int("features", "16", "Features per sample.").at_least(1),
    ember::key::Int("sample_ms", "10", "Milliseconds each get_batch keeps sampling the default dtype.").at_least(0),
#if TEST_PLUGIN_BAD_BASE_KEY == 1  // a key the engine defines in [data]: the engine refuses the plugin
    ember::key::Int("batch_size", "8", "Samples per batch."),
#elif TEST_PLUGIN_BAD_BASE_KEY == 2  // advice for a name that is the engine's [data] key: refused too
    ember::key::Elsewhere("batch_size", "write data.size instead"),
#endif
};

class DefaultDtypeData final : public ember::IDataModule {
 public:
  explicit DefaultDtypeData(const ember::IConfig& cfg)
      : path_(cfg.get_string("path")), n_(cfg.get_int("num_samples")), features_(cfg.get_int("features")),
        sample_ms_(cfg.get_int("sample_ms")) {}
  void setup(const ember::DataSetup&) override {}
  int64_t size(ember::Split) const override { return n_; }
  ember::Batch get_batch(ember::Split, const int64_t* indices, int64_t count) const override {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(sample_ms_);
    do record(c10::typeMetaToScalarType(c10::get_default_dtype()));
    while (std::chrono::steady_clock::now() < until);
    at::Tensor labels = at::from_blob(const_cast<int64_t*>(indices), {count}, at::kLong).remainder(4);
    at::Tensor x = at::ones({count, features_}) * labels.unsqueeze(1);  // default dtype on purpose
    record(x.scalar_type());
    ember::Batch b;
    b.tensors = {x, labels};
    b.size = count;
    return b;
  }

 private:
  void record(c10::ScalarType t) const {
    std::lock_guard lock(mutex_);
    if (seen_.insert(t).second) std::ofstream(path_, std::ios::app) << c10::toString(t) << "\n";
  }
  std::string path_;
  int64_t n_, features_, sample_ms_;
  mutable std::mutex mutex_;
  mutable std::set<c10::ScalarType> seen_;
};

ember::IDataModule* make(ember::IHost&, const ember::IConfig& cfg) { return new DefaultDtypeData(cfg); }

}  // namespace

#ifndef TEST_PLUGIN_NAME
#define TEST_PLUGIN_NAME "default_dtype_data"
#endif
EMBER_PLUGIN(ember::IDataModule, TEST_PLUGIN_NAME, "0.0.1", "Apache-2.0",
             "Test: builds batches with the default dtype and records the default dtype loader threads see.",
             EMBER_CONFIG_KEYS(kKeys), make)
