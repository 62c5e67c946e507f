// Ember::activations (<ember/support/activations.h>): gelu_tanh's own CPU kernels give LibTorch's
// GELU (tanh form) values and gradients to float32 rounding, on any layout and thread count, pass
// NaN through, and hand everything they do not run (other dtypes, double backward) to ATen.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ember/support/activations.h>
#include <torch/autograd.h>

#include <cmath>
#include <limits>

namespace {

// The largest |a - b| / scale of a float32 result against its float64 reference. GELU's values
// scale with |x| (near zero for x << 0, where 1 + tanh cancels, ATen's own float result keeps few
// correct digits relative to the value itself), its gradients with the upstream gradient.
double worst_error(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale) {
  const at::Tensor a64 = a.to(at::kDouble), b64 = b.to(at::kDouble);
  return ((a64 - b64).abs() / (scale.to(at::kDouble).abs() + 1e-30)).max().item<double>();
}

at::Tensor reference(const at::Tensor& x) { return at::gelu(x.to(at::kDouble), "tanh"); }
at::Tensor reference_grad(const at::Tensor& g, const at::Tensor& x) {
  return at::gelu_backward(g.to(at::kDouble), x.to(at::kDouble), "tanh");
}

// Values over the range activations take (and far beyond), and sizes around the vector width and
// the grain at which the elements are split over threads.
at::Tensor sample(int64_t n, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor x = at::randn({n}, gen) * 4;
  if (n >= 8) x.narrow(0, 0, 8).copy_(at::tensor({0.0f, -0.0f, 1e-30f, -1e-30f, 60.0f, -60.0f, 1e4f, -1e4f}));
  return x;
}

}  // namespace

TEST(GeluTanh, GivesLibTorchsValuesAndGradientsToFloatRounding) {
  for (int64_t n : {int64_t{1}, int64_t{15}, int64_t{17}, int64_t{16384}, int64_t{100003}}) {
    SCOPED_TRACE(n);
    const at::Tensor x = sample(n, 7 + n).requires_grad_(true);
    const at::Tensor y = ember::gelu_tanh(x);
    // float32 results differ from the exact ones by rounding; LibTorch's own float kernel too.
    const at::Tensor exact = reference(x.detach());
    const double ours = worst_error(y.detach(), exact, x.detach());
    const double aten = worst_error(at::gelu(x.detach(), "tanh"), exact, x.detach());  // LibTorch's own float kernel
    EXPECT_LT(ours, 3e-7) << "ATen's: " << aten;  // ~1 float32 ulp of |x|
    const at::Tensor g = at::randn_like(x.detach());
    y.backward(g);
    const at::Tensor exact_grad = reference_grad(g, x.detach());
    const double ours_grad = worst_error(x.grad(), exact_grad, g);
    const double aten_grad = worst_error(at::gelu_backward(g, x.detach(), "tanh"), exact_grad, g);
    EXPECT_LT(ours_grad, 5e-7) << "ATen's: " << aten_grad;  // ATen's own: ~1e-6
  }
}

TEST(GeluTanh, TakesAnyLayoutAndGivesTheSameBitsOnAnyThreadCount) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const at::Tensor base = at::randn({64, 300}, gen) * 3;
  const at::Tensor contiguous = ember::gelu_tanh(base);
  // A transposed view, a strided slice and a broadcast gradient take the strided loop.
  EXPECT_TRUE(at::equal(ember::gelu_tanh(base.t()), contiguous.t()));
  EXPECT_TRUE(at::equal(ember::gelu_tanh(base.slice(1, 0, 300, 3)), contiguous.slice(1, 0, 300, 3)));
  const at::Tensor x = base.t().requires_grad_(true);
  ember::gelu_tanh(x).backward(at::ones({300, 1}).expand({300, 64}));
  const at::Tensor xc = base.clone().requires_grad_(true);
  ember::gelu_tanh(xc).backward(at::ones({64, 300}));
  EXPECT_TRUE(at::equal(x.grad(), xc.grad().t()));

  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const at::Tensor one_thread = ember::gelu_tanh(base);
  at::set_num_threads(std::max(threads, 2));
  const at::Tensor two_threads = ember::gelu_tanh(base);
  at::set_num_threads(threads);
  EXPECT_TRUE(at::equal(one_thread, two_threads));
  EXPECT_TRUE(at::equal(one_thread, contiguous));
}

TEST(GeluTanh, PassesNaNThroughBothWays) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const at::Tensor x = at::tensor({1.0f, nan, -2.0f}).requires_grad_(true);
  const at::Tensor y = ember::gelu_tanh(x);
  EXPECT_TRUE(std::isnan(y[1].item<float>()));
  EXPECT_FALSE(std::isnan(y[0].item<float>()) || std::isnan(y[2].item<float>()));
  y.backward(at::ones({3}));
  EXPECT_TRUE(std::isnan(x.grad()[1].item<float>()));
  // A NaN upstream gradient too (the spike guard looks for it).
  const at::Tensor x2 = at::tensor({1.0f, 2.0f}).requires_grad_(true);
  ember::gelu_tanh(x2).backward(at::tensor({nan, 1.0f}));
  EXPECT_TRUE(std::isnan(x2.grad()[0].item<float>()));
  EXPECT_FALSE(std::isnan(x2.grad()[1].item<float>()));
}

TEST(GeluTanh, LeavesOtherDtypesAndDoubleBackwardToLibTorch) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const at::Tensor x64 = at::randn({50}, gen, at::kDouble);
  EXPECT_TRUE(at::equal(ember::gelu_tanh(x64), at::gelu(x64, "tanh")));
  const at::Tensor xb = x64.to(at::kBFloat16);
  EXPECT_TRUE(at::equal(ember::gelu_tanh(xb), at::gelu(xb, "tanh")));
  // Without autograd (validation, generation) the value is the one training computes.
  const at::Tensor x = x64.to(at::kFloat).requires_grad_(true);
  at::Tensor no_grad_value;
  {
    at::NoGradGuard no_grad;
    no_grad_value = ember::gelu_tanh(x);
  }
  EXPECT_TRUE(at::equal(no_grad_value, ember::gelu_tanh(x).detach()));
  // The second derivative (create_graph) comes from ATen's differentiable formula.
  const at::Tensor first = torch::autograd::grad({ember::gelu_tanh(x).sum()}, {x}, {}, true, true)[0];
  const at::Tensor second = torch::autograd::grad({first.sum()}, {x})[0];
  const at::Tensor xr = x.detach().clone().requires_grad_(true);
  const at::Tensor first_ref = torch::autograd::grad({at::gelu(xr, "tanh").sum()}, {xr}, {}, true, true)[0];
  const at::Tensor second_ref = torch::autograd::grad({first_ref.sum()}, {xr})[0];
  EXPECT_TRUE(at::allclose(first, first_ref, 1e-5, 1e-6));
  EXPECT_TRUE(at::equal(second, second_ref));
  // float64 trains through ATen alike.
  const at::Tensor xd = x64.clone().requires_grad_(true);
  const at::Tensor gd = torch::autograd::grad({ember::gelu_tanh(xd).sum()}, {xd})[0];
  EXPECT_TRUE(at::allclose(gd, at::gelu_backward(at::ones_like(x64), x64, "tanh")));
}
