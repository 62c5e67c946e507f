#include "ember/distributed/pipeline_schedule.h"

#include <algorithm>
#include <limits>
#include <map>
#include <stdexcept>
#include <tuple>

namespace ember_dist {

const char* schedule_name(PipelineScheduleKind kind) {
  switch (kind) {
    case PipelineScheduleKind::gpipe: return "gpipe";
    case PipelineScheduleKind::one_f_one_b: return "1f1b";
    case PipelineScheduleKind::interleaved_1f1b: return "interleaved_1f1b";
  }
  return "?";
}

bool parse_schedule(const std::string& name, PipelineScheduleKind* kind) {
  for (auto k : {PipelineScheduleKind::gpipe, PipelineScheduleKind::one_f_one_b, PipelineScheduleKind::interleaved_1f1b})
    if (name == schedule_name(k)) {
      *kind = k;
      return true;
    }
  return false;
}

namespace {

std::vector<PipelineAction> one_f_one_b(int64_t p, int64_t m, int64_t r) {
  std::vector<PipelineAction> out;
  const int64_t warmup = std::min(p - r - 1, m);
  for (int64_t i = 0; i < warmup; ++i) out.push_back({false, i, r});
  for (int64_t i = 0; i < m - warmup; ++i) {
    out.push_back({false, warmup + i, r});
    out.push_back({true, i, r});
  }
  for (int64_t i = m - warmup; i < m; ++i) out.push_back({true, i, r});
  return out;
}

// Megatron-LM's interleaved order: the k-th forward on a rank is micro-batch (k / pv) p + k % p of
// its chunk (k / p) % v; backwards walk the chunks the other way.
std::vector<PipelineAction> interleaved(int64_t p, int64_t m, int64_t v, int64_t r) {
  const int64_t total = m * v;
  auto forward = [&](int64_t k) {
    const int64_t chunk = (k / p) % v;
    return PipelineAction{false, (k / (p * v)) * p + k % p, chunk * p + r};
  };
  auto backward = [&](int64_t k) {
    const int64_t chunk = v - 1 - (k / p) % v;
    return PipelineAction{true, (k / (p * v)) * p + k % p, chunk * p + r};
  };
  int64_t warmup = m == p ? total : std::min(total, (p - r - 1) * 2 + (v - 1) * p);
  std::vector<PipelineAction> out;
  for (int64_t k = 0; k < warmup; ++k) out.push_back(forward(k));
  const int64_t steady = total - warmup;
  for (int64_t k = 0; k < steady; ++k) {
    out.push_back(forward(warmup + k));
    out.push_back(backward(k));
  }
  for (int64_t k = steady; k < total; ++k) out.push_back(backward(k));
  return out;
}

}  // namespace

std::vector<std::vector<PipelineAction>> pipeline_schedule(PipelineScheduleKind kind, int64_t p, int64_t m, int64_t v) {
  if (p < 1 || m < 1 || v < 1) throw std::invalid_argument("pipeline_schedule: ranks, micro-batches and stages per rank must be >= 1");
  if (kind != PipelineScheduleKind::interleaved_1f1b && v != 1)
    throw std::invalid_argument(std::string("pipeline_schedule: ") + schedule_name(kind) + " runs one stage per rank");
  if (kind == PipelineScheduleKind::interleaved_1f1b && m % p != 0)
    throw std::invalid_argument("pipeline_schedule: interleaved_1f1b needs the micro-batches divisible by the ranks");
  std::vector<std::vector<PipelineAction>> out(static_cast<size_t>(p));
  for (int64_t r = 0; r < p; ++r) {
    auto& actions = out[static_cast<size_t>(r)];
    switch (kind) {
      case PipelineScheduleKind::gpipe:
        for (int64_t i = 0; i < m; ++i) actions.push_back({false, i, r});
        for (int64_t i = 0; i < m; ++i) actions.push_back({true, i, r});
        break;
      case PipelineScheduleKind::one_f_one_b: actions = one_f_one_b(p, m, r); break;
      case PipelineScheduleKind::interleaved_1f1b: actions = interleaved(p, m, v, r); break;
    }
  }
  return out;
}

PipelineSimulation simulate_pipeline(const std::vector<std::vector<PipelineAction>>& schedule, int64_t m, int64_t v, double forward,
                                     double backward) {
  const int64_t p = static_cast<int64_t>(schedule.size());
  const int64_t stages = p * v;
  // When each (kind, micro-batch, stage) finished; absent: not yet.
  std::map<std::tuple<bool, int64_t, int64_t>, double> done;
  std::vector<size_t> next(static_cast<size_t>(p), 0);
  std::vector<double> clock(static_cast<size_t>(p), 0.0);
  std::vector<int64_t> alive(static_cast<size_t>(p), 0);
  PipelineSimulation sim;
  double busy = 0;
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (int64_t r = 0; r < p; ++r) {
      auto& k = next[static_cast<size_t>(r)];
      while (k < schedule[static_cast<size_t>(r)].size()) {
        const auto& a = schedule[static_cast<size_t>(r)][k];
        // What the action waits for: the previous stage's forward, the next stage's backward, and
        // (a backward) this stage's own forward.
        double ready = clock[static_cast<size_t>(r)];
        bool can = true;
        auto need = [&](bool bwd, int64_t stage) {
          auto it = done.find({bwd, a.microbatch, stage});
          if (it == done.end()) can = false;
          else ready = std::max(ready, it->second);
        };
        if (!a.backward && a.stage > 0) need(false, a.stage - 1);
        if (a.backward) {
          need(false, a.stage);
          if (a.stage < stages - 1) need(true, a.stage + 1);
        }
        if (!can) break;
        const double cost = a.backward ? backward : forward;
        clock[static_cast<size_t>(r)] = ready + cost;
        busy += cost;
        done[{a.backward, a.microbatch, a.stage}] = ready + cost;
        auto& live = alive[static_cast<size_t>(r)];
        live += a.backward ? -1 : 1;
        sim.peak_alive = std::max(sim.peak_alive, live);
        ++k;
        progressed = true;
      }
    }
  }
  for (int64_t r = 0; r < p; ++r)
    if (next[static_cast<size_t>(r)] < schedule[static_cast<size_t>(r)].size()) sim.deadlock = true;
  if (sim.deadlock) return sim;
  sim.makespan = *std::max_element(clock.begin(), clock.end());
  sim.bubble = sim.makespan > 0 ? 1.0 - busy / (static_cast<double>(p) * sim.makespan) : 0.0;
  (void)m;
  return sim;
}

double theoretical_bubble(PipelineScheduleKind kind, int64_t p, int64_t m, int64_t v) {
  const double pm1 = static_cast<double>(p - 1);
  if (kind == PipelineScheduleKind::interleaved_1f1b) return pm1 / (static_cast<double>(v * m) + pm1);
  return pm1 / (static_cast<double>(m) + pm1);
}

std::vector<int64_t> balance_stages(const std::vector<int64_t>& w, int64_t stages) {
  const int64_t n = static_cast<int64_t>(w.size());
  if (stages < 1 || stages > n) throw std::invalid_argument("balance_stages: need 1 <= stages <= units");
  // best[s][i]: the lightest heaviest run cutting units [0, i) into s runs; cut[s][i]: where the
  // last of them begins.
  std::vector<int64_t> prefix(static_cast<size_t>(n + 1), 0);
  for (int64_t i = 0; i < n; ++i) prefix[static_cast<size_t>(i + 1)] = prefix[static_cast<size_t>(i)] + w[static_cast<size_t>(i)];
  const int64_t inf = std::numeric_limits<int64_t>::max();
  std::vector<std::vector<int64_t>> best(static_cast<size_t>(stages + 1), std::vector<int64_t>(static_cast<size_t>(n + 1), inf));
  std::vector<std::vector<int64_t>> cut(best.size(), std::vector<int64_t>(static_cast<size_t>(n + 1), 0));
  best[0][0] = 0;
  for (int64_t s = 1; s <= stages; ++s)
    for (int64_t i = s; i <= n; ++i)
      for (int64_t j = s - 1; j < i; ++j) {
        const int64_t prev = best[static_cast<size_t>(s - 1)][static_cast<size_t>(j)];
        if (prev == inf) continue;
        const int64_t worst = std::max(prev, prefix[static_cast<size_t>(i)] - prefix[static_cast<size_t>(j)]);
        // Ties: the later cut, so earlier stages (which also hold the embeddings) take fewer units.
        if (worst <= best[static_cast<size_t>(s)][static_cast<size_t>(i)]) {
          best[static_cast<size_t>(s)][static_cast<size_t>(i)] = worst;
          cut[static_cast<size_t>(s)][static_cast<size_t>(i)] = j;
        }
      }
  std::vector<int64_t> sizes(static_cast<size_t>(stages));
  for (int64_t s = stages, i = n; s >= 1; --s) {
    const int64_t j = cut[static_cast<size_t>(s)][static_cast<size_t>(i)];
    sizes[static_cast<size_t>(s - 1)] = i - j;
    i = j;
  }
  return sizes;
}

}  // namespace ember_dist
