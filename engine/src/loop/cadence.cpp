#include "loop/cadence.h"

#include <algorithm>

namespace ember::engine {

int64_t Cadence::val_every(int64_t batches) const {
  if (s_.val_check_is_count) return static_cast<int64_t>(s_.val_check_interval);
  return std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(batches) * s_.val_check_interval));
}

bool Cadence::epoch_validates(int64_t epoch) const {
  return s_.check_val_every_n_epoch == 0 || (epoch + 1) % s_.check_val_every_n_epoch == 0;
}

bool Cadence::validates_after_batch(const TrainingState& state, int64_t val_every, bool validation_enabled) const {
  if (!validation_enabled || !epoch_validates(state.epoch)) return false;
  // check_val_every_n_epoch = 0 counts batches across epochs; otherwise within this one.
  const int64_t counter = s_.check_val_every_n_epoch == 0 ? state.total_batch_idx : state.batches_done;
  return counter % val_every == 0;
}

}  // namespace ember::engine
