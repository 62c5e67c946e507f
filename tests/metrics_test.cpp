// The metric store reads CPU values at once and accumulates them as host doubles (no tensor op
// per logged value); these tests hold it to the numbers the tensor arithmetic it replaced gives,
// bit for bit. And the models' CPU accuracy count against ATen's argmax.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <limits>
#include <vector>

#include <ember/model_support/classification.h>
#include "loop/metrics.h"

using namespace ember::engine;

namespace {

struct Logged {
  float value;
  int64_t batch_size;
};

// What the store computed before it kept CPU values on the host: a double tensor accumulator,
// one ATen op per value, read back at epoch end.
double tensor_reference(const std::vector<Logged>& values, ember::Reduce reduce) {
  at::Tensor sum;
  double weight = 0;
  for (const auto& [v, bs] : values) {
    const at::Tensor t = at::scalar_tensor(v, at::kFloat);
    const double w = static_cast<double>(bs);
    if (!sum.defined()) {
      sum = t.to(at::kDouble) * (reduce == ember::Reduce::mean ? w : 1.0);
    } else {
      switch (reduce) {
        case ember::Reduce::mean: sum.add_(t, w); break;
        case ember::Reduce::sum: sum.add_(t); break;
        case ember::Reduce::max: sum = at::maximum(sum, t); break;
        case ember::Reduce::min: sum = at::minimum(sum, t); break;
      }
    }
    weight += w;
  }
  const double v = sum.item<double>();
  return reduce == ember::Reduce::mean ? v / weight : v;
}

void expect_same_bits(double expected, double actual) {
  if (std::isnan(expected)) EXPECT_TRUE(std::isnan(actual)) << actual;
  else EXPECT_EQ(expected, actual);
}

std::vector<Logged> random_values(int64_t n, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const at::Tensor v = at::randn({n}, gen) * 3.7;
  const at::Tensor bs = at::randint(1, 97, {n}, gen);
  std::vector<Logged> out;
  for (int64_t i = 0; i < n; ++i) out.push_back({v[i].item<float>(), bs[i].item<int64_t>()});
  return out;
}

double epoch_value(MetricStore& store, const char* key, const MetricStore::Reducer& reduce = nullptr) {
  for (const auto& [k, v] : store.finish_epoch(ember::Stage::fit, reduce))
    if (k == key) return v;
  ADD_FAILURE() << "no " << key;
  return 0;
}

}  // namespace

TEST(MetricStore, CpuValuesAccumulateToTheTensorArithmeticsBits) {
  const auto values = random_values(1000, 7);
  for (auto reduce : {ember::Reduce::mean, ember::Reduce::sum, ember::Reduce::max, ember::Reduce::min}) {
    MetricStore store;
    ember::LogOptions o;
    o.on_step = 0;
    o.on_epoch = 1;
    o.reduce = reduce;
    for (const auto& [v, bs] : values) store.log("m", at::scalar_tensor(v, at::kFloat), o, ember::Stage::fit, bs);
    expect_same_bits(tensor_reference(values, reduce), epoch_value(store, "m"));
  }
}

TEST(MetricStore, NumbersAndTensorsAccumulateAlike) {
  const auto values = random_values(300, 11);
  MetricStore tensors, numbers;
  ember::LogOptions o;
  o.on_step = 1;
  o.on_epoch = 1;  // -> m_step and m_epoch
  for (const auto& [v, bs] : values) {
    tensors.log("m", at::scalar_tensor(v, at::kFloat), o, ember::Stage::fit, bs);
    numbers.log("m", static_cast<double>(v), o, ember::Stage::fit, bs);
  }
  const auto step_t = tensors.take_step_values(), step_n = numbers.take_step_values();
  ASSERT_EQ(step_t.size(), 1u);
  EXPECT_EQ(step_t, step_n);
  EXPECT_EQ(step_t[0].first, "m_step");
  EXPECT_EQ(step_t[0].second, static_cast<double>(values.back().value));
  const double expected = tensor_reference(values, ember::Reduce::mean);
  EXPECT_EQ(expected, epoch_value(tensors, "m_epoch"));
  EXPECT_EQ(expected, epoch_value(numbers, "m_epoch"));
  EXPECT_EQ(expected, *tensors.get("m"));  // the plain name follows the latest reduction
}

// NaN wins max/min, as at::maximum / at::minimum decide it.
TEST(MetricStore, NanWinsExtremesAsInATen) {
  for (auto reduce : {ember::Reduce::max, ember::Reduce::min}) {
    for (size_t at_index : {0u, 2u, 4u}) {
      std::vector<Logged> values = {{1.f, 1}, {5.f, 1}, {-2.f, 1}, {3.f, 1}, {0.5f, 1}};
      values[at_index].value = std::numeric_limits<float>::quiet_NaN();
      MetricStore store;
      ember::LogOptions o;
      o.on_step = 0;
      o.on_epoch = 1;
      o.reduce = reduce;
      for (const auto& [v, bs] : values) store.log("m", at::scalar_tensor(v, at::kFloat), o, ember::Stage::fit, bs);
      const double got = epoch_value(store, "m");
      EXPECT_TRUE(std::isnan(got)) << got;
      expect_same_bits(tensor_reference(values, reduce), got);
    }
  }
}

// sync_dist: the reducer still sees a double tensor holding the accumulated sum and the weight.
TEST(MetricStore, SyncDistReducesTheHostSumAsATensor) {
  const auto values = random_values(50, 3);
  MetricStore store;
  ember::LogOptions o;
  o.on_step = 0;
  o.on_epoch = 1;
  o.sync_dist = true;
  for (const auto& [v, bs] : values) store.log("m", at::scalar_tensor(v, at::kFloat), o, ember::Stage::fit, bs);
  std::vector<double> seen;
  // Two ranks with the same values: sums and weights double, the mean stays.
  auto two_ranks = [&](const at::Tensor& t, ember::ReduceOp op) {
    EXPECT_EQ(op, ember::ReduceOp::sum);
    EXPECT_EQ(t.scalar_type(), at::kDouble);
    seen.push_back(t.item<double>());
    return t * 2;
  };
  const double got = epoch_value(store, "m", two_ranks);
  ASSERT_EQ(seen.size(), 2u);
  double weight = 0;
  for (const auto& l : values) weight += static_cast<double>(l.batch_size);
  EXPECT_EQ(seen[1], weight);
  EXPECT_EQ(got, tensor_reference(values, ember::Reduce::mean));
}

TEST(MetricStore, RefusesNonScalars) {
  MetricStore store;
  EXPECT_THROW(store.log("m", at::ones({2}), {}, ember::Stage::fit, 1), std::invalid_argument);
}

// The CPU accuracy count gives ATen's value on every dtype a model's logits can have, with ties
// and NaNs (argmax takes the first largest, NaN as the largest) and strided logits.
TEST(ClassificationAccuracy, CpuCountMatchesArgmaxMean) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    for (int64_t n : {1, 3, 7, 32, 33, 100}) {
      for (int64_t c : {1, 2, 10}) {
        // Few distinct values: many ties.
        at::Tensor logits = at::randint(0, 3, {n, c}, gen).to(dtype);
        if (n > 3) {
          logits[1][c - 1] = std::numeric_limits<float>::quiet_NaN();
          logits[2].fill_(std::numeric_limits<float>::quiet_NaN());
        }
        const at::Tensor labels = at::randint(0, c, {n}, gen);
        const double expected = (logits.argmax(1) == labels).to(at::kFloat).mean().item<double>();
        EXPECT_EQ(expected, ember_models::cpu_accuracy(logits, labels)) << dtype << " n=" << n << " c=" << c;
        const at::Tensor strided = at::stack({logits, logits}, 2).select(2, 0);  // the same values, strided
        EXPECT_EQ(expected, ember_models::cpu_accuracy(strided, labels));
      }
    }
  }
}
