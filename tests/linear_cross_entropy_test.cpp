// Ember::losses (<ember/support/linear_cross_entropy.h>): the output layer and cross-entropy in one
// pass over row slices give LibTorch's loss and gradients (at::linear then at::cross_entropy_loss)
// in float64 and float32, under bf16 autocast to bf16 rounding, with ignored targets, frozen
// weights, no grad mode and a second backward; bad shapes are one line.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ember/error.h>
#include <ember/support/autocast.h>
#include <ember/support/linear_cross_entropy.h>
#include <torch/autograd.h>

#include <cmath>
#include <string>

namespace {

struct Case {
  at::Tensor x, w, t;
};

// 10 rows (three slices of 4, 4 and 2 with chunk_rows = 4) over a 37-token vocabulary; rows 2 and
// 7 carry ignore_index.
Case make_case(at::ScalarType dtype, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Case c;
  c.x = (at::randn({10, 16}, gen) * 2).to(dtype).requires_grad_();
  c.w = (at::randn({37, 16}, gen) * 0.5).to(dtype).requires_grad_();
  c.t = at::randint(0, 37, {10}, gen, at::kLong);
  c.t[2] = -100;
  c.t[7] = -100;
  return c;
}

struct Result {
  at::Tensor loss, gx, gw;
};

Result through(const Case& c, bool fused, int64_t chunk_rows = 4) {
  const at::Tensor x = c.x.detach().clone().requires_grad_(), w = c.w.detach().clone().requires_grad_();
  const at::Tensor loss = fused ? ember::linear_cross_entropy(x, w, c.t, -100, chunk_rows) : at::cross_entropy_loss(at::linear(x, w), c.t);
  loss.backward();
  return {loss.detach(), x.grad(), w.grad()};
}

double rel(const at::Tensor& a, const at::Tensor& b) {
  return ((a.to(at::kDouble) - b.to(at::kDouble)).abs().max() / (b.to(at::kDouble).abs().max() + 1e-30)).item<double>();
}

}  // namespace

TEST(LinearCrossEntropy, EqualsLinearThenCrossEntropyInDoubleAndFloat) {
  for (const auto dtype : {at::kDouble, at::kFloat}) {
    const double tol = dtype == at::kDouble ? 1e-13 : 2e-6;
    const Case c = make_case(dtype, 7);
    const Result ref = through(c, false);
    for (const int64_t chunk : {int64_t{1}, int64_t{3}, int64_t{4}, int64_t{0}}) {
      const Result got = through(c, true, chunk);
      SCOPED_TRACE(c10::str(dtype, " chunk_rows ", chunk));
      EXPECT_EQ(got.loss.scalar_type(), dtype);
      EXPECT_LT(rel(got.loss, ref.loss), tol);
      EXPECT_LT(rel(got.gx, ref.gx), tol);
      EXPECT_LT(rel(got.gw, ref.gw), tol);
      // Ignored rows get no input gradient.
      EXPECT_EQ(got.gx[2].abs().max().item<double>(), 0.0);
      EXPECT_EQ(got.gx[7].abs().max().item<double>(), 0.0);
    }
  }
}

// Under autocast both paths multiply in bf16 and take the log-softmax in float32: the loss agrees to
// float32 rounding of the same bf16 logits, the gradients to bf16 rounding; both come back in the
// parameters' float32.
TEST(LinearCrossEntropy, FollowsAutocastsDtypes) {
  const Case c = make_case(at::kFloat, 11);
  Result ref, got;
  {
    ember::AutocastRegion region(at::kCPU, at::kBFloat16);
    ref = through(c, false);
  }
  {
    ember::AutocastRegion region(at::kCPU, at::kBFloat16);
    got = through(c, true, 3);
  }
  EXPECT_EQ(got.loss.scalar_type(), at::kFloat);
  EXPECT_EQ(got.gx.scalar_type(), at::kFloat);
  EXPECT_EQ(got.gw.scalar_type(), at::kFloat);
  EXPECT_LT(rel(got.loss, ref.loss), 1e-5);
  EXPECT_LT(rel(got.gx, ref.gx), 2e-2);
  EXPECT_LT(rel(got.gw, ref.gw), 2e-2);
  // And they are bf16-rounded, not float32: against the float32 path the difference is visible.
  const Result exact = through(c, true, 3);
  EXPECT_GT(rel(got.loss, exact.loss), 1e-6);
}

TEST(LinearCrossEntropy, FrozenWeightNoGradModeAndSecondBackward) {
  const Case c = make_case(at::kDouble, 3);
  const Result ref = through(c, false);
  {
    // A frozen output layer (LoRA's base): the input's gradient only.
    const at::Tensor x = c.x.detach().clone().requires_grad_(), w = c.w.detach();
    ember::linear_cross_entropy(x, w, c.t, -100, 4).backward();
    EXPECT_LT(rel(x.grad(), ref.gx), 1e-13);
  }
  {
    at::NoGradGuard no_grad;
    const at::Tensor loss = ember::linear_cross_entropy(c.x, c.w, c.t);
    EXPECT_FALSE(loss.requires_grad());
    EXPECT_LT(rel(loss, ref.loss), 1e-13);
  }
  {
    // retain_graph: the saved sums are scaled out of place, so a second backward adds the same again.
    const at::Tensor x = c.x.detach().clone().requires_grad_(), w = c.w.detach().clone().requires_grad_();
    const at::Tensor loss = ember::linear_cross_entropy(x, w, c.t, -100, 4) * 3.0;
    loss.backward({}, /*retain_graph=*/true);
    loss.backward();
    EXPECT_LT(rel(x.grad(), ref.gx * 6.0), 1e-13);
    EXPECT_LT(rel(w.grad(), ref.gw * 6.0), 1e-13);
  }
}

TEST(LinearCrossEntropy, EveryTargetIgnoredIsNaNLikeLibTorch) {
  Case c = make_case(at::kDouble, 5);
  c.t.fill_(-100);
  EXPECT_TRUE(std::isnan(at::cross_entropy_loss(at::linear(c.x, c.w), c.t).item<double>()));
  EXPECT_TRUE(std::isnan(ember::linear_cross_entropy(c.x, c.w, c.t).item<double>()));
}

TEST(LinearCrossEntropy, BadShapesAreOneLine) {
  const Case c = make_case(at::kFloat, 1);
  try {
    ember::linear_cross_entropy(c.x, c.w.t(), c.t);
    FAIL() << "expected an error";
  } catch (const ember::RunError& e) {
    EXPECT_NE(std::string(e.what()).find("expected input [N, C] and weight [V, C]"), std::string::npos) << e.what();
  }
  try {
    ember::linear_cross_entropy(c.x, c.w, c.t.slice(0, 0, 9));
    FAIL() << "expected an error";
  } catch (const ember::RunError& e) {
    EXPECT_NE(std::string(e.what()).find("one integer class index per row"), std::string::npos) << e.what();
  }
}
