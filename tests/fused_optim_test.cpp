// Fused optimizers (ember/fused_optim.h, optimizer.fused): N steps of FusedAdam / FusedAdamW /
// FusedSGD compute what LibTorch's plain Adam / AdamW / SGD compute from the same start (the
// parameters and every state field), checkpoints move between the two both ways and continue
// identically, and the engine trains the same weights with optimizer.fused = true and false,
// under single_device and under the sharded strategy (which rebinds the optimizer's parameters).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ember/support/fused_optim.h>
#include <torch/serialize.h>

#include <functional>
#include <memory>
#include <sstream>

#include "checkpoint_support.h"
#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {

using OptimizerPtr = std::shared_ptr<torch::optim::Optimizer>;
using Factory = std::function<OptimizerPtr(const std::vector<at::Tensor>&)>;

// Parameters of a few shapes and two dtypes (the kernels run once per device and dtype).
std::vector<at::Tensor> make_params() {
  auto g = at::make_generator<at::CPUGeneratorImpl>(7);
  std::vector<at::Tensor> ps = {at::randn({17, 5}, g), at::randn({5}, g), at::randn({3, 4, 2}, g),
                                at::randn({9}, g).to(at::kDouble)};
  for (auto& p : ps) p.requires_grad_(true);
  return ps;
}

std::vector<at::Tensor> clone_params(const std::vector<at::Tensor>& ps) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

// Deterministic gradients for step `k`; parameter 2 gets none on step 0 (so it starts its
// state one step later than the others).
void set_grads(std::vector<at::Tensor>& ps, int k) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(1000 + k);
  for (size_t i = 0; i < ps.size(); ++i) {
    auto grad = at::randn(ps[i].sizes(), g).to(ps[i].scalar_type());
    if (k == 0 && i == 2) {
      ps[i].mutable_grad() = at::Tensor();
      continue;
    }
    ps[i].mutable_grad() = grad;
  }
}

void run_steps(torch::optim::Optimizer& opt, std::vector<at::Tensor>& ps, int from, int to) {
  for (int k = from; k < to; ++k) {
    set_grads(ps, k);
    opt.step();
  }
}

// max |a - b| / (1 + max |b|) over the tensors.
double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  auto ad = a.detach().to(at::kDouble), bd = b.detach().to(at::kDouble);
  return (ad - bd).abs().max().item<double>() / (1.0 + bd.abs().max().item<double>());
}

// Every per-element state field, in a fixed order; step counts compared exactly.
std::vector<at::Tensor> state_tensors(torch::optim::Optimizer& opt, const at::Tensor& p, int64_t* step) {
  auto it = opt.state().find(p.unsafeGetTensorImpl());
  if (it == opt.state().end()) return {};
  auto& st = *it->second;
  if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(&st)) {
    *step = a->step();
    return {a->exp_avg(), a->exp_avg_sq(), a->max_exp_avg_sq()};
  }
  if (auto* w = dynamic_cast<torch::optim::AdamWParamState*>(&st)) {
    *step = w->step();
    return {w->exp_avg(), w->exp_avg_sq(), w->max_exp_avg_sq()};
  }
  if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(&st)) return {s->momentum_buffer()};
  ADD_FAILURE() << "unexpected state type";
  return {};
}

constexpr double kTol = 2e-6;

void expect_same(torch::optim::Optimizer& a, const std::vector<at::Tensor>& pa, torch::optim::Optimizer& b,
                 const std::vector<at::Tensor>& pb) {
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_LE(rel_diff(pa[i], pb[i]), kTol) << "parameter " << i;
    int64_t sa = -1, sb = -1;
    auto ta = state_tensors(a, pa[i], &sa), tb = state_tensors(b, pb[i], &sb);
    ASSERT_EQ(ta.size(), tb.size()) << "parameter " << i;
    EXPECT_EQ(sa, sb) << "step of parameter " << i;
    for (size_t j = 0; j < ta.size(); ++j) {
      ASSERT_EQ(ta[j].defined(), tb[j].defined()) << "parameter " << i << " field " << j;
      if (ta[j].defined()) EXPECT_LE(rel_diff(ta[j], tb[j]), kTol) << "parameter " << i << " field " << j;
    }
  }
}

struct Case {
  const char* name;
  Factory fused, plain;
};

std::vector<Case> cases() {
  using namespace torch::optim;
  auto adam = [] { return AdamOptions(0.01).betas({0.8, 0.95}).eps(1e-7); };
  auto adamw = [] { return AdamWOptions(0.01).weight_decay(0.05); };
  return {
      {"adam", [=](auto& p) { return std::make_shared<ember::optim::FusedAdam>(p, adam()); },
       [=](auto& p) { return std::make_shared<Adam>(p, adam()); }},
      {"adam_wd_amsgrad", [=](auto& p) { return std::make_shared<ember::optim::FusedAdam>(p, adam().weight_decay(0.1).amsgrad(true)); },
       [=](auto& p) { return std::make_shared<Adam>(p, adam().weight_decay(0.1).amsgrad(true)); }},
      {"adamw", [=](auto& p) { return std::make_shared<ember::optim::FusedAdamW>(p, adamw()); },
       [=](auto& p) { return std::make_shared<AdamW>(p, adamw()); }},
      {"adamw_amsgrad", [=](auto& p) { return std::make_shared<ember::optim::FusedAdamW>(p, adamw().amsgrad(true)); },
       [=](auto& p) { return std::make_shared<AdamW>(p, adamw().amsgrad(true)); }},
      {"sgd", [](auto& p) { return std::make_shared<ember::optim::FusedSGD>(p, SGDOptions(0.05)); },
       [](auto& p) { return std::make_shared<SGD>(p, SGDOptions(0.05)); }},
      {"sgd_momentum_dampening_wd",
       [](auto& p) { return std::make_shared<ember::optim::FusedSGD>(p, SGDOptions(0.05).momentum(0.9).dampening(0.3).weight_decay(0.01)); },
       [](auto& p) { return std::make_shared<SGD>(p, SGDOptions(0.05).momentum(0.9).dampening(0.3).weight_decay(0.01)); }},
      {"sgd_nesterov_wd",
       [](auto& p) { return std::make_shared<ember::optim::FusedSGD>(p, SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(0.01)); },
       [](auto& p) { return std::make_shared<SGD>(p, SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(0.01)); }},
  };
}

class FusedOptim : public ::testing::TestWithParam<Case> {};

}  // namespace

TEST_P(FusedOptim, StepsMatchThePlainOptimizer) {
  const auto& c = GetParam();
  auto start = make_params();
  auto pf = clone_params(start), pp = clone_params(start);
  auto fused = c.fused(pf), plain = c.plain(pp);
  run_steps(*fused, pf, 0, 25);
  run_steps(*plain, pp, 0, 25);
  expect_same(*fused, pf, *plain, pp);
  // It really stepped (guards against comparing two untouched sets).
  EXPECT_GT(rel_diff(pf[0], start[0]), 1e-3);
}

TEST_P(FusedOptim, CheckpointsMoveBetweenFusedAndPlainBothWays) {
  const auto& c = GetParam();
  for (bool fused_first : {true, false}) {
    SCOPED_TRACE(fused_first ? "fused -> plain" : "plain -> fused");
    auto start = make_params();
    // The reference: one optimizer kind for all 10 steps.
    auto pr = clone_params(start);
    auto ref = (fused_first ? c.plain : c.fused)(pr);
    run_steps(*ref, pr, 0, 10);
    // 4 steps with one kind, save, load into the other kind over a copy of the parameters, 6 more.
    auto p1 = clone_params(start);
    auto first = (fused_first ? c.fused : c.plain)(p1);
    run_steps(*first, p1, 0, 4);
    std::stringstream buf;
    torch::save(*first, buf);
    auto p2 = clone_params(p1);
    auto second = (fused_first ? c.plain : c.fused)(p2);
    torch::load(*second, buf);
    run_steps(*second, p2, 4, 10);
    expect_same(*second, p2, *ref, pr);
  }
}

INSTANTIATE_TEST_SUITE_P(Fused, FusedOptim, ::testing::ValuesIn(cases()), [](const auto& info) { return std::string(info.param.name); });

// A tensor the kernels do not take (non-contiguous) sends the step down the plain path, with the
// same result.
TEST(FusedOptimFallback, NonContiguousParameterStepsLikeThePlainOptimizer) {
  auto base = at::randn({6, 4}).t();  // non-contiguous view
  auto a = base.detach().clone(at::MemoryFormat::Preserve);
  ASSERT_FALSE(a.is_contiguous());
  auto b = a.clone(at::MemoryFormat::Preserve);
  a.requires_grad_(true);
  b.requires_grad_(true);
  ember::optim::FusedAdamW fused({a}, torch::optim::AdamWOptions(0.01));
  torch::optim::AdamW plain({b}, torch::optim::AdamWOptions(0.01));
  for (int k = 0; k < 5; ++k) {
    auto g = at::randn({4, 6});
    a.mutable_grad() = g.clone();
    b.mutable_grad() = g.clone();
    fused.step();
    plain.step();
  }
  EXPECT_LE(rel_diff(a, b), kTol);
}

// ----- the engine -----

namespace {

// Global batch 24 (2 sharded ranks x 12 see the same samples per step); 23 and 17 make uneven shards.
const std::string kRun = synthetic_mlp_toml({.accelerator = "cpu", .hidden = "[23, 17]", .num_train = 72,
                                             .num_val = 24, .batch_size = 24}) +
                         "[optimizer]\n";

void train(const TempDir& dir, const std::string& optimizer, std::vector<std::string> extra) {
  write_file(dir / "run.toml", kRun + optimizer);
  std::vector<std::string> args = {"run.toml"};
  args.insert(args.end(), extra.begin(), extra.end());
  run_engine_ok(dir, args);
}

}  // namespace

TEST(FusedOptimEngine, FusedAndPlainTrainTheSameWeights) {
  for (const char* opt : {"name = \"adamw\"\nlr = 0.01\nweight_decay = 0.1\namsgrad = true\n",
                          "name = \"sgd\"\nlr = 0.1\nmomentum = 0.9\nnesterov = true\nweight_decay = 0.001\n"}) {
    SCOPED_TRACE(opt);
    TempDir fused("fused_optim"), plain("fused_optim");
    train(fused, opt, {"--set", "optimizer.fused=true"});
    train(plain, opt, {"--set", "optimizer.fused=false"});
    const double d = max_weight_difference(last_checkpoint(fused), last_checkpoint(plain));
    EXPECT_LE(d, 1e-5);
    // The checkpoint of the fused run resumes under the plain optimizer (and trains on).
    TempDir resumed("fused_optim");
    fs::copy_file(last_checkpoint(fused), resumed / "fused.ckpt");
    train(resumed, opt, {"--set", "optimizer.fused=false", "--set", "trainer.max_epochs=3", "--resume", "fused.ckpt"});
    TempDir three("fused_optim");
    train(three, opt, {"--set", "optimizer.fused=true", "--set", "trainer.max_epochs=3"});
    EXPECT_LE(max_weight_difference(last_checkpoint(resumed), last_checkpoint(three)), 1e-5);
  }
}

TEST(FusedOptimEngine, ShardedFusedMatchesSingleDevicePlain) {
  EMBER_SKIP_WITHOUT_MPI();
  const char* opt = "name = \"adam\"\nlr = 0.01\nweight_decay = 0.01\n";
  TempDir single("fused_optim");
  train(single, opt, {"--set", "optimizer.fused=false"});
  for (int stage : {1, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    TempDir dir("fused_optim");
    train(dir, opt,
          {"--plugins", "sharded", "--set", "sharded.timeout=30.0", "--set", "trainer.devices=2", "--set",
           "sharded.stage=" + std::to_string(stage), "--set", "data.batch_size=12", "--set", "optimizer.fused=true"});
    EXPECT_LE(max_weight_difference(last_checkpoint(single), last_checkpoint(dir)), 1e-5);
  }
}

TEST(FusedOptimEngine, BadFusedValueIsAOneLineConfigError) {
  TempDir dir("fused_optim");
  write_file(dir / "run.toml", kRun + "name = \"adam\"\nfused = \"yes\"\n");
  auto r = run_engine({"run.toml"}, dir.path(), {}, 60);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("optimizer.fused"), std::string::npos) << r.err;
  // One line of error.
  std::string e = r.err;
  while (!e.empty() && e.back() == '\n') e.pop_back();
  EXPECT_EQ(e.find('\n'), std::string::npos) << r.err;
}
