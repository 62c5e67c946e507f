// The fit loop's position: what a checkpoint's `loops` table holds (docs/checkpoint.md) and the
// one place that defines it. The loop advances it; checkpoints serialise it; Fabric writes the
// end-of-epoch position of a program's loop with it.
#pragma once
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <cstdint>

namespace ember::engine {

struct TrainingState {
  int64_t epoch = 0;                // the current epoch (0-based)
  int64_t global_step = 0;          // optimizer steps taken
  int64_t batches_done = 0;         // training batches finished in the current epoch
  bool epoch_finished = false;      // every batch and the epoch-end validation of `epoch` are done
  int64_t total_batch_idx = 0;      // training batches over all epochs
  bool validation_pending = false;  // the last batch's validation is due and has not published yet

  // The end of epoch `epoch` after `global_step` steps: a resume goes on with the next epoch.
  static TrainingState end_of_epoch(int64_t epoch, int64_t global_step);

  // The checkpoint's `loops` table.
  c10::impl::GenericDict to_ivalue() const;
  // Requires: a `loops` table of format version 1 or 2 (validation_pending may be missing: such a
  // checkpoint was saved after its validation). Throws c10::Error when a key is missing.
  static TrainingState from_ivalue(const c10::impl::GenericDict& loops);

  // Where a resumed epoch starts: the batches of `epoch` to skip (0 at an epoch's end).
  int64_t resume_batch() const { return epoch_finished ? 0 : batches_done; }
  // The batch index a resumed run reports before its first batch: the last finished one.
  int64_t last_batch_idx() const { return epoch_finished ? 0 : (batches_done > 0 ? batches_done - 1 : 0); }
  // Epochs finished, counting the current one when `epoch_done`.
  int64_t epochs_done(bool epoch_done) const { return epoch + (epoch_done ? 1 : 0); }
  // The epoch fit() trains next.
  int64_t next_epoch() const { return epoch_finished ? epoch + 1 : epoch; }
};

}  // namespace ember::engine
