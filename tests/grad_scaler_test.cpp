// ember::GradScaler (sdk/include/ember/grad_scaler.h) against torch.amp.GradScaler, and the
// start-up check precision handlers run before training.
#include <gtest/gtest.h>

#include <ember/support/grad_scaler.h>
#include <ember/support/precision_util.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <limits>

namespace {

// Reference: torch 2.11, torch.amp.GradScaler("cpu", init_scale=1024, growth_factor=2,
// backoff_factor=0.5, growth_interval=3); per step: loss = (p * 2).sum() with p = ones(3),
// scale(loss).backward(), an inf planted in p.grad where pattern is 1, step(SGD lr 0.1), update(),
// get_scale(). Final p = [-1, -1, -1] (10 steps taken of 13).
constexpr int kPattern[] = {0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0};
constexpr double kPythonScales[] = {1024, 1024, 2048, 1024, 1024, 1024, 2048, 2048, 1024, 512, 512, 512, 1024};

TEST(GradScaler, MatchesPythonGradScalerSkipBackoffGrowth) {
  auto p = torch::ones({3}).requires_grad_();
  torch::optim::SGD opt({p}, torch::optim::SGDOptions(0.1));
  ember::GradScaler scaler({1024.0, 2.0, 0.5, 3});
  scaler.to(c10::Device(c10::kCPU));
  for (size_t i = 0; i < std::size(kPattern); ++i) {
    opt.zero_grad();
    scaler.scale((p * 2).sum()).backward();
    if (kPattern[i]) {
      torch::NoGradGuard g;
      p.grad()[0] = std::numeric_limits<float>::infinity();
    }
    scaler.unscale(opt);
    const bool finite = scaler.finite();
    EXPECT_EQ(finite, kPattern[i] == 0) << "step " << i;
    if (finite) {
      EXPECT_TRUE(at::allclose(p.grad(), torch::full({3}, 2.0))) << "unscaled gradient at step " << i;
      opt.step();
    }
    scaler.update();
    EXPECT_EQ(scaler.current_scale(), kPythonScales[i]) << "step " << i;
  }
  EXPECT_TRUE(at::allclose(p.detach(), torch::full({3}, -1.0), 1e-5, 1e-6));
}

TEST(GradScaler, NaNCountsAsNonFiniteAndMixedDtypesAreUnscaled) {
  auto a = torch::ones({2}).requires_grad_();
  auto b = torch::ones({2}, torch::kDouble).requires_grad_();
  torch::optim::SGD opt({a, b}, torch::optim::SGDOptions(0.1));
  ember::GradScaler scaler({8.0, 2.0, 0.5, 100});
  scaler.to(c10::Device(c10::kCPU));
  scaler.scale(a.sum() + b.sum().to(torch::kFloat)).backward();
  scaler.unscale(opt);
  EXPECT_TRUE(scaler.finite());
  EXPECT_TRUE(at::allclose(a.grad(), torch::ones({2})));
  EXPECT_TRUE(at::allclose(b.grad(), torch::ones({2}, torch::kDouble)));
  {
    torch::NoGradGuard g;
    b.grad()[1] = std::nan("");
  }
  scaler.unscale(opt);
  EXPECT_FALSE(scaler.finite());
  scaler.update();
  EXPECT_EQ(scaler.current_scale(), 4.0);
}

TEST(GradScaler, StateDictRoundTripsWithPythonKeys) {
  ember::GradScaler a({1024.0, 2.0, 0.5, 3});
  a.to(c10::Device(c10::kCPU));
  auto p = torch::ones({1}).requires_grad_();
  torch::optim::SGD opt({p}, torch::optim::SGDOptions(0.1));
  for (int i = 0; i < 2; ++i) {  // two finite steps: tracker 2, scale unchanged
    opt.zero_grad();
    a.scale(p.sum()).backward();
    a.unscale(opt);
    a.update();
  }
  auto state = a.state_dict();
  for (const char* key : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"})
    EXPECT_TRUE(state.contains(key)) << key;
  EXPECT_EQ(state.at("_growth_tracker").toInt(), 2);
  ember::GradScaler b({65536.0, 4.0, 0.25, 2000});
  b.to(c10::Device(c10::kCPU));
  b.load_state_dict(state);
  EXPECT_EQ(b.current_scale(), 1024.0);
  EXPECT_EQ(b.growth_tracker(), 2);
  EXPECT_EQ(b.options().growth_interval, 3);
  // One more finite step grows both the same way.
  for (auto* s : {&a, &b}) {
    opt.zero_grad();
    s->scale(p.sum()).backward();
    s->unscale(opt);
    s->update();
  }
  EXPECT_EQ(a.current_scale(), 2048.0);
  EXPECT_EQ(b.current_scale(), 2048.0);
}

TEST(GradScaler, RejectsBadOptions) {
  EXPECT_THROW(ember::GradScaler({0.0, 2.0, 0.5, 1}), ember::ConfigError);
  EXPECT_THROW(ember::GradScaler({1.0, 1.0, 0.5, 1}), ember::ConfigError);
  EXPECT_THROW(ember::GradScaler({1.0, 2.0, 1.5, 1}), ember::ConfigError);
  EXPECT_THROW(ember::GradScaler({1.0, 2.0, 0.5, 0}), ember::ConfigError);
}

TEST(PrecisionCheck, AcceptsWhatTheCpuCanDo) {
  const c10::Device cpu(c10::kCPU);
  EXPECT_NO_THROW(ember::check_precision_supported("amp16", cpu, at::kHalf, true, "x"));
  EXPECT_NO_THROW(ember::check_precision_supported("bf16", cpu, at::kBFloat16, true, "x"));
  EXPECT_NO_THROW(ember::check_precision_supported("fp64", cpu, at::kDouble, false, "x"));
  EXPECT_NO_THROW(ember::check_precision_supported("fp16_true", cpu, at::kHalf, false, "x"));
}

TEST(PrecisionCheck, RefusesInOneLineWhatTheDeviceCannotDo) {
  // No autocast exists for the meta device; integer math has no gradients.
  for (auto [device, dtype, autocast] : {std::tuple{c10::Device(c10::kMeta), at::kHalf, true},
                                         std::tuple{c10::Device(c10::kCPU), at::kInt, false}}) {
    try {
      ember::check_precision_supported("mode_x", device, dtype, autocast, "use fp32 instead");
      ADD_FAILURE() << "accepted " << device << " " << dtype;
    } catch (const ember::RunError& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind("mode_x: ", 0), 0u) << msg;
      EXPECT_NE(msg.find("use fp32 instead"), std::string::npos) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
  }
}

}  // namespace
