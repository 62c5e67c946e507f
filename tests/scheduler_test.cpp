// Learning-rate schedulers and lr_monitor: the closed forms against numbers PyTorch produced, the
// rates the engine really used (metrics.csv via lr_monitor) against the closed forms, and resume.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <ember/support/lr_schedule.h>
#include <ember/support/weight_averaging.h>

#include "checkpoint/checkpoint_io.h"
#include "checkpoint_support.h"
#include "support.h"

using namespace ember::test;
using namespace ember::support;
namespace fs = std::filesystem;

namespace {

// Reference values: printed by PyTorch 2.11's own schedulers with
//   ~/.cache/ember/torch-2.11.0/bin/python tests/reference/lr_schedules.py
// (the rate/momentum in the optimizer before step t = 0, 1, ..., the last one after the final
// step).
void expect_all_near(const std::vector<double>& expected, const std::function<double(int64_t)>& f, const char* what) {
  for (size_t t = 0; t < expected.size(); ++t)
    EXPECT_NEAR(f(static_cast<int64_t>(t)), expected[t], 1e-12 + 1e-9 * std::abs(expected[t])) << what << " at t = " << t;
}

}  // namespace

TEST(SchedulerFormula, CyclicTriangularMatchesPyTorch) {
  CyclicParams p;
  p.base_lr = 0.001;
  p.max_lr = 0.006;
  p.step_size_up = 5;
  p.step_size_down = 3;
  expect_all_near({0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.004333333333333333, 0.0026666666666666666, 0.001, 0.002, 0.003,
                   0.004, 0.005, 0.006, 0.004333333333333333, 0.0026666666666666666, 0.001, 0.002, 0.003, 0.004, 0.005},
                  [&](int64_t t) { return cyclic_lr(p, t); }, "lr");
  expect_all_near({0.9, 0.88, 0.86, 0.8400000000000001, 0.8200000000000001, 0.8, 0.8333333333333334, 0.8666666666666667, 0.9, 0.88,
                   0.86, 0.8400000000000001, 0.8200000000000001, 0.8, 0.8333333333333334, 0.8666666666666667, 0.9, 0.88, 0.86,
                   0.8400000000000001},
                  [&](int64_t t) { return cyclic_momentum(p, t); }, "momentum");
}

TEST(SchedulerFormula, CyclicTriangular2AndExpRangeMatchPyTorch) {
  CyclicParams p;
  p.base_lr = 0.001;
  p.max_lr = 0.006;
  p.step_size_up = p.step_size_down = 4;
  p.mode = CyclicMode::triangular2;
  expect_all_near({0.001, 0.0022500000000000003, 0.0035, 0.00475, 0.006, 0.00475, 0.0035, 0.0022500000000000003, 0.001,
                   0.0016250000000000001, 0.0022500000000000003, 0.002875, 0.0035, 0.002875, 0.0022500000000000003,
                   0.0016250000000000001, 0.001, 0.0013125, 0.0016250000000000001, 0.0019375},
                  [&](int64_t t) { return cyclic_lr(p, t); }, "triangular2 lr");
  expect_all_near({0.9, 0.875, 0.8500000000000001, 0.8250000000000001, 0.8, 0.8250000000000001, 0.8500000000000001, 0.875, 0.9,
                   0.8875000000000001, 0.875, 0.8625, 0.8500000000000001, 0.8625, 0.875, 0.8875000000000001, 0.9, 0.89375,
                   0.8875000000000001, 0.88125},
                  [&](int64_t t) { return cyclic_momentum(p, t); }, "triangular2 beta1");
  p.mode = CyclicMode::exp_range;
  p.step_size_up = p.step_size_down = 3;
  p.gamma = 0.9;
  expect_all_near({0.001, 0.0025000000000000005, 0.0036999999999999997, 0.004645000000000001, 0.003187000000000001,
                   0.0019841499999999996, 0.001, 0.0017971615000000017, 0.0024348906999999993, 0.0029371024450000004,
                   0.0021622614669999994, 0.001523017660150001, 0.001, 0.0014236443047214997},
                  [&](int64_t t) { return cyclic_lr(p, t); }, "exp_range lr");
}

TEST(SchedulerFormula, OneCycleMatchesPyTorch) {
  OneCycleParams p;
  p.max_lr = 0.1;
  p.total_steps = 20;
  auto lr = [&](int64_t t) { return one_cycle(p, t).lr; };
  auto m = [&](int64_t t) { return one_cycle(p, t).momentum; };
  expect_all_near({0.0040000000000000036, 0.013167184270002533, 0.037167184270002526, 0.06683281572999747, 0.09083281572999748, 0.1,
                   0.09874640062350874, 0.09504846320134738, 0.089091617757105, 0.0811745653949763, 0.07169430017913009,
                   0.06112620219362893, 0.0500002, 0.03887419780637107, 0.028306099820869922, 0.0188258346050237,
                   0.010908782242895003, 0.004951936798652629, 0.0012539993764912555, 4e-07, 0.0012539993764912555},
                  lr, "cos lr");
  expect_all_near({0.95, 0.9404508497187474, 0.9154508497187474, 0.8845491502812526, 0.8595491502812526, 0.85, 0.8512536043909088,
                   0.854951556604879, 0.8609084258765984, 0.8688255099070633, 0.878305813044122, 0.8888739533021842,
                   0.8999999999999999, 0.9111260466978157, 0.9216941869558779, 0.9311744900929366, 0.9390915741234015,
                   0.945048443395121, 0.9487463956090911, 0.95, 0.9487463956090911},
                  m, "cos momentum");
  p.anneal_strategy = Anneal::linear;
  p.pct_start = 0.25;
  expect_all_near({0.004, 0.028, 0.052000000000000005, 0.07600000000000001, 0.1, 0.09333336, 0.08666672, 0.08000008, 0.07333344,
                   0.0666668, 0.06000016, 0.05333352, 0.04666688, 0.040000240000000006, 0.033333600000000005,
                   0.026666960000000003, 0.020000319999999988, 0.01333368, 0.006667039999999999, 3.999999999976245e-07,
                   -0.006666240000000004},
                  lr, "linear lr");
  p = OneCycleParams{};
  p.max_lr = 0.1;
  p.total_steps = 20;
  p.three_phase = true;
  p.div_factor = 10;
  p.final_div_factor = 100;
  expect_all_near({0.009999999999999995, 0.018594235253127367, 0.041094235253127366, 0.06890576474687263, 0.09140576474687263, 0.1,
                   0.09140576474687263, 0.06890576474687264, 0.04109423525312737, 0.01859423525312737, 0.01,
                   0.009701478472890247, 0.00884191999343894, 0.007525000000000001, 0.005909558479451306,
                   0.004190441520548696, 0.0025750000000000013, 0.0012580800065610596, 0.00039852152710975384, 0.0001,
                   0.0003985215271097533},
                  lr, "three-phase lr");
  EXPECT_THROW(one_cycle(p, 21), std::out_of_range);  // PyTorch: "Tried to step 21 times"
}

// linear_lr: transformers' get_linear_schedule_with_warmup (its defaults: from 0, down to 0), and
// other factors as torch's SequentialLR of two LinearLRs (values both printed).
TEST(SchedulerFormula, LinearWarmupDecayMatchesTransformersAndPyTorch) {
  LinearParams p;
  p.base_lr = 0.1;
  p.warmup = 4;
  p.total = 20;
  expect_all_near({0.0, 0.025, 0.05, 0.07500000000000001, 0.1, 0.09375, 0.08750000000000001, 0.08125, 0.07500000000000001, 0.06875, 0.0625,
                   0.05625, 0.05, 0.043750000000000004, 0.037500000000000006, 0.03125, 0.025, 0.018750000000000003, 0.0125, 0.00625, 0.0,
                   0.0, 0.0},
                  [&](int64_t t) { return linear_warmup_decay(p, t); }, "get_linear_schedule_with_warmup(opt, 4, 20)");
  p.warmup = 0;
  p.total = 10;
  expect_all_near({0.1, 0.09000000000000001, 0.08000000000000002, 0.06999999999999999, 0.06, 0.05, 0.04000000000000001, 0.03,
                   0.020000000000000004, 0.010000000000000002, 0.0},
                  [&](int64_t t) { return linear_warmup_decay(p, t); }, "get_linear_schedule_with_warmup(opt, 0, 10)");
  p = LinearParams{.base_lr = 0.2, .warmup = 3, .total = 10, .warmup_start_factor = 0.25, .end_factor = 0.1};
  expect_all_near({0.05, 0.1, 0.15000000000000002, 0.2, 0.1742857142857143, 0.14857142857142858, 0.12285714285714286, 0.09714285714285714,
                   0.07142857142857144, 0.04571428571428572, 0.019999999999999997, 0.019999999999999997},
                  [&](int64_t t) { return linear_warmup_decay(p, t); }, "SequentialLR(LinearLR(0.25, 1, 3), LinearLR(1, 0.1, 7))");
}

TEST(SchedulerFormula, CosineWithWarmupStepAndSwalrMatchPyTorch) {
  CosineParams c;
  c.base_lr = 0.1;
  c.eta_min = 0.001;
  c.warmup = 4;
  c.total = 20;
  expect_all_near({0.03333333333333333, 0.05, 0.06666666666666668, 0.08333333333333334, 0.1, 0.09904887137995991,
                   0.0962320368593087, 0.09165774580897601, 0.0855017856687341, 0.07800072653447031, 0.06944282990207194,
                   0.060156970939798354, 0.050499999999999996, 0.04084302906020165, 0.03155717009792806,
                   0.022999273465529702, 0.0154982143312659, 0.009342254191024003, 0.004767963140691305,
                   0.0019511286200400934, 0.001},
                  [&](int64_t t) { return cosine_warmup(c, t); }, "warmup + cosine");
  c = CosineParams{};
  c.base_lr = 0.1;
  c.total = 10;
  expect_all_near({0.1, 0.09755282581475769, 0.09045084971874738, 0.07938926261462367, 0.06545084971874739, 0.05000000000000001,
                   0.03454915028125264, 0.020610737385376353, 0.009549150281252635, 0.002447174185242324, 0.0},
                  [&](int64_t t) { return cosine_warmup(c, t); }, "cosine");
  EXPECT_EQ(cosine_warmup(c, 15), 0.0);  // stays at eta_min after the schedule
  expect_all_near({0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025, 0.025, 0.0125, 0.0125},
                  [&](int64_t t) { return step_lr(0.1, 3, 0.5, t); }, "step");
  using ember::support::AnnealStrategy;
  expect_all_near({0.05, 0.04000000000000001, 0.020000000000000007, 0.01, 0.01, 0.01, 0.01},
                  [&](int64_t e) { return ember::support::swalr(0.05, 0.01, e, 3, AnnealStrategy::cos); }, "SWALR cos");
  expect_all_near({0.05, 0.04000000000000001, 0.030000000000000006, 0.020000000000000004, 0.01, 0.01, 0.01},
                  [&](int64_t e) { return ember::support::swalr(0.05, 0.01, e, 4, AnnealStrategy::linear); }, "SWALR linear");
  expect_all_near({0.01, 0.01, 0.01, 0.01, 0.01},
                  [&](int64_t e) { return ember::support::swalr(0.05, 0.01, e, 0, AnnealStrategy::cos); }, "SWALR at once");
}

TEST(SchedulerFormula, ReduceOnPlateauMatchesPyTorch) {
  auto run = [](const PlateauParams& p, const std::vector<double>& metrics) {
    PlateauState s = PlateauState::initial(p);
    std::vector<double> lrs{0.1}, out{0.1};
    for (double m : metrics) {
      plateau_step(p, s, m, lrs);
      out.push_back(lrs[0]);
    }
    return out;
  };
  PlateauParams p;
  p.factor = 0.5;
  p.patience = 2;
  p.threshold = 0.01;
  p.cooldown = 1;
  p.min_lrs = {0.02};
  auto got = run(p, {1.0, 0.9, 0.895, 0.894, 0.893, 0.7, 0.71, 0.72, 0.73, 0.74, 0.75, 0.76, 0.5, 0.51, 0.52, 0.53});
  expect_all_near({0.1, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05, 0.025, 0.025, 0.025, 0.025, 0.025, 0.025, 0.025, 0.02},
                  [&](int64_t t) { return got[static_cast<size_t>(t)]; }, "min rel cooldown");
  PlateauParams q;
  q.mode_max = true;
  q.factor = 0.3;
  q.patience = 1;
  q.threshold = 0.02;
  q.threshold_abs = true;
  got = run(q, {0.1, 0.2, 0.25, 0.26, 0.2, 0.3, 0.3, 0.3, 0.3, 0.305, 0.31});
  expect_all_near({0.1, 0.1, 0.1, 0.1, 0.1, 0.03, 0.03, 0.03, 0.009, 0.009, 0.0026999999999999997, 0.0026999999999999997},
                  [&](int64_t t) { return got[static_cast<size_t>(t)]; }, "max abs");
}

// ---- End to end: the rates the engine used ------------------------------------------------------

namespace {

// 64 samples in batches of 16: 4 batches per epoch. No dropout: runs are exactly repeatable.
const char* kRun = R"(
[trainer]
max_epochs = 4
log_every_n_steps = 1
enable_progress_bar = false
enable_model_summary = false
num_sanity_val_steps = 0
[model]
name = "mlp"
input_size = 16
hidden = [8]
num_classes = 4
[data]
name = "synthetic"
shape = [16]
num_classes = 4
num_train = 64
num_val = 32
num_test = 0
batch_size = 16
)";
// Unless a test gives its own [optimizer] table.
const char* kSgd = "\n[optimizer]\nname = \"sgd\"\nlr = 0.1\nmomentum = 0.9\n";

struct Run {
  ProcessResult result;
  fs::path dir;  // runs/run/version_0
};

Run train(const TempDir& dir, const std::string& extra, const std::string& plugins, std::vector<std::string> more = {}) {
  const bool own_optimizer = extra.find("[optimizer]") != std::string::npos;
  write_file(dir / "run.toml", std::string(kRun) + (own_optimizer ? "" : kSgd) + extra);
  std::vector<std::string> args = {"run.toml", "--plugin-path", test_plugin_dir("good").string(), "--plugins", plugins};
  args.insert(args.end(), more.begin(), more.end());
  Run r{run_engine(args, dir.path()), dir / "runs/run/version_0"};
  return r;
}

// metric name -> (step -> value) from metrics.csv.
std::map<int64_t, double> column(const fs::path& run_dir, const std::string& name) {
  std::map<int64_t, double> out;
  for (const auto& row : read_csv(run_dir / "metrics.csv")) {
    auto it = row.find(name);
    if (it != row.end() && !it->second.empty()) out[std::stoll(row.at("step"))] = std::stod(it->second);
  }
  return out;
}

// 4 epochs straight vs 2 epochs, then --resume last to 4: the same weights, bit for bit.
void expect_resume_exact(const std::string& extra, const std::string& plugins) {
  TempDir full("sched"), split("sched");
  auto a = train(full, extra, plugins);
  ASSERT_EQ(a.result.exit_code, 0) << a.result.err;
  auto b = train(split, extra, plugins, {"--set", "trainer.max_epochs=2"});
  ASSERT_EQ(b.result.exit_code, 0) << b.result.err;
  auto c = train(split, extra, plugins, {"--resume", "last"});
  ASSERT_EQ(c.result.exit_code, 0) << c.result.err;
  auto wa = weights(a.dir / "checkpoints/last.ckpt"), wc = weights(c.dir / "checkpoints/last.ckpt");
  ASSERT_EQ(wa.size(), wc.size());
  for (const auto& [k, v] : wa) EXPECT_TRUE(at::equal(v, wc.at(k))) << plugins << ": " << k << " differs after resume";
  // And the rates logged after the resume are those of the uninterrupted run.
  auto la = column(a.dir, "lr-SGD"), lc = column(c.dir, "lr-SGD");
  for (const auto& [step, lr] : la) {
    ASSERT_TRUE(lc.count(step)) << plugins << ": no lr at step " << step << " after resume";
    EXPECT_DOUBLE_EQ(lc.at(step), lr) << plugins << " at step " << step;
  }
}

}  // namespace

TEST(Scheduler, CyclicLrDrivesEveryOptimizerStepAndMomentum) {
  TempDir dir("sched");
  // accumulate 2: 2 optimizer steps per epoch, 8 in all; the schedule counts optimizer steps.
  auto r = train(dir, R"(
[cyclic_lr]
base_lr = 0.001
max_lr = 0.006
step_size_up = 3
step_size_down = 2
[lr_monitor]
log_momentum = true
)",
                 "cyclic_lr,lr_monitor", {"--set", "trainer.accumulate_grad_batches=2"});
  ASSERT_EQ(r.result.exit_code, 0) << r.result.err;
  CyclicParams p;
  p.base_lr = 0.001;
  p.max_lr = 0.006;
  p.step_size_up = 3;
  p.step_size_down = 2;
  auto lr = column(r.dir, "lr-SGD"), mom = column(r.dir, "lr-SGD-momentum");
  ASSERT_EQ(lr.size(), 8u);
  for (const auto& [step, v] : lr) {
    EXPECT_NEAR(v, cyclic_lr(p, step), 1e-12) << "step " << step;
    EXPECT_NEAR(mom.at(step), cyclic_momentum(p, step), 1e-12) << "step " << step;
  }
}

TEST(Scheduler, OneCycleSpansTheEstimatedStepsAndStartsBeforeTheFirstStep) {
  TempDir dir("sched");
  auto r = train(dir, "\n[one_cycle]\nmax_lr = 0.5\n[optimizer]\nname = \"adam\"\nlr = 0.001\n", "one_cycle,lr_monitor",
                 {"--set", "lr_monitor.log_momentum=true"});
  ASSERT_EQ(r.result.exit_code, 0) << r.result.err;
  OneCycleParams p;
  p.max_lr = 0.5;
  p.total_steps = 16;  // 4 epochs x 4 batches
  auto lr = column(r.dir, "lr-Adam"), beta1 = column(r.dir, "lr-Adam-momentum");
  ASSERT_EQ(lr.size(), 16u);
  EXPECT_NEAR(lr.at(0), 0.5 / 25, 1e-12);  // step 0 already used the schedule
  for (const auto& [step, v] : lr) {
    EXPECT_NEAR(v, one_cycle(p, step).lr, 1e-12) << "step " << step;
    EXPECT_NEAR(beta1.at(step), one_cycle(p, step).momentum, 1e-12) << "step " << step;
  }
}

// A rate configured for a scheduler (one_cycle's max_lr, cosine's base_lr) is the first param
// group's, and so is the rate lr_find sets; a group that trains at another rate
// (optimizer.backbone at lr x 0.1) keeps its ratio.
TEST(Scheduler, ConfiguredRatesAreTheFirstGroupsAndOtherGroupsKeepTheirRatio) {
  const std::string backbone = "\n[optimizer]\nname = \"adam\"\nlr = 0.001\nbackbone = [\"fc1\"]\nbackbone_lr_scale = 0.1\n";
  TempDir dir("sched"), dir2("sched");
  auto r = train(dir, "\n[one_cycle]\nmax_lr = 0.5\n" + backbone, "one_cycle,lr_monitor");
  ASSERT_EQ(r.result.exit_code, 0) << r.result.err;
  OneCycleParams p;
  p.max_lr = 0.5;
  p.total_steps = 16;
  auto head = column(r.dir, "lr-Adam/pg1"), fc1 = column(r.dir, "lr-Adam/pg2");
  ASSERT_EQ(head.size(), 16u);
  ASSERT_EQ(fc1.size(), 16u);
  for (const auto& [step, v] : head) {
    EXPECT_NEAR(v, one_cycle(p, step).lr, 1e-12) << "step " << step;
    EXPECT_NEAR(fc1.at(step), 0.1 * one_cycle(p, step).lr, 1e-12) << "step " << step;
  }
  auto c = train(dir2, "\n[cosine]\nbase_lr = 0.2\n" + backbone, "cosine,lr_monitor");
  ASSERT_EQ(c.result.exit_code, 0) << c.result.err;
  head = column(c.dir, "lr-Adam/pg1"), fc1 = column(c.dir, "lr-Adam/pg2");
  ASSERT_EQ(head.size(), 16u);
  EXPECT_NEAR(head.at(0), 0.2, 1e-12);
  for (const auto& [step, v] : head) EXPECT_NEAR(fc1.at(step), 0.1 * v, 1e-12) << "step " << step;
  // lr_find sweeps and sets the first group's rate; the backbone keeps a tenth of it.
  TempDir dir3("sched");
  auto f = train(dir3, "\n[lr_find]\nnum_training_steps = 30\nearly_stop_threshold = 0\n" + backbone, "lr_find,lr_monitor");
  ASSERT_EQ(f.result.exit_code, 0) << f.result.err;
  ASSERT_NE(f.result.err.find("lr_find: learning rate set to "), std::string::npos) << f.result.err;
  head = column(f.dir, "lr-Adam/pg1"), fc1 = column(f.dir, "lr-Adam/pg2");
  ASSERT_EQ(head.size(), 16u);
  EXPECT_NE(head.at(0), 0.001) << "the suggestion is in use";
  for (const auto& [step, v] : head) EXPECT_NEAR(fc1.at(step), 0.1 * v, 1e-15) << "step " << step;
}

TEST(Scheduler, CosineWarmupPerEpochStepLrPerEpochAndLinearPerStep) {
  TempDir dir("sched"), dir2("sched");
  auto r = train(dir, "\n[cosine]\ninterval = \"epoch\"\nwarmup = 1\neta_min = 0.01\n[lr_monitor]\nlogging_interval = \"epoch\"\n",
                 "cosine,lr_monitor");
  ASSERT_EQ(r.result.exit_code, 0) << r.result.err;
  CosineParams c;
  c.base_lr = 0.1;
  c.eta_min = 0.01;
  c.warmup = 1;
  c.total = 4;
  auto lr = column(r.dir, "lr-SGD");
  ASSERT_EQ(lr.size(), 4u);  // one per epoch, at each epoch's first step (4 batches per epoch)
  int64_t epoch = 0;
  for (const auto& [step, v] : lr) {
    EXPECT_EQ(step, std::max<int64_t>(0, epoch * 4 - 1));  // logged at the index of the last finished step
    EXPECT_NEAR(v, cosine_warmup(c, epoch), 1e-12) << "epoch " << epoch;
    ++epoch;
  }
  auto s = train(dir2, "\n[step_lr]\nstep_size = 2\ngamma = 0.5\n", "step_lr,lr_monitor");
  ASSERT_EQ(s.result.exit_code, 0) << s.result.err;
  for (const auto& [step, v] : column(s.dir, "lr-SGD")) EXPECT_NEAR(v, step_lr(0.1, 2, 0.5, step / 4), 1e-12) << "step " << step;
  // linear_lr per step over the whole run (4 epochs x 4 batches, the length read from the run):
  // the first step at 0 as in transformers, the rate the step used logged at its index.
  TempDir dir3("sched");
  auto l = train(dir3, "\n[linear_lr]\nwarmup = 3\n", "linear_lr,lr_monitor");
  ASSERT_EQ(l.result.exit_code, 0) << l.result.err;
  LinearParams p{.base_lr = 0.1, .warmup = 3, .total = 16};
  const auto linear = column(l.dir, "lr-SGD");
  ASSERT_EQ(linear.size(), 16u);
  for (const auto& [step, v] : linear) EXPECT_NEAR(v, linear_warmup_decay(p, step), 1e-12) << "step " << step;
  TempDir dir4("sched");
  auto too_long = train(dir4, "\n[linear_lr]\nwarmup = 16\n", "linear_lr");
  EXPECT_NE(too_long.result.exit_code, 0);
  EXPECT_NE(too_long.result.err.find("[linear_lr] warmup = 16 is not shorter than the run (16 steps): shorten the warmup or set total"),
            std::string::npos) << too_long.result.err;
}

TEST(Scheduler, ReduceOnPlateauFollowsTheMonitoredMetric) {
  TempDir dir("sched");
  // hook_recorder logs `score` at each epoch end (named first: it runs before reduce_on_plateau).
  const std::string extra = R"(
[hook_recorder]
path = "hooks.txt"
scripted_values = [1.0, 0.5, 0.6, 0.7, 0.8, 0.9]
[reduce_on_plateau]
monitor = "score"
patience = 1
factor = 0.5
)";
  auto r = train(dir, extra, "hook_recorder,reduce_on_plateau,lr_monitor", {"--set", "trainer.max_epochs=6"});
  ASSERT_EQ(r.result.exit_code, 0) << r.result.err;
  PlateauParams p;
  p.patience = 1;
  p.factor = 0.5;
  PlateauState st = PlateauState::initial(p);
  std::vector<double> lrs{0.1}, per_epoch;
  for (double m : {1.0, 0.5, 0.6, 0.7, 0.8, 0.9}) {
    per_epoch.push_back(lrs[0]);
    plateau_step(p, st, m, lrs);
  }
  EXPECT_NE(per_epoch.back(), 0.1);  // it did reduce
  for (const auto& [step, v] : column(r.dir, "lr-SGD")) EXPECT_NEAR(v, per_epoch[static_cast<size_t>(step / 4)], 1e-12) << "step " << step;
  EXPECT_NE(r.result.err.find("did not improve"), std::string::npos) << r.result.err;

  // A monitor that is never logged: one line naming it and what is available.
  TempDir bad("sched");
  auto e = train(bad, "\n[reduce_on_plateau]\nmonitor = \"val_los\"\n", "reduce_on_plateau");
  EXPECT_EQ(e.result.exit_code, 1) << e.result.err;
  EXPECT_NE(e.result.err.find("monitor 'val_los' was not logged (available: "), std::string::npos) << e.result.err;
  EXPECT_NE(e.result.err.find("val_loss"), std::string::npos) << e.result.err;
}

TEST(Scheduler, BadSettingsAreOneClearLine) {
  TempDir dir("sched");
  auto r = train(dir, "\n[cyclic_lr]\nbase_lr = 0.01\n", "cyclic_lr");
  EXPECT_NE(r.result.exit_code, 0) << r.result.err;
  EXPECT_NE(r.result.err.find("[cyclic_lr] max_lr is required"), std::string::npos) << r.result.err;
  TempDir dir2("sched");
  r = train(dir2, "\n[cyclic_lr]\nmax_lr = 0.01\n[optimizer]\nname = \"adagrad\"\nlr = 0.01\n", "cyclic_lr");
  EXPECT_NE(r.result.exit_code, 0);
  EXPECT_NE(r.result.err.find("has no momentum"), std::string::npos) << r.result.err;
  EXPECT_NE(r.result.err.find("cycle_momentum = false"), std::string::npos) << r.result.err;
}

TEST(Scheduler, EveryScheduleResumesExactly) {
  expect_resume_exact("\n[cyclic_lr]\nmax_lr = 0.3\nstep_size_up = 3\n", "cyclic_lr,lr_monitor");
  expect_resume_exact("\n[one_cycle]\nmax_lr = 0.3\ntotal_steps = 16\n", "one_cycle,lr_monitor");
  expect_resume_exact("\n[cosine]\nwarmup = 3\ntotal = 16\n", "cosine,lr_monitor");
  expect_resume_exact("\n[linear_lr]\nwarmup = 3\nend_factor = 0.1\ntotal = 16\n", "linear_lr,lr_monitor");
  expect_resume_exact("\n[step_lr]\nstep_size = 5\ninterval = \"step\"\n", "step_lr,lr_monitor");
  expect_resume_exact("\n[hook_recorder]\nscripted_values = [1.0, 0.9, 0.95, 0.97]\n[reduce_on_plateau]\nmonitor = \"score\"\npatience = 0\n",
                      "hook_recorder,reduce_on_plateau,lr_monitor");
}
