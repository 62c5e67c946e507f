// The [trainer] values the loops read, with Lightning's derived defaults applied (fast_dev_run,
// overfit_batches, max_epochs from max_steps), and their one-line errors with file:line.
#pragma once
#include <ember/types.h>

#include <cstdint>

namespace ember::engine {

class Section;

// [trainer] values the loop reads, with Lightning's derived defaults applied.
struct TrainerSettings {
  int64_t max_epochs = 1000, max_steps = -1;
  int64_t min_epochs = 0, min_steps = 0;  // 0 = no minimum
  int64_t fast_dev_run = 0;  // > 0: the limits below were set to this many batches (Lightning's)
  double overfit_batches = 0;  // > 0: the train/val limits, and the training order is the file's
  double limit_train = 1.0, limit_val = 1.0, limit_test = 1.0, limit_predict = 1.0;
  bool limit_train_is_count = false, limit_val_is_count = false, limit_test_is_count = false, limit_predict_is_count = false;
  double val_check_interval = 1.0;
  bool val_check_is_count = false;
  int64_t check_val_every_n_epoch = 1, num_sanity_val_steps = 2, accumulate_grad_batches = 1;
  double gradient_clip_val = 0;
  ClipAlgorithm gradient_clip_algorithm = ClipAlgorithm::norm;
  int64_t log_every_n_steps = 50;
  uint64_t seed = 0;
  bool enable_progress_bar = true;
  bool cuda_graph = false;
  int64_t cuda_graph_warmup_steps = 3;

  static TrainerSettings from(const Section& trainer);
};

}  // namespace ember::engine
