// Plain types shared by every interface of the SDK.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <string>
#include <vector>

#include "ember/export.h"

namespace ember {

// Every struct that crosses the plugin boundary (Batch, LogOptions, LaunchRequest, DataSetup)
// carries its size as its first field, filled by the default initializer of the binary that
// built it. Fields are only ever appended (a minor bump, docs/abi.md); whoever reads a struct that
// another binary filled reads an appended field only when has_field says that binary knew it:
//   if (ember::has_field(options, &LogOptions::new_field)) use(options.new_field);
template <class T, class M>
bool has_field(const T& object, M T::*field) {
  const auto offset = reinterpret_cast<const char*>(&(object.*field)) - reinterpret_cast<const char*>(&object);
  return object.struct_size >= static_cast<size_t>(offset) + sizeof(M);
}

// A mini-batch: tensors in the order the data module defines (by convention inputs, then
// targets), plus the number of samples it holds (for weighting epoch means).
struct Batch {
  uint32_t struct_size = sizeof(Batch);
  std::vector<at::Tensor> tensors;
  int64_t size = 0;

  const at::Tensor& operator[](size_t i) const { return tensors.at(i); }
  at::Tensor& operator[](size_t i) { return tensors.at(i); }
};

enum class Split : int { train = 0, val = 1, test = 2 };

// What the trainer is doing (ITrainer::stage(), and the stage setup/teardown hooks run for, as
// Lightning's setup(stage)). Values are stable; new ones are appended (a minor bump), so treat an unknown
// value as "none of the above".
enum class Stage : int { none = 0, fit = 1, validate = 2, test = 3, sanity_check = 4, predict = 5 };

// Callback hooks, in Lightning's names. Values are stable; new hooks are appended (minor bump):
// a plugin built against an older SDK never receives the newer values.
enum class Hook : int {
  setup = 0,
  teardown,
  on_fit_start,
  on_fit_end,
  on_sanity_check_start,
  on_sanity_check_end,
  on_train_start,
  on_train_end,
  on_train_epoch_start,
  on_train_epoch_end,
  on_train_batch_start,
  on_train_batch_end,
  on_validation_start,
  on_validation_end,
  on_validation_epoch_start,
  on_validation_epoch_end,
  on_validation_batch_start,
  on_validation_batch_end,
  on_test_start,
  on_test_end,
  on_test_epoch_start,
  on_test_epoch_end,
  on_test_batch_start,
  on_test_batch_end,
  on_before_backward,
  on_after_backward,
  on_before_optimizer_step,
  on_before_zero_grad,
  on_save_checkpoint,
  on_load_checkpoint,
  on_exception,
  count_  // not a hook: the number of hooks this SDK version knows
};

const char* hook_name(Hook hook);

// How a logged value is reduced over an epoch.
enum class Reduce : int { mean = 0, sum = 1, max = 2, min = 3 };

// Like Lightning's self.log(...) arguments. `on_step`/`on_epoch` left at -1 take Lightning's
// defaults: training steps log per step, validation and test per epoch.
struct LogOptions {
  uint32_t struct_size = sizeof(LogOptions);
  int on_step = -1;
  int on_epoch = -1;
  bool prog_bar = false;
  bool logger = true;
  Reduce reduce = Reduce::mean;
  bool sync_dist = false;  // reduce across ranks (only at epoch end / log time, never per step)
  int64_t batch_size = -1; // weight of this value in the epoch mean; -1 = the batch's size
};

enum class ReduceOp : int { sum = 0, mean = 1, max = 2, min = 3 };

// A tensor with the module parameter (or buffer) name it stands for.
struct NamedTensor {
  std::string name;
  at::Tensor tensor;
};
enum class ClipAlgorithm : int { norm = 0, value = 1 };

// Base of every object a plugin creates. `state_dict` is saved in checkpoints under the plugin's
// name and handed back to `load_state_dict` on resume (an empty IValue means "no state").
class EMBER_SDK_API IPluginObject {
 public:
  virtual ~IPluginObject() = default;
  virtual c10::IValue state_dict() const { return {}; }
  virtual void load_state_dict(const c10::IValue& /*state*/) {}
  // Returns an extension interface by id ("ember.ICheckpointLocator/1"), or nullptr. New
  // capabilities arrive as new interfaces found here, so released interfaces never change.
  virtual void* query_interface(const char* /*iid*/) { return nullptr; }
};

inline const char* hook_name(Hook hook) {
  static const char* const names[] = {
      "setup", "teardown", "on_fit_start", "on_fit_end", "on_sanity_check_start",
      "on_sanity_check_end", "on_train_start", "on_train_end", "on_train_epoch_start",
      "on_train_epoch_end", "on_train_batch_start", "on_train_batch_end", "on_validation_start",
      "on_validation_end", "on_validation_epoch_start", "on_validation_epoch_end",
      "on_validation_batch_start", "on_validation_batch_end", "on_test_start", "on_test_end",
      "on_test_epoch_start", "on_test_epoch_end", "on_test_batch_start", "on_test_batch_end",
      "on_before_backward", "on_after_backward", "on_before_optimizer_step",
      "on_before_zero_grad", "on_save_checkpoint", "on_load_checkpoint", "on_exception"};
  auto i = static_cast<int>(hook);
  return (i >= 0 && i < static_cast<int>(Hook::count_)) ? names[i] : "unknown";
}

}  // namespace ember
