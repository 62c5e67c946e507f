// spike_guard (issue "Training that heals itself", its stop action): a planted NaN loss and a
// planted loss spike (the synthetic data's nan_samples / spike_samples) stop the run non-zero with
// one line naming the batch and the step, on one process and on 2 ddp ranks (every rank stops at
// the same batch, promptly, not by a timeout); the event is in the run folder; a healthy run is
// left alone.
#include <gtest/gtest.h>

#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {

// 72 samples, batch 8: 9 batches an epoch, two epochs.
const std::string kRun = synthetic_mlp_toml({.accelerator = "cpu", .num_train = 72, .num_val = 16, .batch_size = 8}) +
                         "[optimizer]\nname = \"sgd\"\nlr = 0.05\n";

std::string read_all(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The "training batch B of epoch E (global step G)" of every spike_guard line in `err`.
std::set<std::string> stops(const std::string& err) {
  std::set<std::string> out;
  const std::regex re(R"(spike_guard: .* at (training batch \d+ of epoch \d+ \(global step \d+\)))");
  for (auto it = std::sregex_iterator(err.begin(), err.end(), re); it != std::sregex_iterator(); ++it) out.insert((*it)[1].str());
  return out;
}

}  // namespace

TEST(SpikeGuard, NonFiniteLossStopsTheRunNamingTheBatch) {
  TempDir dir("spike");
  write_file(dir / "run.toml", kRun);
  auto r = run_engine({"--plugins", "spike_guard", "run.toml", "--set", "data.nan_samples=[5]"}, dir.path(), {}, 120);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("spike_guard: non-finite training loss (nan) at training batch"), std::string::npos) << r.err;
  EXPECT_EQ(stops(r.err).size(), 1u) << r.err;
  const std::string events = read_all(dir / "runs/run/version_0/spike_guard.jsonl");
  EXPECT_NE(events.find("\"loss\": \"nan\""), std::string::npos) << events;
  EXPECT_NE(events.find("\"action\": \"stop\""), std::string::npos) << events;
  // Without the guard the same run trains on to the end and exits 0 (what Lightning does too).
  TempDir plain("spike");
  write_file(plain / "run.toml", kRun);
  EXPECT_EQ(run_engine({"run.toml", "--set", "data.nan_samples=[5]"}, plain.path(), {}, 120).exit_code, 0);
}

TEST(SpikeGuard, LossSpikeStopsTheRunAndAHealthyRunIsLeftAlone) {
  TempDir dir("spike");
  write_file(dir / "run.toml", kRun);
  // Sample 40 lands in the second half of epoch 0 or in epoch 1 (shuffled): after the warm-up.
  auto r = run_engine({"--plugins", "spike_guard", "run.toml", "--set", "data.spike_samples=[40]", "--set", "spike_guard.warmup=3"},
                      dir.path(), {}, 120);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("spiked (running mean of the last"), std::string::npos) << r.err;
  // The same data and guard without the planted spike: two epochs, exit 0, no event file.
  TempDir healthy("spike");
  write_file(healthy / "run.toml", kRun);
  auto h = run_engine({"--plugins", "spike_guard", "run.toml", "--set", "spike_guard.warmup=3"}, healthy.path(), {}, 120);
  EXPECT_EQ(h.exit_code, 0) << h.err;
  EXPECT_FALSE(fs::exists(healthy / "runs/run/version_0/spike_guard.jsonl"));
}

TEST(SpikeGuard, EveryDdpRankStopsAtTheSameBatch) {
  EMBER_SKIP_WITHOUT_MPI();
  TempDir dir("spike");
  write_file(dir / "run.toml", kRun);
  // The NaN sample is on one rank only; the other stops because that one voted.
  auto r = run_engine({"--plugins", "ddp,spike_guard", "run.toml", "--set", "data.nan_samples=[5]", "--set", "trainer.devices=2",
                       "--set", "ddp.timeout=60.0"},
                      dir.path(), {}, 120);
  EXPECT_NE(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("non-finite training loss (nan)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("another rank's training loss spiked or was not finite"), std::string::npos) << r.err;
  EXPECT_EQ(stops(r.err).size(), 1u) << "both ranks name the same batch: " << r.err;
  EXPECT_EQ(r.err.find("timed out"), std::string::npos) << "stopped by the vote, not by the watchdog: " << r.err;
}

// trainer.detect_anomaly (Lightning's meaning: autograd's anomaly mode): the planted NaN stops the
// run at the backward that produced it, naming the operation; without it the run trains on.
TEST(SpikeGuard, DetectAnomalyStopsAtTheBackwardThatMadeNaN) {
  TempDir dir("spike");
  write_file(dir / "run.toml", kRun);
  auto r = run_engine({"run.toml", "--set", "data.nan_samples=[5]", "--set", "trainer.detect_anomaly=true"}, dir.path(), {}, 120);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("autograd anomaly detection on"), std::string::npos) << r.err;
  EXPECT_TRUE(std::regex_search(r.err, std::regex("Function '\\w+Backward\\d*' returned nan values"))) << r.err;
}
