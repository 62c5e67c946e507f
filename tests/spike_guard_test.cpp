// spike_guard (issue "Training that heals itself"): a planted NaN loss and a planted loss spike
// (the synthetic data's nan_samples / spike_samples) stop the run non-zero with one line naming the
// batch and the step, on one process and on 2 ddp ranks (every rank stops at the same batch,
// promptly, not by a timeout); the event is in the run folder; a healthy run is left alone. With
// action = "rollback" the run goes back to its snapshot, skips the batches and ends with the
// weights of a run that skipped them from the start.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "checkpoint_support.h"
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

namespace {
// The "skip_batches" list of a rolled-back run's skipped_batches.json, as a TOML list.
std::string skip_list(const fs::path& run_dir) {
  const std::string json = read_all(run_dir / "skipped_batches.json");
  std::smatch m;
  if (!std::regex_search(json, m, std::regex(R"("skip_batches": (\[[^\]]*\]))"))) return "";
  return m[1].str();
}

void expect_same_weights(const fs::path& a, const fs::path& b) {
  auto wa = weights(a), wb = weights(b);
  ASSERT_EQ(wa.size(), wb.size());
  for (const auto& [name, t] : wa) {
    EXPECT_TRUE(at::isfinite(t).all().item<bool>()) << name << " is not finite in " << a;
    EXPECT_TRUE(at::equal(t, wb.at(name))) << name << " differs";
  }
}

struct Planted {
  const char* name;
  std::vector<std::string> args;
};
}  // namespace

// action = "rollback": a planted NaN batch, a planted spike, and a NaN under gradient accumulation
// (the whole optimizer step's batches are skipped): the run rolls back to its snapshot, finishes
// with exit 0, logs the event, and ends with exactly the weights of a run told to skip those
// batches from the start (the list from its skipped_batches.json).
TEST(SpikeGuard, RollbackEqualsARunThatSkipsTheBatchesFromTheStart) {
  for (const Planted& p : {Planted{"nan", {"--set", "data.nan_samples=[5]"}},
                           Planted{"spike", {"--set", "data.spike_samples=[40]", "--set", "spike_guard.warmup=3"}},
                           Planted{"nan, accumulation 2", {"--set", "data.nan_samples=[5]", "--set", "trainer.accumulate_grad_batches=2"}}}) {
    SCOPED_TRACE(p.name);
    TempDir rolled("spike"), skipped("spike");
    for (const auto* d : {&rolled, &skipped}) write_file(*d / "run.toml", kRun);
    std::vector<std::string> a = {"--plugins", "spike_guard", "run.toml", "--set", "spike_guard.action=\"rollback\"", "--set",
                                  "spike_guard.snapshot_every_n_steps=4"};
    a.insert(a.end(), p.args.begin(), p.args.end());
    auto r = run_engine(a, rolled.path(), {}, 120);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.err.find("rolling back to the snapshot of step"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("rolled back to"), std::string::npos) << r.err;
    const fs::path run_dir = rolled / "runs/run/version_0";
    EXPECT_NE(read_all(run_dir / "spike_guard.jsonl").find("\"action\": \"rollback\""), std::string::npos);
    const std::string list = skip_list(run_dir);
    ASSERT_FALSE(list.empty()) << read_all(run_dir / "skipped_batches.json");
    if (std::string(p.name).find("accumulation") != std::string::npos) {
      // Every batch of the step is skipped: more batches than rollbacks.
      int64_t rollbacks = 0;
      for (size_t at = r.err.find("rolling back to the snapshot"); at != std::string::npos; at = r.err.find("rolling back to the snapshot", at + 1))
        ++rollbacks;
      EXPECT_GT(std::count(list.begin(), list.end(), ':'), rollbacks) << list;
    }
    std::vector<std::string> b = {"--plugins", "spike_guard", "run.toml", "--set", "spike_guard.skip_batches=" + list};
    b.insert(b.end(), p.args.begin(), p.args.end());
    auto s = run_engine(b, skipped.path(), {}, 120);
    ASSERT_EQ(s.exit_code, 0) << s.err;
    EXPECT_EQ(s.err.find("rolling back"), std::string::npos) << s.err;
    EXPECT_NE(s.err.find("spike_guard: skipping training batch"), std::string::npos) << s.err;
    expect_same_weights(rolled / "runs/run/version_0/checkpoints/last.ckpt", skipped / "runs/run/version_0/checkpoints/last.ckpt");
  }
}

// The same on 2 ddp ranks: the NaN is on one rank's batch; both roll back at the same batch and
// the job ends with the weights of the skip-from-the-start run.
TEST(SpikeGuard, EveryDdpRankRollsBackTogether) {
  EMBER_SKIP_WITHOUT_MPI();
  TempDir rolled("spike"), skipped("spike");
  for (const auto* d : {&rolled, &skipped}) write_file(*d / "run.toml", kRun);
  const std::vector<std::string> ddp = {"--plugins", "ddp,spike_guard", "run.toml", "--set", "data.nan_samples=[5]", "--set",
                                        "trainer.devices=2", "--set", "ddp.timeout=60.0", "--set", "data.batch_size=4"};
  auto a = ddp;
  a.insert(a.end(), {"--set", "spike_guard.action=\"rollback\"", "--set", "spike_guard.snapshot_every_n_steps=3"});
  auto r = run_engine(a, rolled.path(), {}, 180);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("another rank's training loss spiked or was not finite"), std::string::npos) << r.err;
  const std::string list = skip_list(rolled / "runs/run/version_0");
  ASSERT_FALSE(list.empty());
  auto b = ddp;
  b.insert(b.end(), {"--set", "spike_guard.skip_batches=" + list});
  auto s = run_engine(b, skipped.path(), {}, 180);
  ASSERT_EQ(s.exit_code, 0) << s.err;
  expect_same_weights(rolled / "runs/run/version_0/checkpoints/last.ckpt", skipped / "runs/run/version_0/checkpoints/last.ckpt");
}

// max_rollbacks: the planted NaN sample comes back every epoch; with max_rollbacks = 1 the second
// one stops the run, saying so. lr_factor lowers the rate after a rollback: the run then differs
// from the skip-from-the-start one.
TEST(SpikeGuard, RollbacksAreBoundedAndCanLowerTheLearningRate) {
  TempDir dir("spike");
  write_file(dir / "run.toml", kRun);
  auto r = run_engine({"--plugins", "spike_guard", "run.toml", "--set", "data.nan_samples=[5]", "--set", "spike_guard.action=\"rollback\"",
                       "--set", "spike_guard.max_rollbacks=1"},
                      dir.path(), {}, 120);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("stopped after 1 rollback(s) (spike_guard.max_rollbacks = 1)"), std::string::npos) << r.err;
  // A malformed skip entry is one line naming the key.
  auto bad = run_engine({"--plugins", "spike_guard", "run.toml", "--set", "spike_guard.skip_batches=[\"3\"]"}, dir.path(), {}, 60);
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("spike_guard.skip_batches"), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("'3' is not a batch; write \"EPOCH:BATCH\""), std::string::npos) << bad.err;

  TempDir lowered("spike"), skipped("spike");
  for (const auto* d : {&lowered, &skipped}) write_file(*d / "run.toml", kRun);
  auto l = run_engine({"--plugins", "spike_guard", "run.toml", "--set", "data.nan_samples=[5]", "--set", "trainer.max_epochs=1", "--set",
                       "spike_guard.action=\"rollback\"", "--set", "spike_guard.lr_factor=0.1", "--set", "spike_guard.lr_steps=3"},
                      lowered.path(), {}, 120);
  ASSERT_EQ(l.exit_code, 0) << l.err;
  auto s = run_engine({"--plugins", "spike_guard", "run.toml", "--set", "data.nan_samples=[5]", "--set", "trainer.max_epochs=1", "--set",
                       "spike_guard.skip_batches=" + skip_list(lowered / "runs/run/version_0")},
                      skipped.path(), {}, 120);
  ASSERT_EQ(s.exit_code, 0) << s.err;
  auto wl = weights(lowered / "runs/run/version_0/checkpoints/last.ckpt"), ws = weights(skipped / "runs/run/version_0/checkpoints/last.ckpt");
  bool differ = false;
  for (const auto& [name, t] : wl) differ = differ || !at::equal(t, ws.at(name));
  EXPECT_TRUE(differ) << "3 steps at a tenth of the rate change the weights";
}

// check_gradients: an inf planted in the gradients of batch 4 (the grad_poison test plugin; the
// loss of that batch is still finite) is a spike at batch 4 itself; without the check the guard
// sees it one batch later, as the NaN loss the broken weights give. Under 16-mixed the loss scaler
// skips that step, so nothing was broken and the run goes on.
TEST(SpikeGuard, NonFiniteGradientsAreASpikeUnlessThePrecisionSkipsTheStep) {
  TempDir dir("spike");
  write_file(dir / "run.toml", kRun + "[grad_poison]\nbatches = [4]\n");
  const std::vector<std::string> base = {"--plugin-path", test_plugin_dir("good").string(), "--plugins", "spike_guard,grad_poison", "run.toml"};
  auto with = [&](std::vector<std::string> extra) {
    auto a = base;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  auto checked = run_engine(with({"--set", "spike_guard.check_gradients=true"}), dir.path(), {}, 120);
  EXPECT_EQ(checked.exit_code, 1) << checked.err;
  EXPECT_NE(checked.err.find("spike_guard: non-finite gradient (training loss "), std::string::npos) << checked.err;
  EXPECT_EQ(stops(checked.err), (std::set<std::string>{"training batch 4 of epoch 0 (global step 5)"})) << checked.err;
  auto unchecked = run_engine(base, dir.path(), {}, 120);
  EXPECT_EQ(unchecked.exit_code, 1) << unchecked.err;
  EXPECT_EQ(stops(unchecked.err), (std::set<std::string>{"training batch 5 of epoch 0 (global step 6)"})) << unchecked.err;
  auto amp = run_engine(with({"--plugins", "amp16", "--set", "spike_guard.check_gradients=true"}), dir.path(), {}, 120);
  EXPECT_EQ(amp.exit_code, 0) << amp.err;
}
