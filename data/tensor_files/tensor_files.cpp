// tensor_files: inputs and labels as arrays in files, for data prepared elsewhere (NumPy, pandas,
// a feature pipeline): NumPy .npy files or one .safetensors file per split, memory-mapped, so a
// data set larger than memory costs only the pages a batch touches.
//   [data]
//   name = "tensor_files"
//   train = ["x_train.npy", "y_train.npy"]      # inputs [N, ...], labels [N] (or [N, ...])
//   test = ["test.safetensors"]                 # tensors named inputs_name and labels_name
// Labels of an integer dtype are class indices (int64 in the batch); floating labels are targets
// of a regression as they are. Without `val`, val_split of train is held out (seeded).
#include <ember/data.h>
#include <ember/error.h>
#include <ember/plugin.h>
#include <ember/support/held_out_split.h>
#include <ember/support/npy.h>
#include <ember/support/safetensors.h>

#include <ATen/ATen.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::StringList("train", nullptr, "The training arrays: [\"inputs.npy\", \"labels.npy\"] (NumPy, C order) or [\"train.safetensors\"] (tensors inputs_name and labels_name)."),
    ember::key::StringList("val", "[]", "The validation arrays, as train; empty = val_split of train."),
    ember::key::StringList("test", "[]", "The test arrays, as train; empty = no test split."),
    ember::key::Float("val_split", "0.0", "Without val: the fraction of train held out for validation (a permutation seeded with trainer.seed).").at_least(0.0).below(1.0),
    ember::key::String("inputs_name", "\"inputs\"", "The inputs' tensor in a .safetensors file."),
    ember::key::String("labels_name", "\"labels\"", "The labels' tensor in a .safetensors file."),
};

// A read-only memory map of a whole file; tensors viewing it keep it alive.
std::shared_ptr<void> map_file(const std::string& path, size_t* size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw ember::RunError("tensor_files: cannot open " + path + ": " + std::strerror(errno));
  struct stat st {};
  ::fstat(fd, &st);
  *size = static_cast<size_t>(st.st_size);
  void* base = *size > 0 ? ::mmap(nullptr, *size, PROT_READ, MAP_PRIVATE, fd, 0) : nullptr;
  ::close(fd);
  if (*size > 0 && base == MAP_FAILED) throw ember::RunError("tensor_files: cannot map " + path + ": " + std::strerror(errno));
  const size_t n = *size;
  return std::shared_ptr<void>(base, [n](void* p) {
    if (p) ::munmap(p, n);
  });
}

// A memory-mapped .npy file (<ember/support/npy.h>): the tensor views the mapping, which lives
// as long as the tensor.
at::Tensor read_npy(const std::string& path) {
  size_t size = 0;
  auto mapping = map_file(path, &size);
  const char* p = static_cast<const char*>(mapping.get());
  return ember::support::read_npy(p, size, "tensor_files: " + path, [mapping]() mutable { mapping.reset(); });
}

struct Arrays {
  at::Tensor inputs, labels;
};

class TensorFiles final : public ember::IDataModule {
 public:
  TensorFiles(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host), section_(cfg.section()), val_split_(cfg.get_float("val_split")),
        inputs_name_(cfg.get_string("inputs_name")), labels_name_(cfg.get_string("labels_name")) {
    const char* keys[] = {"train", "val", "test"};
    for (int i = 0; i < 3; ++i) {
      files_[static_cast<size_t>(i)] = cfg.get_string_list(keys[i]);
      where_[static_cast<size_t>(i)] = cfg.where(keys[i]);
      const auto& f = files_[static_cast<size_t>(i)];
      if (f.empty()) continue;
      const bool one_safetensors = f.size() == 1 && fs::path(f[0]).extension() == ".safetensors";
      const bool two_npy = f.size() == 2 && fs::path(f[0]).extension() == ".npy" && fs::path(f[1]).extension() == ".npy";
      if (!one_safetensors && !two_npy)
        throw ember::ConfigError(cfg.where(keys[i]) + ": " + section_ + "." + keys[i] +
                                 " takes [\"inputs.npy\", \"labels.npy\"] or [\"file.safetensors\"]");
    }
    if (files_[0].empty()) throw ember::ConfigError(cfg.where("train") + ": " + section_ + ".train is required");
    if (!files_[1].empty() && val_split_ > 0)
      throw ember::ConfigError(cfg.where("val_split") + ": " + section_ + ".val_split and val both choose the validation samples: keep one");
  }

  void setup(const ember::DataSetup& setup) override {
    for (size_t i = 0; i < 3; ++i)
      if (!files_[i].empty()) splits_[i] = load(i);
    if (files_[1].empty() && val_split_ > 0) {
      const auto split = ember::held_out_split(splits_[0].labels.size(0), val_split_, setup.seed);
      const at::Tensor val = std::get<0>(split.val().sort()), train = std::get<0>(split.train().sort());
      splits_[1] = {splits_[0].inputs.index_select(0, val), splits_[0].labels.index_select(0, val)};
      splits_[0] = {splits_[0].inputs.index_select(0, train), splits_[0].labels.index_select(0, train)};
    }
    host_.log(ember::LogLevel::info, c10::str("tensor_files: ", size(ember::Split::train), " train, ", size(ember::Split::val), " val, ",
                                              size(ember::Split::test), " test samples, inputs ", splits_[0].inputs.scalar_type(), " ",
                                              splits_[0].inputs.sizes().slice(1), ", labels ", splits_[0].labels.scalar_type()));
  }

  int64_t size(ember::Split split) const override {
    const auto& s = splits_[static_cast<size_t>(split)];
    return s.labels.defined() ? s.labels.size(0) : 0;
  }

  // Gathers the rows (reading only their pages of the mapped file); safe from several threads.
  ember::Batch get_batch(ember::Split split, const int64_t* indices, int64_t count) const override {
    const auto& s = splits_[static_cast<size_t>(split)];
    const at::Tensor idx = at::from_blob(const_cast<int64_t*>(indices), {count}, at::kLong);
    at::Tensor labels = s.labels.index_select(0, idx);
    if (!at::isFloatingType(labels.scalar_type())) labels = labels.to(at::kLong);
    ember::Batch batch;
    batch.tensors = {s.inputs.index_select(0, idx), labels};
    batch.size = count;
    return batch;
  }

 private:
  Arrays load(size_t split) const {
    const auto& f = files_[split];
    Arrays a;
    if (f.size() == 1) {
      auto file = std::make_shared<ember::support::SafetensorsFile>(f[0]);
      for (const std::string& name : {inputs_name_, labels_name_})
        if (!file->contains(name))
          throw ember::RunError(where_[split] + ": tensor_files: " + f[0] + " has no tensor '" + name + "' (set [" + section_ + "] " +
                                (name == inputs_name_ ? "inputs_name" : "labels_name") + " to one of its tensors)");
      a = {file->tensor(inputs_name_), file->tensor(labels_name_)};
    } else {
      a = {read_npy(f[0]), read_npy(f[1])};
    }
    if (a.inputs.dim() < 1 || a.labels.dim() < 1 || a.inputs.size(0) != a.labels.size(0))
      throw ember::RunError(c10::str(where_[split], ": tensor_files: inputs of shape ", a.inputs.sizes(), " and labels of shape ", a.labels.sizes(),
                                     " do not hold the same number of samples (the first dimension)"));
    if (a.inputs.size(0) == 0) throw ember::RunError(where_[split] + ": tensor_files: " + f[0] + " holds no samples");
    return a;
  }

  ember::IHost& host_;
  std::string section_;
  double val_split_;
  std::string inputs_name_, labels_name_;
  std::array<std::vector<std::string>, 3> files_;
  std::array<std::string, 3> where_;
  std::array<Arrays, 3> splits_;
};

ember::IDataModule* make(ember::IHost& host, const ember::IConfig& cfg) { return new TensorFiles(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::IDataModule, "tensor_files", "0.1.0", "Apache-2.0",
             "Inputs and labels from NumPy .npy or .safetensors files, memory-mapped.", EMBER_CONFIG_KEYS(kKeys), make)
