// <ember/support/metrics.h>: metrics computed from states whose reduction across ranks is
// declared, so the value over shards (ranks) is the value over the whole data. Expected values are
// worked out by hand (and agree with scikit-learn's for the same inputs: r2_score's documented
// example, roc_auc_score's).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <ember/support/metrics.h>

namespace m = ember::metrics;

namespace {
// 6 samples, 4 classes: (target, predicted) = (0,0) (1,2) (1,1) (3,3) (2,1) (0,0).
const at::Tensor kPred = at::tensor({0, 2, 1, 3, 1, 0}, at::kLong);
const at::Tensor kTarget = at::tensor({0, 1, 1, 3, 2, 0}, at::kLong);

double score(std::unique_ptr<m::ClassificationScore> metric, const at::Tensor& p = kPred, const at::Tensor& t = kTarget) {
  metric->update(p, t);
  return metric->compute();
}
}  // namespace

TEST(Metrics, MulticlassScoresAveragedEveryWay) {
  EXPECT_NEAR(score(m::accuracy(4)), 4.0 / 6, 1e-12);
  EXPECT_NEAR(score(m::accuracy(4, m::Average::macro)), 0.625, 1e-12);  // mean per-class recall
  EXPECT_NEAR(score(m::precision(4, m::Average::macro)), 0.625, 1e-12);
  EXPECT_NEAR(score(m::precision(4, m::Average::weighted)), 4.0 / 6, 1e-12);
  EXPECT_NEAR(score(m::recall(4, m::Average::macro)), 0.625, 1e-12);
  EXPECT_NEAR(score(m::f1(4, m::Average::macro)), 0.625, 1e-12);
  EXPECT_NEAR(score(m::f1(4, m::Average::micro)), 4.0 / 6, 1e-12);
  EXPECT_NEAR(score(m::specificity(4, m::Average::macro)), (1 + 0.75 + 0.8 + 1) / 4, 1e-12);
  auto per = m::f1(4, m::Average::none);
  per->update(kPred, kTarget);
  EXPECT_TRUE(at::allclose(per->per_class(), at::tensor({1.0, 0.5, 0.0, 1.0}, at::kDouble)));
  // Scores [N, C] give the same as their arg-max.
  EXPECT_NEAR(score(m::f1(4), at::one_hot(kPred, 4).to(at::kFloat) * 3 - 1), 0.625, 1e-12);
  // The confusion matrix: rows are targets, columns predictions.
  m::ConfusionMatrix cm(4);
  cm.update(kPred, kTarget);
  EXPECT_TRUE(at::equal(cm.matrix(), at::tensor({2, 0, 0, 0, 0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 1}, at::kLong).reshape({4, 4})));
  // ignore_index leaves the samples of that target out (here class 3's one sample).
  m::ClassificationScore ignoring(m::ClassificationScore::Kind::accuracy, 4, m::Average::micro, 1.0, /*ignore_index=*/3);
  ignoring.update(kPred, kTarget);
  EXPECT_NEAR(ignoring.compute(), 3.0 / 5, 1e-12);
}

// The point of declared reductions: three shards merged (what sync() does across three ranks)
// give the whole data's value, where the mean of the shards' F1 would not.
TEST(Metrics, ShardsMergedEqualTheWholeAndSyncReducesEveryState) {
  at::manual_seed(3);
  const at::Tensor logits = at::randn({301, 5});
  const at::Tensor target = at::randint(0, 5, {301}, at::kLong);
  auto whole = m::f1(5);
  whole->update(logits, target);
  std::vector<std::unique_ptr<m::ClassificationScore>> shards;
  double mean_of_shards = 0;
  for (int64_t r = 0; r < 3; ++r) {
    shards.push_back(m::f1(5));
    const at::Tensor idx = at::arange(r, 301, 3, at::kLong);
    shards.back()->update(logits.index_select(0, idx), target.index_select(0, idx));
    mean_of_shards += shards.back()->compute() / 3;
  }
  shards[0]->merge(*shards[1]);
  shards[0]->merge(*shards[2]);
  EXPECT_NEAR(shards[0]->compute(), whole->compute(), 1e-12);
  EXPECT_GT(std::abs(mean_of_shards - whole->compute()), 1e-6) << "averaging per shard would have been wrong";
  // sync() through a reducer standing for two ranks with the same data: counts double, F1 stays.
  const double before = whole->compute();
  const at::Tensor matrix = whole->matrix();
  whole->sync([](const at::Tensor& t, ember::ReduceOp op) { return op == ember::ReduceOp::sum ? t * 2 : t; });
  EXPECT_TRUE(at::equal(whole->matrix(), matrix * 2));
  EXPECT_NEAR(whole->compute(), before, 1e-12);
  whole->reset();
  EXPECT_EQ(whole->matrix().sum().item<int64_t>(), 0);
}

TEST(Metrics, BinnedAurocMatchesTheExactArea) {
  // scikit-learn: roc_auc_score([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]) = 0.75.
  m::BinnedAuroc small(1001);
  small.update(at::tensor({0.1, 0.4, 0.35, 0.8}), at::tensor({0, 0, 1, 1}));
  EXPECT_NEAR(small.compute(), 0.75, 1e-12);
  // Random scores against the exact area (the share of positive-negative pairs ordered right).
  at::manual_seed(7);
  const at::Tensor p = at::rand({2000}, at::kDouble);
  const at::Tensor t = (at::rand({2000}, at::kDouble) < p).to(at::kLong);  // informative scores
  const at::Tensor pos = p.masked_select(t.to(at::kBool)), neg = p.masked_select(t.to(at::kBool).logical_not());
  const double exact = (pos.unsqueeze(1) > neg.unsqueeze(0)).to(at::kDouble).mean().item<double>();
  m::BinnedAuroc binned(10000);
  binned.update(p.narrow(0, 0, 1000), t.narrow(0, 0, 1000));
  binned.update(p.narrow(0, 1000, 1000), t.narrow(0, 1000, 1000));
  EXPECT_NEAR(binned.compute(), exact, 1e-3);
  EXPECT_GT(exact, 0.7);
}

TEST(Metrics, RegressionPerplexityAndAggregates) {
  // scikit-learn's r2_score example: y_true [3, -0.5, 2, 7], y_pred [2.5, 0.0, 2, 8].
  const at::Tensor y = at::tensor({3.0, -0.5, 2.0, 7.0}), yhat = at::tensor({2.5, 0.0, 2.0, 8.0});
  auto value = [&](m::Regression::Kind k) {
    m::Regression r(k);
    r.update(yhat.narrow(0, 0, 2), y.narrow(0, 0, 2));
    r.update(yhat.narrow(0, 2, 2), y.narrow(0, 2, 2));
    return r.compute();
  };
  EXPECT_NEAR(value(m::Regression::Kind::mae), 0.5, 1e-12);
  EXPECT_NEAR(value(m::Regression::Kind::mse), 0.375, 1e-12);
  EXPECT_NEAR(value(m::Regression::Kind::rmse), std::sqrt(0.375), 1e-12);
  EXPECT_NEAR(value(m::Regression::Kind::r2), 0.9486081370449679, 1e-12);
  // Uniform logits over 4 tokens: perplexity 4; the ignored token changes nothing.
  m::Perplexity ppl(-100);
  ppl.update(at::zeros({2, 3, 4}), at::tensor({0, 1, 2, 3, -100, 1}, at::kLong).reshape({2, 3}));
  EXPECT_NEAR(ppl.compute(), 4.0, 1e-9);
  m::Aggregate mean(m::Aggregate::Kind::mean), mx(m::Aggregate::Kind::max);
  mean.update(at::tensor({1.0, 3.0}), at::tensor({1.0, 3.0}));  // weighted: (1 + 9) / 4
  mx.update(at::tensor({1.0, 3.0}), at::Tensor());
  EXPECT_NEAR(mean.compute(), 2.5, 1e-12);
  EXPECT_EQ(mx.compute(), 3.0);
  m::Aggregate empty(m::Aggregate::Kind::mean);
  EXPECT_TRUE(std::isnan(empty.compute()));
}
