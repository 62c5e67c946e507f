// When the fit loop steps, validates, logs and stops: pure functions of the [trainer] settings and
// the loop's position (Lightning's fit-loop rules), so that every rule is tested in process
// (tests/cadence_test.cpp) rather than by running the engine.
#pragma once
#include <cstdint>

#include "loop/trainer_settings.h"
#include "loop/training_state.h"

namespace ember::engine {

class Cadence {
 public:
  // Keeps a reference: a callback may change the settings during the run (accumulation schedule).
  explicit Cadence(const TrainerSettings& settings) : s_(settings) {}

  // Training batches between validations in an epoch of `batches` (val_check_interval: a count,
  // or a fraction of the epoch, at least 1).
  int64_t val_every(int64_t batches) const;
  // Whether batch `b` (0-based) of an epoch of `batches` ends an optimizer window of `accum`
  // micro-batches (the epoch's last batch always does, as Lightning's).
  static bool steps_after(int64_t b, int64_t batches, int64_t accum) { return (b + 1) % accum == 0 || b + 1 == batches; }
  // Whether batch `b` opens a window (gradients zeroed before its backward); `start` is the first
  // batch this epoch trains (after a mid-epoch resume, a window opens there).
  static bool opens_window(int64_t b, int64_t start, int64_t accum) { return b % accum == 0 || b == start; }
  // Whether epoch `epoch` validates at all (check_val_every_n_epoch; 0 = counted across epochs).
  bool epoch_validates(int64_t epoch) const;
  // Whether a validation is due after the batch `state` has just counted (batches_done and
  // total_batch_idx include it), with validation enabled and `val_every` from val_every().
  bool validates_after_batch(const TrainingState& state, int64_t val_every, bool validation_enabled) const;
  // Whether the step values are published after optimizer step `global_step` (log_every_n_steps).
  bool logs_at(int64_t global_step) const { return s_.log_every_n_steps > 0 && global_step % s_.log_every_n_steps == 0; }
  bool max_steps_reached(const TrainingState& state) const { return s_.max_steps >= 0 && state.global_step >= s_.max_steps; }
  // Whether the epoch validates once more where max_steps ends it, so that monitors see the state
  // stopped at: unless the batch just validated (`validated_last`), and only on epochs that validate.
  bool validates_at_max_steps(const TrainingState& state, bool validated_last, bool validation_enabled) const {
    return !validated_last && validation_enabled && max_steps_reached(state) && epoch_validates(state.epoch);
  }
  bool max_epochs_reached(int64_t epoch) const { return s_.max_epochs >= 0 && epoch >= s_.max_epochs; }
  // Whether fit() would train nothing more from `state` (a restored one included).
  bool fit_done(const TrainingState& state) const { return max_epochs_reached(state.next_epoch()) || max_steps_reached(state); }
  // Whether trainer.min_epochs and min_steps are met, counting the current epoch as done when
  // `epoch_done` (a callback's stop waits until they are).
  bool minimum_trained(const TrainingState& state, bool epoch_done) const {
    return state.epochs_done(epoch_done) >= s_.min_epochs && state.global_step >= s_.min_steps;
  }

 private:
  const TrainerSettings& s_;
};

}  // namespace ember::engine
