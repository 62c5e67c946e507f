// Closed forms of PyTorch's learning-rate schedules (torch.optim.lr_scheduler), as pure
// functions of the scheduler's position. Header-only and free of the SDK, so the unit tests
// (tests/scheduler_test.cpp) check them against values PyTorch itself produced.
//
// `t` is PyTorch's `last_epoch` after t calls of scheduler.step(): the number of optimizer steps
// (or epochs) already taken, i.e. the index of the step about to run.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace ember::support {

inline constexpr double kPi = 3.14159265358979323846;

// ---- CyclicLR (Smith 2017): triangular, triangular2, exp_range ----------------------------------
enum class CyclicMode { triangular, triangular2, exp_range };

struct CyclicParams {
  double base_lr = 0.0, max_lr = 0.0;
  int64_t step_size_up = 2000, step_size_down = 2000;  // PyTorch: down defaults to up
  CyclicMode mode = CyclicMode::triangular;
  double gamma = 1.0;                                  // exp_range only
  double base_momentum = 0.8, max_momentum = 0.9;
};

// Where in the cycle step t falls: the cycle number (from 1) and the scale factor in [0, 1]
// (0 at the cycle's start, 1 at its peak).
struct CyclicPoint {
  double cycle, scale_factor;
};
inline CyclicPoint cyclic_point(const CyclicParams& p, int64_t t) {
  const double total = static_cast<double>(p.step_size_up + p.step_size_down);
  const double step_ratio = static_cast<double>(p.step_size_up) / total;
  const double cycle = std::floor(1.0 + static_cast<double>(t) / total);
  const double x = 1.0 + static_cast<double>(t) / total - cycle;
  const double scale = x <= step_ratio ? x / step_ratio : (x - 1.0) / (step_ratio - 1.0);
  return {cycle, scale};
}
// scale_fn: per cycle for triangular/triangular2, per iteration for exp_range (PyTorch's
// scale_mode defaults).
inline double cyclic_scale(const CyclicParams& p, const CyclicPoint& c, int64_t t) {
  switch (p.mode) {
    case CyclicMode::triangular: return 1.0;
    case CyclicMode::triangular2: return 1.0 / std::pow(2.0, c.cycle - 1.0);
    case CyclicMode::exp_range: return std::pow(p.gamma, static_cast<double>(t));
  }
  return 1.0;
}
inline double cyclic_lr(const CyclicParams& p, int64_t t) {
  const CyclicPoint c = cyclic_point(p, t);
  return p.base_lr + (p.max_lr - p.base_lr) * c.scale_factor * cyclic_scale(p, c, t);
}
// Momentum moves against the learning rate: max_momentum at the cycle's start.
inline double cyclic_momentum(const CyclicParams& p, int64_t t) {
  const CyclicPoint c = cyclic_point(p, t);
  return p.max_momentum - (p.max_momentum - p.base_momentum) * c.scale_factor * cyclic_scale(p, c, t);
}

// ---- OneCycleLR (Smith & Topin 2018) ------------------------------------------------------------
enum class Anneal { cos, linear };

inline double anneal(Anneal a, double start, double end, double pct) {
  if (a == Anneal::linear) return (end - start) * pct + start;
  const double cos_out = std::cos(kPi * pct) + 1.0;
  return end + (start - end) / 2.0 * cos_out;
}

struct OneCycleParams {
  double max_lr = 0.0;
  int64_t total_steps = 0;
  double pct_start = 0.3;
  Anneal anneal_strategy = Anneal::cos;
  double div_factor = 25.0, final_div_factor = 1e4;
  bool three_phase = false;
  double base_momentum = 0.85, max_momentum = 0.95;
};

struct LrMomentum {
  double lr, momentum;
};

// PyTorch raises for t > total_steps; so does this (the caller turns it into a clear message).
inline LrMomentum one_cycle(const OneCycleParams& p, int64_t t) {
  if (t > p.total_steps)
    throw std::out_of_range("step " + std::to_string(t) + " is past total_steps = " + std::to_string(p.total_steps));
  const double initial_lr = p.max_lr / p.div_factor;
  const double min_lr = initial_lr / p.final_div_factor;
  struct Phase {
    double end_step, start_lr, end_lr, start_m, end_m;
  };
  const double total = static_cast<double>(p.total_steps);
  std::vector<Phase> phases;
  if (p.three_phase) {
    phases = {{p.pct_start * total - 1.0, initial_lr, p.max_lr, p.max_momentum, p.base_momentum},
              {2.0 * p.pct_start * total - 2.0, p.max_lr, initial_lr, p.base_momentum, p.max_momentum},
              {total - 1.0, initial_lr, min_lr, p.max_momentum, p.max_momentum}};
  } else {
    phases = {{p.pct_start * total - 1.0, initial_lr, p.max_lr, p.max_momentum, p.base_momentum},
              {total - 1.0, p.max_lr, min_lr, p.base_momentum, p.max_momentum}};
  }
  const double step = static_cast<double>(t);
  double start_step = 0.0;
  for (size_t i = 0; i < phases.size(); ++i) {
    const Phase& ph = phases[i];
    if (step <= ph.end_step || i + 1 == phases.size()) {
      const double pct = (step - start_step) / (ph.end_step - start_step);
      return {anneal(p.anneal_strategy, ph.start_lr, ph.end_lr, pct),
              anneal(p.anneal_strategy, ph.start_m, ph.end_m, pct)};
    }
    start_step = ph.end_step;
  }
  return {min_lr, p.max_momentum};  // unreachable: the last phase always matches
}

// ---- Linear warmup, then cosine annealing --------------------------------------------------------
// = torch SequentialLR([LinearLR(start_factor, end_factor=1, total_iters=warmup),
//                       CosineAnnealingLR(T_max=total-warmup, eta_min)], milestones=[warmup]),
// and plain CosineAnnealingLR(T_max=total, eta_min) when warmup = 0. After `total` the rate stays
// at eta_min (CosineAnnealingLR would climb again: a run longer than its schedule is a mistake
// more often than a wish).
struct CosineParams {
  double base_lr = 0.0, eta_min = 0.0;
  int64_t warmup = 0, total = 0;
  double warmup_start_factor = 1.0 / 3.0;  // LinearLR's default
};
inline double cosine_warmup(const CosineParams& p, int64_t t) {
  if (t < p.warmup) {
    const double f = p.warmup_start_factor +
                     (1.0 - p.warmup_start_factor) * static_cast<double>(t) / static_cast<double>(p.warmup);
    return p.base_lr * f;
  }
  const int64_t span = p.total - p.warmup;
  if (span <= 0) return p.base_lr;
  const double progress = std::min(1.0, static_cast<double>(t - p.warmup) / static_cast<double>(span));
  return p.eta_min + (p.base_lr - p.eta_min) * (1.0 + std::cos(kPi * progress)) / 2.0;
}

// ---- Linear warmup, then linear decay -------------------------------------------------------------
// transformers' get_linear_schedule_with_warmup (the Trainer's default schedule) with its defaults
// warmup_start_factor = 0 and end_factor = 0: from base_lr * warmup_start_factor up to base_lr over
// `warmup`, then down to base_lr * end_factor at `total`, and there after it. Other factors give
// torch SequentialLR([LinearLR(start, 1, warmup), LinearLR(1, end, total - warmup)], [warmup]).
struct LinearParams {
  double base_lr = 0.0;
  int64_t warmup = 0, total = 0;
  double warmup_start_factor = 0.0, end_factor = 0.0;
};
inline double linear_warmup_decay(const LinearParams& p, int64_t t) {
  if (t < p.warmup)
    return p.base_lr * (p.warmup_start_factor + (1.0 - p.warmup_start_factor) * static_cast<double>(t) / static_cast<double>(p.warmup));
  const int64_t span = p.total - p.warmup;
  if (span <= 0) return p.base_lr;
  const double progress = std::min(1.0, static_cast<double>(t - p.warmup) / static_cast<double>(span));
  return p.base_lr * (1.0 + (p.end_factor - 1.0) * progress);
}

// ---- StepLR --------------------------------------------------------------------------------------
inline double step_lr(double base_lr, int64_t step_size, double gamma, int64_t t) {
  return base_lr * std::pow(gamma, static_cast<double>(t / step_size));
}

// ---- ReduceLROnPlateau ---------------------------------------------------------------------------
// The state machine of torch.optim.lr_scheduler.ReduceLROnPlateau.step(metrics).
struct PlateauParams {
  bool mode_max = false;
  double factor = 0.1;
  int64_t patience = 10;
  double threshold = 1e-4;
  bool threshold_abs = false;
  int64_t cooldown = 0;
  std::vector<double> min_lrs;  // one per param group (a single value applies to all)
  double eps = 1e-8;
};

struct PlateauState {
  double best = std::numeric_limits<double>::infinity();  // mode min; -inf for max
  int64_t num_bad_epochs = 0;
  int64_t cooldown_counter = 0;
  int64_t last_epoch = 0;

  static PlateauState initial(const PlateauParams& p) {
    PlateauState s;
    s.best = p.mode_max ? -std::numeric_limits<double>::infinity() : std::numeric_limits<double>::infinity();
    return s;
  }
};

inline bool plateau_is_better(const PlateauParams& p, double a, double best) {
  if (!p.mode_max && !p.threshold_abs) return a < best * (1.0 - p.threshold);
  if (!p.mode_max && p.threshold_abs) return a < best - p.threshold;
  if (p.mode_max && !p.threshold_abs) return a > best * (p.threshold + 1.0);
  return a > best + p.threshold;
}

// One step with the monitored value; updates `lrs` in place. Returns true when it reduced them.
inline bool plateau_step(const PlateauParams& p, PlateauState& s, double current, std::vector<double>& lrs) {
  s.last_epoch += 1;
  if (plateau_is_better(p, current, s.best)) {
    s.best = current;
    s.num_bad_epochs = 0;
  } else {
    s.num_bad_epochs += 1;
  }
  if (s.cooldown_counter > 0) {
    s.cooldown_counter -= 1;
    s.num_bad_epochs = 0;
  }
  bool reduced = false;
  if (s.num_bad_epochs > p.patience) {
    for (size_t i = 0; i < lrs.size(); ++i) {
      const double min_lr = p.min_lrs.empty() ? 0.0 : p.min_lrs[std::min(i, p.min_lrs.size() - 1)];
      const double new_lr = std::max(lrs[i] * p.factor, min_lr);
      if (lrs[i] - new_lr > p.eps) {
        lrs[i] = new_lr;
        reduced = true;
      }
    }
    s.cooldown_counter = p.cooldown;
    s.num_bad_epochs = 0;
  }
  return reduced;
}

}  // namespace ember::support
