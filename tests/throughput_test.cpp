// throughput: rates against a known synthetic rate (a test plugin sleeps in every batch).
#include <gtest/gtest.h>

#include "throughput_window.h"
#include "observability_support.h"

using namespace ember::test;
namespace fs = std::filesystem;

TEST(Throughput, WindowRates) {
  ember_tp::Window w(2);
  w.add({0.0, 0, 0, 0});
  w.add({1.0, 1, 10, 100});
  w.add({2.0, 2, 20, 200});
  w.add({4.0, 3, 30, 300});  // the window now spans samples 1..3
  ember_tp::Rates r;
  ASSERT_TRUE(w.rates(&r));
  EXPECT_DOUBLE_EQ(r.batches_per_sec, 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(r.samples_per_sec, 20.0 / 3.0);
  EXPECT_DOUBLE_EQ(r.items_per_sec, 200.0 / 3.0);
}

TEST(Throughput, MatchesAKnownSyntheticRate) {
  TempDir dir("observability");
  write_file(dir / "run.toml", kMlp);
  // Every batch sleeps 50 ms: at most 20 batches/s, and the tiny MLP adds little.
  engine_ok(dir, {"--plugins", "throughput,sleeper", "--set", "sleeper.seconds=[0.05]", "--set", "throughput.window_size=4",
                  "--set", "throughput.items=\"input_numel\"", "--set", "trainer.max_epochs=1"});
  const auto rows = read_csv(dir / "runs/run/version_0/metrics.csv");
  int n = 0;
  const double bps = last_value(rows, "train|device|batches_per_sec", &n);
  EXPECT_EQ(n, 6) << "one value per step";
  EXPECT_LE(bps, 20.0);
  EXPECT_GE(bps, 15.0);
  const double sps = last_value(rows, "train|device|samples_per_sec", &n);
  EXPECT_NEAR(sps / bps, 16.0, 1e-9);  // full batches of 16
  const double ips = last_value(rows, "train|items_per_sec", &n);
  EXPECT_NEAR(ips / sps, 8.0, 1e-9);  // 8 input elements per sample
  EXPECT_NEAR(last_value(rows, "train|batches_per_sec", &n), bps, 1e-12);  // one rank
}

TEST(Throughput, LeavesValidationOut) {
  TempDir dir("observability");
  write_file(dir / "run.toml", kMlp);
  // Validation after batch 3 sleeps 0.3 s per batch (0.6 s); counted, it would pull the rate
  // at the epoch's last batch (window: all 6) down to 6 / (0.3 + 0.6) = 6.7/s.
  engine_ok(dir, {"--plugins", "throughput,sleeper", "--set",
                  "sleeper.hooks=[\"on_train_batch_start\", \"on_validation_batch_start\"]", "--set",
                  "sleeper.seconds=[0.05, 0.3]", "--set", "throughput.window_size=6", "--set", "trainer.max_epochs=1",
                  "--set", "trainer.val_check_interval=3", "--set", "trainer.num_sanity_val_steps=0"});
  int n = 0;
  const double bps = last_value(read_csv(dir / "runs/run/version_0/metrics.csv"), "train|device|batches_per_sec", &n);
  EXPECT_LE(bps, 20.0);
  EXPECT_GE(bps, 15.0);
}
