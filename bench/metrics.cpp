// What the [metrics] table costs (bench/metrics.sh): the metrics' update on every training step
// and their compute once per log window, as a fraction of the step they ride on, for models/cnn's
// Fashion-MNIST CNN (batch 128) and a tiny MLP (32 -> 32 -> 10, batch 32, where any per-step cost
// shows); and the state each AUROC keeps as the samples grow (binned: constant; exact: linear).
// The variants run interleaved, `rounds` times; the median of each is reported.
#include <torch/torch.h>

#include <ember/support/metrics.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "overhead_nets.h"

namespace m = ember::metrics;
namespace {

double seconds(const std::function<void()>& f, int reps) {
  const auto t = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count() / reps;
}
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The table of the README's example: accuracy, macro-F1, AUROC and the confusion matrix.
m::MetricCollection table(int64_t classes, int64_t thresholds) {
  m::MetricCollection c;
  for (const char* name : {"accuracy", "f1", "auroc"}) {
    m::MetricSpec s;
    s.name = name;
    s.num_classes = classes;
    s.thresholds = thresholds;
    s.scores = m::Scores::logits;
    c.add(name, m::make_metric(s));
  }
  c.add("confusion_matrix", std::make_unique<m::ConfusionMatrix>(classes));
  return c;
}

template <class Model>
void compare(const char* name, Model net, at::Tensor x, at::Tensor y, int rounds, int steps) {
  torch::optim::Adam opt(net->parameters(), 1e-3);
  at::Tensor logits;
  auto step = [&] {
    opt.zero_grad();
    logits = net->forward(x);
    torch::cross_entropy_loss(logits, y).backward();
    opt.step();
  };
  for (int i = 0; i < 5; ++i) step();  // warm-up
  std::vector<double> step_s, binned_s, exact_s;
  for (int r = 0; r < rounds; ++r) {
    step_s.push_back(seconds(step, steps));
    for (int64_t thresholds : {200, 0}) {
      auto metrics = table(10, thresholds);
      // update every step, compute (and reset) once per 50 steps: trainer.log_every_n_steps'
      // default and metrics.on_step's window.
      int64_t k = 0;
      const double s = seconds([&] {
        metrics.update(logits.detach(), y);
        if (++k % 50 == 0) {
          (void)metrics.compute();
          metrics.reset();
        }
      }, steps);
      (thresholds ? binned_s : exact_s).push_back(s);
    }
  }
  const double st = median(step_s), b = median(binned_s), e = median(exact_s);
  std::printf("| %s | %.3f ms | %.1f us (%.2f%%) | %.1f us (%.2f%%) |\n", name, st * 1e3, b * 1e6, 100 * b / st, e * 1e6, 100 * e / st);
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 3;
  torch::manual_seed(0);
  std::printf("| model (step) | step | accuracy + f1 + auroc (200 bins) + confusion matrix | the same with exact auroc |\n|---|---|---|---|\n");
  compare("cnn, batch 128", Net(), torch::randn({128, 1, 28, 28}), torch::randint(0, 10, {128}, at::kLong), rounds, 20);
  compare("mlp 32-32-10, batch 32", Mlp(), torch::randn({32, 32}), torch::randint(0, 10, {32}, at::kLong), rounds, 400);

  // The state an AUROC keeps, as the samples grow (10 classes).
  std::printf("\n| samples | binned auroc state (200 bins) | exact auroc state |\n|---|---|---|\n");
  for (int64_t n : {1'000, 10'000, 100'000, 1'000'000}) {
    m::BinnedCurve binned(m::CurveKind::auroc, m::Task::multiclass, 10, m::Average::macro, 200, m::Scores::logits);
    m::ExactCurve exact(m::CurveKind::auroc, m::Task::multiclass, 10, m::Average::macro, 2'000'000, m::Scores::logits);
    for (int64_t done = 0; done < n; done += 10'000) {
      const int64_t b = std::min<int64_t>(10'000, n - done);
      const at::Tensor s = torch::randn({b, 10}), t = torch::randint(0, 10, {b}, at::kLong);
      binned.update(s, t);
      exact.update(s, t);
    }
    std::printf("| %lld | %.1f KB | %.1f KB |\n", static_cast<long long>(n), binned.state_bytes() / 1024.0,
                exact.state_bytes() / 1024.0);
  }
  return 0;
}
