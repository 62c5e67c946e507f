// <ember/support/metrics.h>: metrics computed from states whose reduction across ranks is
// declared, so the value over shards (ranks) is the value over the whole data. Expected values are
// worked out by hand, and every built-in is checked against scikit-learn on data that
// tests/reference/sklearn_metrics.py generates (with edge cases: a class absent from the targets,
// one class only, tied scores).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <ember/support/metrics.h>

#include <condition_variable>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#ifdef EMBER_TEST_PYTHON
#include <nlohmann/json.hpp>

#include "support.h"
using ember::test::run_process;
using ember::test::source_dir;
using ember::test::TempDir;
#endif

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

TEST(Metrics, TopKAndCalibrationAndSyncOfExactCurvesAcrossRanks) {
  // Top-2: the target among the two highest scores.
  const at::Tensor scores = at::tensor({0.5, 0.3, 0.2, 0.1, 0.6, 0.3, 0.2, 0.3, 0.5}, at::kDouble).reshape({3, 3});
  m::TopKAccuracy top2(3, 2);
  // Row 0: target 1 scores 0.3, second: a hit. Row 1: target 2 scores 0.3, second to 0.6: a hit.
  // Row 2: target 0 scores 0.2, last: a miss.
  top2.update(scores, at::tensor({1, 2, 0}, at::kLong));
  EXPECT_NEAR(top2.compute(), 2.0 / 3, 1e-12);
  EXPECT_THROW(m::TopKAccuracy(3, 4), ember::RunError);
  // Perfectly calibrated bins: confidence 0.75 with 3 of 4 right gives no gap.
  m::CalibrationError ece(m::Task::binary, 10);
  ece.update(at::tensor({0.75, 0.75, 0.75, 0.75}, at::kDouble), at::tensor({1, 1, 1, 0}, at::kLong));
  EXPECT_NEAR(ece.compute(), 0.0, 1e-12);
  ece.update(at::tensor({0.95}, at::kDouble), at::tensor({0}, at::kLong));  // one bin off by 0.95, a fifth of the samples
  EXPECT_NEAR(ece.compute(), 0.95 / 5, 1e-12);
  // Exact AUROC over three "ranks" of different sizes, synced through a reducer that stands for
  // them (each rank's sync contributes its rows at its offset): the value over the whole data.
  at::manual_seed(11);
  const at::Tensor p = at::rand({103}, at::kDouble), t = (at::rand({103}, at::kDouble) < p).to(at::kLong);
  m::ExactCurve whole(m::CurveKind::auroc, m::Task::binary);
  whole.update(p, t);
  std::vector<std::unique_ptr<m::ExactCurve>> ranks;
  const int64_t cuts[] = {0, 10, 60, 103};
  for (int r = 0; r < 3; ++r) {
    ranks.push_back(std::make_unique<m::ExactCurve>(m::CurveKind::auroc, m::Task::binary));
    ranks.back()->update(p.narrow(0, cuts[r], cuts[r + 1] - cuts[r]), t.narrow(0, cuts[r], cuts[r + 1] - cuts[r]));
  }
  // Two passes of a real all-reduce: every rank hands in its tensor, then every rank reads the sum.
  // Here the sums are made by running the three syncs' collectives in lock step on threads.
  std::vector<std::vector<at::Tensor>> calls(3);
  std::mutex mu;
  std::condition_variable cv;
  int64_t arrived = 0, generation = 0;
  std::vector<at::Tensor> slot(3);
  at::Tensor result;
  auto reducer_for = [&](int r) {
    return [&, r](const at::Tensor& x, ember::ReduceOp op) {
      std::unique_lock lock(mu);
      const int64_t gen = generation;
      slot[static_cast<size_t>(r)] = x;
      if (++arrived == 3) {
        result = op == ember::ReduceOp::sum ? slot[0] + slot[1] + slot[2] : at::maximum(at::maximum(slot[0], slot[1]), slot[2]);
        arrived = 0;
        ++generation;
        cv.notify_all();
      } else {
        cv.wait(lock, [&] { return generation != gen; });
      }
      return result.clone();
    };
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r)
    threads.emplace_back([&, r] { ranks[static_cast<size_t>(r)]->sync(m::SyncGroup{reducer_for(r), r, 3}); });
  for (auto& th : threads) th.join();
  for (const auto& r : ranks) EXPECT_NEAR(r->compute(), whole.compute(), 1e-12);
  // A bound on what an exact curve keeps: a one-line error that says what to do.
  m::ExactCurve bounded(m::CurveKind::auroc, m::Task::binary, 2, m::Average::macro, /*max_samples=*/50);
  try {
    bounded.update(p, t);
    FAIL() << "an exact curve past max_samples must throw";
  } catch (const ember::RunError& e) {
    EXPECT_NE(std::string(e.what()).find("thresholds"), std::string::npos) << e.what();
  }
  // A tensor-parallel peer (contributes = false) takes part with empty states.
  m::ConfusionMatrix counted(3), peer(3);
  counted.update(at::tensor({0, 1, 2}, at::kLong), at::tensor({0, 1, 1}, at::kLong));
  peer.update(at::tensor({0, 1, 2}, at::kLong), at::tensor({0, 1, 1}, at::kLong));
  peer.sync(m::SyncGroup{[](const at::Tensor& x, ember::ReduceOp) { return x; }, 1, 2, /*contributes=*/false});
  EXPECT_EQ(peer.matrix().sum().item<int64_t>(), 0);
}

#ifdef EMBER_TEST_PYTHON
TEST(Metrics, EveryBuiltInEqualsScikitLearnIncludingEdgeCases) {
  TempDir dir("sklearn_metrics");
  const auto json_path = dir / "cases.json";
  auto r = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/reference/sklearn_metrics.py").string(), json_path.string()},
                       dir.path(), {}, 600);
  ASSERT_EQ(r.exit_code, 0) << "scripts/setup.sh installs scikit-learn into the LibTorch venv\n" << r.err;
  std::ifstream f(json_path);
  const auto cases = nlohmann::json::parse(f);
  int64_t compared = 0;
  for (const auto& c : cases) {
    const std::string name = c["name"], task = c["task"];
    auto tensor = [](const nlohmann::json& values, const nlohmann::json& shape, at::ScalarType dtype) {
      std::vector<double> v = values.get<std::vector<double>>();
      return at::tensor(v, at::kDouble).reshape(shape.get<std::vector<int64_t>>()).to(dtype);
    };
    const at::Tensor preds = tensor(c["preds"], c["pred_shape"], at::kDouble);
    const at::Tensor target = tensor(c["target"], c["target_shape"], task == "regression" ? at::kDouble : at::kLong);
    for (const auto& [key, value] : c["expect"].items()) {
      // "f1 macro", "fbeta2 weighted", "accuracy top2", "auroc binned101", "calibration_error l2", "mae".
      std::istringstream words(key);
      std::string metric, setting;
      words >> metric >> setting;
      m::MetricSpec spec;
      spec.name = metric;
      spec.task = task == "regression" ? m::Task::multiclass : m::parse_task(task);
      spec.num_classes = c["classes"].get<int64_t>();
      if (setting == "top2") spec.top_k = 2, spec.average = m::Average::micro;
      else if (setting.starts_with("binned")) spec.thresholds = std::stoll(setting.substr(6));
      else if (setting == "l1" || setting == "l2" || setting == "max")
        spec.norm = setting == "l1" ? m::CalibrationError::Norm::l1 : setting == "l2" ? m::CalibrationError::Norm::l2 : m::CalibrationError::Norm::max;
      else if (!setting.empty()) spec.average = m::parse_average(setting);
      if (metric == "fbeta2") spec.name = "fbeta", spec.beta = 2.0;
      auto metric_obj = m::make_metric(spec);
      // Two updates (the data split in two batches): the states must add up.
      const int64_t half = preds.size(0) / 2;
      metric_obj->update(preds.narrow(0, 0, half), target.narrow(0, 0, half));
      metric_obj->update(preds.narrow(0, half, preds.size(0) - half), target.narrow(0, half, target.size(0) - half));
      const double got = metric_obj->compute();
      if (value.is_null() || (value.is_number() && std::isnan(value.get<double>()))) {
        EXPECT_TRUE(std::isnan(got)) << name << ": " << key << " is undefined, got " << got;
      } else {
        EXPECT_NEAR(got, value.get<double>(), 1e-6) << name << ": " << key;
      }
      ++compared;
    }
    if (c.contains("confusion_matrix")) {
      m::MetricSpec spec;
      spec.name = "confusion_matrix";
      spec.task = m::parse_task(task);
      spec.num_classes = c["classes"].get<int64_t>();
      auto cm = m::make_metric(spec);
      cm->update(preds, target);
      if (spec.task == m::Task::multilabel) {
        // scikit-learn's multilabel_confusion_matrix: [L, 2, 2] = [[tn, fp], [fn, tp]] per label.
        const at::Tensor expected = at::tensor(c["confusion_matrix"].get<std::vector<int64_t>>(), at::kLong).reshape({spec.num_classes, 2, 2});
        EXPECT_TRUE(at::equal(dynamic_cast<m::MultilabelConfusionMatrix&>(*cm).matrix(), expected)) << name << ": confusion matrices";
      } else {
        const at::Tensor expected = at::tensor(c["confusion_matrix"].get<std::vector<int64_t>>(), at::kLong).reshape({spec.num_classes, -1});
        EXPECT_TRUE(at::equal(dynamic_cast<m::ConfusionMatrix&>(*cm).matrix(), expected)) << name << ": confusion matrix";
      }
      ++compared;
    }
  }
  EXPECT_GT(compared, 100);
}
#endif

// Compute groups: accuracy, F1 and the confusion matrix keep one confusion matrix between them (one
// update, one sync), exact AUROC and average precision one list of scores; the values equal those
// of the metrics updated on their own.
TEST(Metrics, CollectionUpdatesAndSyncsEachComputeGroupOnce) {
  at::manual_seed(2);
  const at::Tensor logits = at::randn({50, 4}), target = at::randint(0, 4, {50}, at::kLong);
  m::MetricCollection c;
  c.add("accuracy", m::accuracy(4));
  c.add("f1", m::f1(4));
  c.add("confusion", std::make_unique<m::ConfusionMatrix>(4));
  c.add("auroc", std::make_unique<m::ExactCurve>(m::CurveKind::auroc, m::Task::multiclass, 4));
  c.add("ap", std::make_unique<m::ExactCurve>(m::CurveKind::average_precision, m::Task::multiclass, 4));
  c.add("f1_ignoring_3", std::make_unique<m::ClassificationScore>(m::ScoreKind::fbeta, 4, m::Average::macro, 1.0, 3));
  EXPECT_EQ(c.distinct().size(), 3u) << "the confusion matrix, the scores, and the matrix that ignores class 3";
  c.update(logits, target);
  int reduces = 0;
  c.sync(m::SyncGroup{[&](const at::Tensor& t, ember::ReduceOp) { ++reduces; return t; }, 0, 1});
  EXPECT_EQ(reduces, 1) << "the sums of every group in one collective (int64 counts; the cat states need none on one rank)";
  const auto values = c.compute();
  auto alone = [&](std::unique_ptr<m::Metric> metric) {
    metric->update(logits, target);
    return metric->compute();
  };
  EXPECT_DOUBLE_EQ(values[0].second, alone(m::accuracy(4)));
  EXPECT_DOUBLE_EQ(values[1].second, alone(m::f1(4)));
  EXPECT_DOUBLE_EQ(values[3].second, alone(std::make_unique<m::ExactCurve>(m::CurveKind::auroc, m::Task::multiclass, 4)));
  EXPECT_DOUBLE_EQ(values[4].second, alone(std::make_unique<m::ExactCurve>(m::CurveKind::average_precision, m::Task::multiclass, 4)));
  EXPECT_DOUBLE_EQ(values[5].second, alone(std::make_unique<m::ClassificationScore>(m::ScoreKind::fbeta, 4, m::Average::macro, 1.0, 3)));
  EXPECT_EQ(static_cast<const m::ConfusionMatrix&>(*c.metrics()[2].second).matrix().sum().item<int64_t>(), 50);
}
