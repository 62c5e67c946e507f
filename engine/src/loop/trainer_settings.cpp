#include "loop/trainer_settings.h"

#include <c10/util/StringUtil.h>

#include <string>

#include "config/run_config.h"

namespace ember::engine {

TrainerSettings TrainerSettings::from(const Section& t) {
  TrainerSettings s;
  s.max_steps = t.get_int("max_steps");
  s.max_epochs = t.has("max_epochs") ? t.get_int("max_epochs") : (s.max_steps == -1 ? 1000 : -1);
  s.min_epochs = t.get_int("min_epochs");
  s.min_steps = t.get_int("min_steps");
  // Lightning lets the maximum win silently; a minimum above it is a mistake worth one line.
  if (s.max_epochs >= 0 && s.min_epochs > s.max_epochs)
    throw UsageError(t.where("min_epochs") + ": trainer.min_epochs = " + std::to_string(s.min_epochs) + " exceeds max_epochs = " +
                     std::to_string(s.max_epochs) + ": lower min_epochs or raise max_epochs");
  if (s.max_steps >= 0 && s.min_steps > s.max_steps)
    throw UsageError(t.where("min_steps") + ": trainer.min_steps = " + std::to_string(s.min_steps) + " exceeds max_steps = " +
                     std::to_string(s.max_steps) + ": lower min_steps or raise max_steps");
  s.limit_train = t.get_float("limit_train_batches");
  s.limit_train_is_count = t.is_integer("limit_train_batches");
  s.limit_val = t.get_float("limit_val_batches");
  s.limit_val_is_count = t.is_integer("limit_val_batches");
  s.limit_test = t.get_float("limit_test_batches");
  s.limit_test_is_count = t.is_integer("limit_test_batches");
  auto fraction_ok = [&](const char* key, double v, bool count) {
    if (!count && v > 1.0)
      throw UsageError(t.where(key) + ": trainer." + key + ": a float is a fraction and must be <= 1.0, got " +
                       std::to_string(v) + " (write an integer for a number of batches)");
  };
  fraction_ok("limit_train_batches", s.limit_train, s.limit_train_is_count);
  fraction_ok("limit_val_batches", s.limit_val, s.limit_val_is_count);
  fraction_ok("limit_test_batches", s.limit_test, s.limit_test_is_count);
  // Lightning's overfit_batches: the same first batches of training and validation every epoch.
  if ((s.overfit_batches = t.get_float("overfit_batches")) > 0) {
    fraction_ok("overfit_batches", s.overfit_batches, t.is_integer("overfit_batches"));
    s.limit_train = s.limit_val = s.overfit_batches;
    s.limit_train_is_count = s.limit_val_is_count = t.is_integer("overfit_batches");
  }
  s.limit_predict = t.get_float("limit_predict_batches");
  s.limit_predict_is_count = t.is_integer("limit_predict_batches");
  fraction_ok("limit_predict_batches", s.limit_predict, s.limit_predict_is_count);
  s.val_check_interval = t.get_float("val_check_interval");
  s.val_check_is_count = t.is_integer("val_check_interval");
  fraction_ok("val_check_interval", s.val_check_interval, s.val_check_is_count);
  s.check_val_every_n_epoch = t.get_int("check_val_every_n_epoch");
  if (s.check_val_every_n_epoch == 0 && !s.val_check_is_count)
    throw UsageError(t.where("check_val_every_n_epoch") +
                     ": trainer.check_val_every_n_epoch = 0 needs an integer val_check_interval (validate every n batches)");
  s.num_sanity_val_steps = t.get_int("num_sanity_val_steps");
  s.accumulate_grad_batches = t.get_int("accumulate_grad_batches");
  s.gradient_clip_val = t.has("gradient_clip_val") ? t.get_float("gradient_clip_val") : 0.0;
  s.gradient_clip_algorithm = t.get_string("gradient_clip_algorithm") == "value" ? ClipAlgorithm::value : ClipAlgorithm::norm;
  s.log_every_n_steps = t.get_int("log_every_n_steps");
  s.seed = static_cast<uint64_t>(t.get_int("seed"));
  s.enable_progress_bar = t.get_bool("enable_progress_bar");
  s.cuda_graph = t.get_bool("cuda_graph");
  s.cuda_graph_warmup_steps = t.get_int("cuda_graph_warmup_steps");
  // Lightning's fast_dev_run = N: N batches of each loop in one epoch, validation after them, no
  // sanity check, every step logged. (RunSession removes the run folder afterwards.)
  if ((s.fast_dev_run = t.get_int("fast_dev_run")) > 0) {
    const auto n = static_cast<double>(s.fast_dev_run);
    s.max_steps = s.fast_dev_run;
    s.max_epochs = 1;
    s.min_epochs = s.min_steps = 0;
    s.limit_train = s.limit_val = s.limit_test = s.limit_predict = n;
    s.limit_train_is_count = s.limit_val_is_count = s.limit_test_is_count = s.limit_predict_is_count = true;
    s.val_check_interval = 1.0;
    s.val_check_is_count = false;
    s.check_val_every_n_epoch = 1;
    s.num_sanity_val_steps = 0;
    s.log_every_n_steps = 1;
  }
  return s;
}

}  // namespace ember::engine
