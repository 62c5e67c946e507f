// Ember::losses (<ember/support/cross_entropy.h>): the two fused passes give LibTorch's
// cross-entropy (at::cross_entropy_loss) and its gradient in float64 and float32, from bf16 and
// float16 logits to their rounding, over vocabulary sizes that leave every tail of the vectorised
// loops, with ignored targets, -inf and huge logits, NaN, an upstream gradient, a second backward
// and no grad mode; bad input is one line. On a machine with a GPU the CUDA kernels give the CPU's
// results (tests/gpu_paths.sh runs this suite there).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ember/error.h>
#include <ember/support/cross_entropy.h>
#include <ember/support/linear_cross_entropy.h>
#include <torch/autograd.h>
#include <torch/cuda.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace {

struct Rows {
  at::Tensor logits, targets;
};

// `rows` rows of `cols` logits (scaled so that the softmax is far from uniform); rows 1 and 4
// (where they exist) carry ignore_index.
Rows make_rows(int64_t rows, int64_t cols, at::ScalarType dtype, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Rows r;
  r.logits = (at::randn({rows, cols}, gen, at::kDouble) * 3).to(dtype);
  r.targets = at::randint(0, cols, {rows}, gen, at::kLong);
  if (rows > 1) r.targets[1] = -100;
  if (rows > 4) r.targets[4] = -100;
  return r;
}

struct Result {
  at::Tensor loss, grad;
};

// The loss times `upstream` backpropagated, through Ember or LibTorch (the reference computes in
// float64 from the same logits, or in float32 where asked).
Result through(const at::Tensor& logits, const at::Tensor& targets, bool ember, double upstream = 1.0) {
  const at::Tensor x = logits.detach().clone().requires_grad_();
  const at::Tensor loss = ember ? ember::cross_entropy(x, targets) : at::cross_entropy_loss(x, targets);
  (loss * upstream).backward();
  return {loss.detach(), x.grad()};
}

double max_abs(const at::Tensor& a, const at::Tensor& b) { return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>(); }

}  // namespace

TEST(CrossEntropy, EqualsLibTorchInDoubleAndFloatOverEveryLoopTail) {
  // 1 and 15 columns: only the loops' tails; 16 and 48: only whole lanes; 1,000 and 50,307: both.
  for (const int64_t cols : {int64_t{1}, int64_t{15}, int64_t{16}, int64_t{48}, int64_t{1000}, int64_t{50307}}) {
    for (const auto dtype : {at::kDouble, at::kFloat}) {
      SCOPED_TRACE(c10::str(dtype, " ", cols, " columns"));
      const Rows r = make_rows(cols > 1000 ? 6 : 9, cols, dtype, 11 + cols);
      const Result ref = through(r.logits, r.targets, false, 2.5), got = through(r.logits, r.targets, true, 2.5);
      EXPECT_EQ(got.loss.scalar_type(), dtype);
      EXPECT_EQ(got.grad.scalar_type(), dtype);
      const double tol = dtype == at::kDouble ? 1e-13 : 2e-6;
      EXPECT_LE(max_abs(got.loss, ref.loss), tol * std::max(1.0, std::abs(ref.loss.item<double>())));
      EXPECT_LE(max_abs(got.grad, ref.grad), tol);
      // Ignored rows have exactly no gradient.
      EXPECT_EQ(got.grad[1].abs().max().item<double>(), 0.0);
    }
  }
}

// bf16 / float16 logits are read as they are: the loss equals float32 LibTorch on the same values,
// and the gradient is that float32 gradient rounded once to the logits' dtype.
TEST(CrossEntropy, LowerPrecisionLogitsGiveTheFloat32LossAndOneRounding) {
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::str(dtype));
    const Rows r = make_rows(7, 333, dtype, 5);
    const Result ref = through(r.logits.to(at::kFloat), r.targets, false), got = through(r.logits, r.targets, true);
    EXPECT_EQ(got.loss.scalar_type(), at::kFloat);
    EXPECT_EQ(got.grad.scalar_type(), dtype);
    EXPECT_LE(max_abs(got.loss, ref.loss), 2e-6 * std::abs(ref.loss.item<double>()));
    // Within one rounding to the dtype (its unit roundoff, relative), plus float32 noise near zero.
    const double unit = dtype == at::kBFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    const at::Tensor err = (got.grad.to(at::kDouble) - ref.grad.to(at::kDouble)).abs();
    EXPECT_TRUE(err.le(ref.grad.to(at::kDouble).abs() * unit + 1e-7).all().item<bool>()) << err.max().item<double>();
  }
}

// -inf logits (a masked vocabulary) add nothing and get exactly no gradient; logits of 1e4 do not
// overflow; a NaN makes its row's loss NaN, as LibTorch's does.
TEST(CrossEntropy, InfiniteHugeAndNanLogits) {
  Rows r = make_rows(5, 40, at::kFloat, 3);
  r.targets[1] = 2;
  r.logits.index_put_({0, at::indexing::Slice(0, 20)}, -std::numeric_limits<float>::infinity());
  r.targets[0] = 25;
  r.logits[2] += 1e4;
  const Result ref = through(r.logits, r.targets, false), got = through(r.logits, r.targets, true);
  EXPECT_TRUE(std::isfinite(got.loss.item<double>()));
  EXPECT_LE(max_abs(got.loss, ref.loss), 2e-6 * std::abs(ref.loss.item<double>()));
  EXPECT_LE(max_abs(got.grad, ref.grad), 2e-6);
  EXPECT_EQ(got.grad[0].slice(0, 0, 20).abs().max().item<double>(), 0.0);

  r.logits[3][7] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(ember::cross_entropy(r.logits, r.targets).item<double>()));
}

// A second backward (retain_graph) gives the same gradient again; without grad mode, or for logits
// that want none, the loss alone.
TEST(CrossEntropy, SecondBackwardAndNoGradMode) {
  const Rows r = make_rows(6, 70, at::kFloat, 9);
  const at::Tensor x = r.logits.clone().requires_grad_();
  const at::Tensor loss = ember::cross_entropy(x, r.targets);
  loss.backward({}, /*retain_graph=*/true);
  const at::Tensor first = x.grad().clone();
  loss.backward();
  EXPECT_LE(max_abs(x.grad(), first * 2), 1e-7);
  {
    at::NoGradGuard no_grad;
    EXPECT_EQ(ember::cross_entropy(x, r.targets).item<float>(), loss.item<float>());
  }
  EXPECT_FALSE(ember::cross_entropy(r.logits, r.targets).requires_grad());
  EXPECT_EQ(ember::cross_entropy(r.logits, r.targets).item<float>(), loss.item<float>());
  // Every target ignored: NaN (0 / 0), as LibTorch's mean.
  EXPECT_TRUE(std::isnan(ember::cross_entropy(r.logits, at::full({6}, -100, at::kLong)).item<double>()));
}

TEST(CrossEntropy, BadInputIsOneLine) {
  const Rows r = make_rows(4, 10, at::kFloat, 1);
  auto message = [](auto&& call) {
    try {
      call();
    } catch (const ember::RunError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  at::Tensor out_of_range = r.targets.clone();
  out_of_range[2] = 10;
  const std::string range = message([&] { ember::cross_entropy(r.logits, out_of_range); });
  EXPECT_NE(range.find("target 10 of row 2 is outside the 10 classes of the logits (0 to 9"), std::string::npos) << range;
  EXPECT_EQ(range.find('\n'), std::string::npos);
  const std::string shape = message([&] { ember::cross_entropy(r.logits.unsqueeze(0), r.targets); });
  EXPECT_NE(shape.find("expected [N, V]"), std::string::npos) << shape;
  const std::string targets = message([&] { ember::cross_entropy(r.logits, r.targets.to(at::kFloat)); });
  EXPECT_NE(targets.find("expected one integer class index per row"), std::string::npos) << targets;
  const std::string ints = message([&] { ember::cross_entropy(r.logits.to(at::kLong), r.targets); });
  EXPECT_NE(ints.find("float32, float64, bf16 or float16"), std::string::npos) << ints;
}

// On a GPU: Ember's CUDA kernels (where the build has them) give the CPU loops' loss and gradient,
// for every dtype, with rows whose length and start leave 16-byte accesses out (odd vocabularies)
// and in (multiples of 8), and a 50,304-token vocabulary.
TEST(CrossEntropy, CudaKernelsGiveTheCpuResults) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const at::Tensor probe = at::empty({1, 1}, at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16));
  EXPECT_EQ(ember::cross_entropy_has_own_kernels(probe), EMBER_TEST_CUDA_KERNELS != 0);
  for (const int64_t cols : {int64_t{7}, int64_t{64}, int64_t{1001}, int64_t{50304}}) {
    for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      SCOPED_TRACE(c10::str(dtype, " ", cols, " columns"));
      const Rows r = make_rows(37, cols, dtype, 21 + cols);
      const Result cpu = through(r.logits, r.targets, true, 0.75);
      const Result gpu = through(r.logits.to(at::kCUDA), r.targets.to(at::kCUDA), true, 0.75);
      EXPECT_LE(max_abs(gpu.loss.cpu(), cpu.loss), 2e-6 * std::abs(cpu.loss.item<double>()));
      // Both round float32 values that differ by float32 noise: at most one ulp of the dtype apart.
      const double ulp = dtype == at::kFloat ? 1e-6 : dtype == at::kBFloat16 ? std::ldexp(1.0, -7) : std::ldexp(1.0, -10);
      EXPECT_TRUE((gpu.grad.cpu().to(at::kDouble) - cpu.grad.to(at::kDouble)).abs().le(cpu.grad.to(at::kDouble).abs() * ulp + 1e-7).all().item<bool>());
      EXPECT_EQ(gpu.grad.cpu()[1].abs().max().item<double>(), 0.0);
    }
  }
  // linear_cross_entropy's slices run the same kernels in place over the logits.
  {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
    const at::Tensor x = at::randn({37, 16}, gen), w = at::randn({1001, 16}, gen) * 0.5;
    at::Tensor t = at::randint(0, 1001, {37}, gen, at::kLong);
    t[3] = -100;
    auto run = [&](const at::Device& device) {
      const at::Tensor xd = x.to(device).requires_grad_(), wd = w.to(device).requires_grad_();
      const at::Tensor loss = ember::linear_cross_entropy(xd, wd, t.to(device), -100, 8);
      loss.backward();
      return std::vector<at::Tensor>{loss.detach().cpu(), xd.grad().cpu(), wd.grad().cpu()};
    };
    const auto cpu = run(at::kCPU), gpu = run(at::Device(at::kCUDA));
    for (size_t i = 0; i < cpu.size(); ++i) EXPECT_LE(max_abs(gpu[i], cpu[i]), 1e-5 * std::max(1.0, cpu[i].abs().max().item<double>())) << i;
  }
  // A target past the vocabulary: NaN on CUDA (no synchronising check), never a read past the row.
  Rows r = make_rows(3, 16, at::kFloat, 2);
  r.targets[0] = 16;
  EXPECT_TRUE(std::isnan(ember::cross_entropy(r.logits.to(at::kCUDA), r.targets.to(at::kCUDA)).item<double>()));
}
