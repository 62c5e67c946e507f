// The fit loop's rules (engine/src/loop/cadence.h) and its position (loop/training_state.h),
// tested in process: when a step, a validation, a log or a stop happens, and what a checkpoint's
// `loops` table holds. The engine runs in loop_test.cpp and resume_test.cpp check the same rules
// end to end.
#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "loop/cadence.h"
#include "loop/training_state.h"

using ember::engine::Cadence;
using ember::engine::TrainerSettings;
using ember::engine::TrainingState;

namespace {
std::vector<int64_t> where(int64_t n, const std::function<bool(int64_t)>& rule) {
  std::vector<int64_t> out;
  for (int64_t b = 0; b < n; ++b)
    if (rule(b)) out.push_back(b);
  return out;
}
}  // namespace

TEST(Cadence, ValidationIntervalIsACountOrAFractionOfTheEpoch) {
  TrainerSettings s;
  Cadence c(s);
  EXPECT_EQ(c.val_every(100), 100);  // 1.0: once, at the epoch's end
  s.val_check_interval = 0.25;
  EXPECT_EQ(c.val_every(100), 25);
  EXPECT_EQ(c.val_every(3), 1);  // never 0, however small the fraction
  s.val_check_interval = 7;
  s.val_check_is_count = true;
  EXPECT_EQ(c.val_every(100), 7);
}

TEST(Cadence, AccumulationWindowsEndEveryKBatchesAndAtTheEpochsEnd) {
  // 10 batches, accumulating 3: steps after batches 2, 5, 8 and the last one (Lightning's).
  EXPECT_EQ(where(10, [](int64_t b) { return Cadence::steps_after(b, 10, 3); }), (std::vector<int64_t>{2, 5, 8, 9}));
  EXPECT_EQ(where(10, [](int64_t b) { return Cadence::opens_window(b, 0, 3); }), (std::vector<int64_t>{0, 3, 6, 9}));
  // Resumed at batch 4 (mid-window): a window opens there, then on the usual boundaries.
  EXPECT_EQ(where(10, [](int64_t b) { return b >= 4 && Cadence::opens_window(b, 4, 3); }), (std::vector<int64_t>{4, 6, 9}));
  EXPECT_EQ(where(4, [](int64_t b) { return Cadence::steps_after(b, 4, 1); }), (std::vector<int64_t>{0, 1, 2, 3}));
}

TEST(Cadence, ValidatesOnItsEpochsAndItsBatches) {
  TrainerSettings s;
  s.val_check_interval = 0.5;
  s.check_val_every_n_epoch = 2;
  Cadence c(s);
  const int64_t every = c.val_every(8);
  ASSERT_EQ(every, 4);
  auto due = [&](int64_t epoch, int64_t batches_done, int64_t total, bool enabled = true) {
    TrainingState st;
    st.epoch = epoch;
    st.batches_done = batches_done;
    st.total_batch_idx = total;
    return c.validates_after_batch(st, every, enabled);
  };
  EXPECT_FALSE(due(0, 4, 4));  // epoch 0 of check_val_every_n_epoch = 2: no validation
  EXPECT_TRUE(due(1, 4, 12));
  EXPECT_FALSE(due(1, 5, 13));
  EXPECT_TRUE(due(1, 8, 16));
  EXPECT_FALSE(due(1, 8, 16, /*enabled=*/false));  // no validation data
  EXPECT_FALSE(c.epoch_validates(0));
  EXPECT_TRUE(c.epoch_validates(1));
  // check_val_every_n_epoch = 0 counts batches across epochs (val_check_interval a count).
  s.check_val_every_n_epoch = 0;
  s.val_check_interval = 5;
  s.val_check_is_count = true;
  EXPECT_TRUE(c.validates_after_batch(TrainingState{1, 0, 2, false, 10, false}, 5, true));
  EXPECT_FALSE(c.validates_after_batch(TrainingState{1, 0, 5, false, 13, false}, 5, true));
}

TEST(Cadence, LogsEveryNStepsAndStopsAtTheLimits) {
  TrainerSettings s;
  s.log_every_n_steps = 3;
  s.max_epochs = 2;
  Cadence c(s);
  EXPECT_EQ(where(10, [&](int64_t step) { return c.logs_at(step); }), (std::vector<int64_t>{0, 3, 6, 9}));
  TrainingState st;
  st.epoch = 1;
  EXPECT_FALSE(c.fit_done(st));  // epoch 1 of 2 not finished yet
  st.epoch_finished = true;
  EXPECT_TRUE(c.fit_done(st));
  EXPECT_TRUE(c.max_epochs_reached(2));
  s.max_epochs = -1;
  s.max_steps = 40;
  st.global_step = 39;
  EXPECT_FALSE(c.fit_done(st));
  EXPECT_FALSE(c.max_steps_reached(st));
  st.global_step = 40;
  EXPECT_TRUE(c.fit_done(st));
  EXPECT_TRUE(c.max_steps_reached(st));
}

TEST(Cadence, MaxStepsEndsWithAValidationUnlessOneJustRan) {
  TrainerSettings s;
  s.max_steps = 10;
  s.check_val_every_n_epoch = 2;
  Cadence c(s);
  TrainingState st;
  st.epoch = 1;
  st.global_step = 9;
  EXPECT_FALSE(c.validates_at_max_steps(st, false, true));  // not there yet
  st.global_step = 10;
  EXPECT_TRUE(c.validates_at_max_steps(st, false, true));
  EXPECT_FALSE(c.validates_at_max_steps(st, /*validated_last=*/true, true));  // its batch just validated
  EXPECT_FALSE(c.validates_at_max_steps(st, false, /*validation_enabled=*/false));
  st.epoch = 0;  // an epoch that does not validate (check_val_every_n_epoch = 2)
  EXPECT_FALSE(c.validates_at_max_steps(st, false, true));
  s.max_steps = -1;  // no limit: a stop for any other reason ends without it
  st.epoch = 1;
  EXPECT_FALSE(c.validates_at_max_steps(st, false, true));
}

TEST(Cadence, AStopWaitsForMinEpochsAndMinSteps) {
  TrainerSettings s;
  s.min_epochs = 3;
  s.min_steps = 20;
  Cadence c(s);
  TrainingState st;
  st.epoch = 2;
  st.global_step = 25;
  EXPECT_FALSE(c.minimum_trained(st, /*epoch_done=*/false));  // 2 epochs done
  EXPECT_TRUE(c.minimum_trained(st, /*epoch_done=*/true));    // the third ends now
  st.global_step = 19;
  EXPECT_FALSE(c.minimum_trained(st, true));
}

TEST(TrainingState, RoundTripsThroughTheCheckpointsLoopsTable) {
  TrainingState st;
  st.epoch = 3;
  st.global_step = 41;
  st.batches_done = 5;
  st.epoch_finished = false;
  st.total_batch_idx = 77;
  st.validation_pending = true;
  const auto table = st.to_ivalue();
  for (const char* key : {"epoch", "global_step", "batches_done", "epoch_finished", "total_batch_idx", "validation_pending"})
    EXPECT_TRUE(table.contains(key)) << key;
  const auto back = TrainingState::from_ivalue(table);
  EXPECT_EQ(back.epoch, 3);
  EXPECT_EQ(back.global_step, 41);
  EXPECT_EQ(back.batches_done, 5);
  EXPECT_FALSE(back.epoch_finished);
  EXPECT_EQ(back.total_batch_idx, 77);
  EXPECT_TRUE(back.validation_pending);
  // A resume skips the 5 batches done and reports the last of them.
  EXPECT_EQ(back.resume_batch(), 5);
  EXPECT_EQ(back.last_batch_idx(), 4);
  EXPECT_EQ(back.next_epoch(), 3);
  // A table of format version 1 has no validation_pending: saved after its validation.
  auto old = table;
  ASSERT_EQ(old.erase("validation_pending"), 1u);
  EXPECT_FALSE(TrainingState::from_ivalue(old).validation_pending);
  // At an epoch's end (what Fabric writes) the next run starts the next epoch from its first batch.
  const auto end = TrainingState::from_ivalue(TrainingState::end_of_epoch(4, 100).to_ivalue());
  EXPECT_TRUE(end.epoch_finished);
  EXPECT_EQ(end.next_epoch(), 5);
  EXPECT_EQ(end.resume_batch(), 0);
  EXPECT_EQ(end.global_step, 100);
  EXPECT_FALSE(end.validation_pending);
}
