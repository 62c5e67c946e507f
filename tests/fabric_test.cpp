// ember::Fabric in process, on single_device (engine/include/ember/fabric.h): the same weights as a
// hand-written LibTorch loop, amp16's skipped step, clipping and the norm it returns (16-mixed
// too), logging, the distributed sampler against PyTorch's, bad input as one-line errors, and
// launch's exit codes. Saving and loading: fabric_checkpoint_test.cpp; 2 CPU ranks:
// fabric_distributed_test.cpp.
#include <gtest/gtest.h>

#include <ember/error.h>
#include <ember/fabric.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "checkpoint/checkpoint_io.h"
#include "fabric_support.h"
#include "support.h"

namespace {

using ember::test::TempDir;
using namespace ember::test::fabric;

TEST(Fabric, SingleDeviceFp32MatchesHandWrittenLoop) {
  const Data d = make_data(128);
  auto reference = make_net(7);
  torch::optim::Adam ref_opt(reference->parameters(), torch::optim::AdamOptions(1e-2));
  for (int64_t s = 0; s < 24; ++s) {
    auto x = d.x.narrow(0, (s * 16) % 128, 16), y = d.y.narrow(0, (s * 16) % 128, 16);
    ref_opt.zero_grad();
    auto loss = torch::cross_entropy_loss(reference->forward(x), y);
    loss.backward();
    ref_opt.step();
  }

  ember::Fabric f({.accelerator = "cpu", .strategy = "single_device", .precision = "32-true"});
  auto net = make_net(7);
  f.setup(net, adam());
  EXPECT_EQ(f.world_size(), 1);
  EXPECT_TRUE(f.is_global_zero());
  EXPECT_EQ(f.device().type(), c10::kCPU);
  EXPECT_EQ(f.strategy_name(), "single_device");
  EXPECT_EQ(f.precision_name(), "fp32");
  fabric_steps(f, *net, d, 24);
  EXPECT_LE(max_difference(weights(*reference), weights(*net)), 1e-6);
  EXPECT_GT(max_difference(weights(*make_net(7)), weights(*net)), 1e-3);  // it did train
}

TEST(Fabric, Amp16SkipsTheStepOnAnInfGradientAndBacksOff) {
  const Data d = make_data(32);
  ember::Fabric f({.accelerator = "cpu", .strategy = "single_device", .precision = "16-mixed",
                   .plugin_config = "[amp16]\ninit_scale = 1024.0\n"});
  EXPECT_EQ(f.precision_name(), "amp16");
  auto net = make_net(3);
  f.setup(net, adam());
  auto step = [&](bool poison) {
    f.zero_grad();
    at::Tensor loss;
    {
      auto region = f.autocast();
      loss = torch::cross_entropy_loss(net->forward(f.to_device(d.x.narrow(0, 0, 16))), d.y.narrow(0, 0, 16));
    }
    f.backward(loss);
    if (poison) net->head->weight.mutable_grad().view(-1)[0] = std::numeric_limits<float>::infinity();
    return f.optimizer_step();
  };
  const auto before = weights(*net);
  EXPECT_FALSE(step(true));
  EXPECT_EQ(max_difference(before, weights(*net)), 0.0);  // skipped: nothing moved
  EXPECT_TRUE(step(false));
  EXPECT_GT(max_difference(before, weights(*net)), 0.0);
  // The scale backed off from 1024 to 512 on the inf step: amp16's state, saved with the checkpoint
  // and restored by load().
  TempDir tmp("fabric_amp16");
  auto scaler_state = [](const std::filesystem::path& file) {
    auto ck = ember::engine::load_checkpoint_file(file);
    return ck.at("plugins").toGenericDict().at("precision").toGenericDict();
  };
  f.save((tmp / "a.ckpt").string());
  auto saved = scaler_state(tmp / "a.ckpt");
  EXPECT_EQ(saved.at("scale").toDouble(), 512.0);
  EXPECT_EQ(saved.at("skipped_steps").toInt(), 1);
  ember::Fabric g({.accelerator = "cpu", .precision = "16-mixed"});
  auto copy = make_net(0);
  g.setup(copy, adam());
  g.load((tmp / "a.ckpt").string());
  EXPECT_EQ(max_difference(weights(*net), weights(*copy)), 0.0);
  g.save((tmp / "b.ckpt").string());
  EXPECT_EQ(scaler_state(tmp / "b.ckpt").at("scale").toDouble(), 512.0);
}

TEST(Fabric, ClipGradientsByNormAndByValue) {
  const Data d = make_data(16);
  for (auto algorithm : {ember::ClipAlgorithm::norm, ember::ClipAlgorithm::value}) {
    ember::Fabric f({.accelerator = "cpu"});
    auto net = make_net(5);
    f.setup(net, [](std::vector<at::Tensor> p) {
      return std::make_shared<torch::optim::SGD>(std::move(p), torch::optim::SGDOptions(1.0));
    });
    const auto before = weights(*net);
    f.zero_grad();
    at::Tensor loss;
    {
      auto region = f.autocast();
      loss = 1000.0 * torch::cross_entropy_loss(net->forward(d.x), d.y);
    }
    f.backward(loss);
    const double unclipped = gradient_norm(*net);
    ASSERT_GT(unclipped, 0.1);
    const at::Tensor norm = f.clip_gradients(0.01, algorithm);
    if (algorithm == ember::ClipAlgorithm::norm) {
      // torch's clip_grad_norm_: the total norm before clipping.
      ASSERT_TRUE(norm.defined());
      EXPECT_EQ(norm.dim(), 0);
      EXPECT_NEAR(norm.item<double>(), unclipped, 1e-5 * unclipped);
    } else {
      EXPECT_FALSE(norm.defined());  // Lightning returns None for clip_val
    }
    ASSERT_TRUE(f.optimizer_step());
    // SGD with lr 1 moves every weight by exactly minus its (clipped) gradient.
    double sq = 0, max_abs = 0;
    auto after = weights(*net);
    for (size_t i = 0; i < after.size(); ++i) {
      auto delta = (after[i] - before[i]).to(at::kDouble);
      sq += delta.pow(2).sum().item<double>();
      max_abs = std::max(max_abs, delta.abs().max().item<double>());
    }
    if (algorithm == ember::ClipAlgorithm::norm) {
      EXPECT_NEAR(std::sqrt(sq), 0.01, 1e-5);
    } else {
      EXPECT_NEAR(max_abs, 0.01, 1e-6);
      EXPECT_GT(std::sqrt(sq), 0.01);  // value clipping does not bound the norm
    }
  }
}

// 16-mixed: clip_gradients unscales first, so the norm it returns and the clipping are in true
// gradient units, and the step that follows does not unscale a second time.
TEST(Fabric, Amp16ClipGradientsUnscalesFirstAndReturnsTheTrueNorm) {
  const Data d = make_data(16);
  auto reference = make_net(5);
  torch::cross_entropy_loss(reference->forward(d.x), d.y).backward();
  const double true_norm = gradient_norm(*reference);

  ember::Fabric f({.accelerator = "cpu", .precision = "16-mixed", .plugin_config = "[amp16]\ninit_scale = 1024.0\n"});
  auto net = make_net(5);
  f.setup(net, [](std::vector<at::Tensor> p) {
    return std::make_shared<torch::optim::SGD>(std::move(p), torch::optim::SGDOptions(1.0));
  });
  auto backward = [&](bool poison) {
    f.zero_grad();
    at::Tensor loss;
    {
      auto region = f.autocast();
      loss = torch::cross_entropy_loss(net->forward(f.to_device(d.x)), d.y);
    }
    f.backward(loss);
    if (poison) net->head->weight.mutable_grad().view(-1)[0] = std::numeric_limits<float>::infinity();
  };
  backward(false);
  EXPECT_NEAR(gradient_norm(*net), 1024.0 * true_norm, 0.02 * 1024.0 * true_norm);  // still scaled
  const double max = true_norm / 4;
  const at::Tensor norm = f.clip_gradients(max);
  EXPECT_NEAR(norm.item<double>(), true_norm, 0.02 * true_norm);  // float16 autocast: ~1e-3 apart
  EXPECT_NEAR(gradient_norm(*net), max, 1e-3 * max);               // unscaled, then clipped
  const auto before = weights(*net);
  ASSERT_TRUE(f.optimizer_step());
  double sq = 0;
  const auto after = weights(*net);
  for (size_t i = 0; i < after.size(); ++i) sq += (after[i] - before[i]).to(at::kDouble).pow(2).sum().item<double>();
  EXPECT_NEAR(std::sqrt(sq), max, 1e-3 * max);  // SGD lr 1: the update is the clipped gradient, not unscaled twice

  // An inf gradient: the norm says so and the step is still skipped.
  backward(true);
  EXPECT_FALSE(std::isfinite(f.clip_gradients(max).item<double>()));
  EXPECT_FALSE(f.optimizer_step());
  EXPECT_EQ(max_difference(after, weights(*net)), 0.0);
}

TEST(Fabric, LogsThroughALoggerPluginOnRankZero) {
  TempDir tmp("fabric_log");
  std::string dir;
  {
    ember::Fabric f({.accelerator = "cpu", .loggers = {"csv"}, .root_dir = tmp.path().string(), .name = "own_loop"});
    f.log("loss", 2.5, 0);
    f.log_dict({{"loss", 1.5}, {"acc", 0.75}}, 1);
    dir = f.log_dir();
  }
  EXPECT_EQ(dir, (tmp.path() / "own_loop" / "version_0").string());
  auto rows = ember::test::read_csv(std::filesystem::path(dir) / "metrics.csv");
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].at("step"), "0");
  EXPECT_EQ(std::stod(rows[0].at("loss")), 2.5);
  EXPECT_EQ(std::stod(rows[1].at("acc")), 0.75);
}

TEST(Fabric, DistributedSamplerMatchesPyTorch) {
  // torch.utils.data.DistributedSampler(range(10), num_replicas=3, seed=7), set_epoch(2), PyTorch 2.11.
  const std::vector<std::vector<int64_t>> padded = {{0, 7, 9, 3}, {5, 6, 1, 0}, {8, 2, 4, 5}};
  const std::vector<std::vector<int64_t>> dropped = {{0, 7, 9}, {5, 6, 1}, {8, 2, 4}};
  for (int64_t r = 0; r < 3; ++r) {
    ember::DistributedSampler a(10, 3, r, true, 7, false), b(10, 3, r, true, 7, true);
    a.set_epoch(2);
    b.set_epoch(2);
    EXPECT_EQ(a.indices(), padded[static_cast<size_t>(r)]);
    EXPECT_EQ(b.indices(), dropped[static_cast<size_t>(r)]);
    EXPECT_EQ(a.num_samples(), 4);
    EXPECT_EQ(b.num_samples(), 3);
  }
  ember::DistributedSampler s(10, 2, 1, false);
  EXPECT_EQ(s.indices(), (std::vector<int64_t>{1, 3, 5, 7, 9}));
  ember::DistributedSampler e0(100, 1, 0, true, 1), e1(100, 1, 0, true, 1);
  e1.set_epoch(1);
  EXPECT_NE(e0.indices(), e1.indices());  // a new order every epoch
  EXPECT_THROW(ember::DistributedSampler(10, 2, 2), ember::ConfigError);
}

TEST(Fabric, BadInputsAreOneLineErrors) {
  auto m = error_of([] { ember::Fabric f({.strategy = "dpp"}); });
  EXPECT_NE(m.find("FabricOptions.strategy"), std::string::npos) << m;
  EXPECT_NE(m.find("ddp"), std::string::npos) << m;  // did you mean
  m = error_of([] { ember::Fabric f({.precision = "bf17-mixed"}); });
  EXPECT_NE(m.find("FabricOptions.precision"), std::string::npos) << m;
  EXPECT_NE(m.find("bf16-mixed"), std::string::npos) << m;  // the accepted strings
  m = error_of([] { ember::Fabric f({.strategy = "fp32"}); });
  EXPECT_NE(m.find("is a precision plugin, not a strategy plugin"), std::string::npos) << m;
  m = error_of([] { ember::Fabric f({.plugin_config = "[single_device]\nbogus = 1\n"}); });
  EXPECT_NE(m.find("FabricOptions.plugin_config:2"), std::string::npos) << m;
  EXPECT_NE(m.find("bogus"), std::string::npos) << m;
  m = error_of([] { ember::Fabric f({.precision = "16-mixed", .plugin_config = "[amp16]\ninit_scale = \"big\"\n"}); });
  EXPECT_NE(m.find("FabricOptions.plugin_config:2"), std::string::npos) << m;
  m = error_of([] { ember::Fabric f({.plugin_config = "[ddp\n"}); });
  EXPECT_NE(m.find("FabricOptions.plugin_config:1"), std::string::npos) << m;
  m = error_of([] { ember::Fabric f({.plugin_config = "[trainer]\nmax_epochs = 3\n"}); });
  EXPECT_NE(m.find("[trainer] is an engine section"), std::string::npos) << m;
  m = error_of([] { ember::Fabric f({.devices = 0}); });
  EXPECT_NE(m.find("FabricOptions.devices = 0"), std::string::npos) << m;
  m = error_of([] { ember::Fabric f({.loggers = {"checkpoint"}}); });
  EXPECT_NE(m.find("Fabric runs no callbacks"), std::string::npos) << m;

  // Calls in the wrong order.
  ember::Fabric f({.accelerator = "cpu"});
  m = error_of<ember::RunError>([&] { f.zero_grad(); });
  EXPECT_NE(m.find("call setup("), std::string::npos) << m;
  auto net = make_net(1);
  f.setup(net, adam());
  m = error_of<ember::RunError>([&] { f.optimizer_step(); });
  EXPECT_NE(m.find("call backward(loss) first"), std::string::npos) << m;
  m = error_of<ember::RunError>([&] { f.setup(net, adam()); });
  EXPECT_NE(m.find("called twice"), std::string::npos) << m;
  m = error_of<ember::RunError>([&] { f.backward(torch::ones({2}, torch::requires_grad())); });
  EXPECT_NE(m.find("scalar"), std::string::npos) << m;
  m = error_of([&] { f.clip_gradients(0.0); });
  EXPECT_NE(m.find("must be > 0"), std::string::npos) << m;
  ember::Fabric two({.accelerator = "cpu", .strategy = "ddp", .devices = 2});
  m = error_of<ember::RunError>([&] { two.setup(make_net(1), adam()); });
  EXPECT_NE(m.find("fabric.launch(fn)"), std::string::npos) << m;
}

TEST(Fabric, LaunchRunsTheFunctionAndTurnsErrorsIntoExitCodes) {
  ember::Fabric f({.accelerator = "cpu"});
  int calls = 0;
  EXPECT_EQ(f.launch([&](ember::Fabric& fabric) {
              ++calls;
              EXPECT_EQ(&fabric, &f);
              EXPECT_EQ(fabric.all_reduce(torch::ones({2})).sum().item<double>(), 2.0);
              EXPECT_EQ(fabric.broadcast(torch::full({1}, 3.0)).item<double>(), 3.0);
              EXPECT_TRUE(fabric.broadcast(true));
              fabric.barrier();
            }),
            0);
  EXPECT_EQ(calls, 1);
  ember::Fabric g({.accelerator = "cpu"});
  EXPECT_EQ(g.launch([](ember::Fabric&) { throw ember::RunError("boom"); }), 1);
  ember::Fabric h({.accelerator = "cpu"});
  EXPECT_EQ(h.launch([](ember::Fabric&) { throw ember::ConfigError("bad"); }), 2);
}

}  // namespace
