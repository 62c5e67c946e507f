#include "loop/training_state.h"

#include "checkpoint/checkpoint_document.h"

namespace ember::engine {

TrainingState TrainingState::end_of_epoch(int64_t epoch, int64_t global_step) {
  TrainingState s;
  s.epoch = epoch;
  s.global_step = global_step;
  s.epoch_finished = true;
  return s;
}

c10::impl::GenericDict TrainingState::to_ivalue() const {
  auto loops = checkpoint_dict();
  loops.insert("epoch", epoch);
  loops.insert("batches_done", batches_done);
  loops.insert("epoch_finished", epoch_finished);
  loops.insert("global_step", global_step);
  loops.insert("total_batch_idx", total_batch_idx);
  loops.insert("validation_pending", validation_pending);
  return loops;
}

TrainingState TrainingState::from_ivalue(const c10::impl::GenericDict& loops) {
  TrainingState s;
  s.epoch = loops.at("epoch").toInt();
  s.batches_done = loops.at("batches_done").toInt();
  s.epoch_finished = loops.at("epoch_finished").toBool();
  s.global_step = loops.at("global_step").toInt();
  s.total_batch_idx = loops.at("total_batch_idx").toInt();
  // Checkpoints written before this key existed were saved after their validation.
  s.validation_pending = !s.epoch_finished && loops.contains("validation_pending") && loops.at("validation_pending").toBool();
  return s;
}

}  // namespace ember::engine
