// The base of every metric in <ember/support/metrics.h>: state tensors, each declared with how it
// combines across ranks, so that the value over N ranks is the value over the whole data set
// (torchmetrics' Metric, in C++). update() folds one batch in, compute() reads the value, reset()
// starts over; sync_metrics() reduces the states of many metrics at once, in one collective per
// reduction and dtype (not one per metric), before compute() on every rank.
//
// States are counts, sums and binned curves (constant memory). `cat` states (the scores an exact
// AUROC sorts) are opt-in and bounded: each declares the most rows it may hold, and an update past
// that throws a one-line error instead of growing without end.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ember/error.h"
#include "ember/trainer.h"
#include "ember/types.h"

namespace ember::metrics {

// How a state combines across ranks (and across shards of the data: merge). `cat` appends rows.
enum class StateReduce { sum, max, min, cat };

// `value` reduced over the ranks, on every rank (ITrainerCollectives::reduce, or a stand-in).
using Reducer = std::function<at::Tensor(const at::Tensor&, ReduceOp)>;

// Who takes part in a sync: the reduction, this rank and the number of ranks (`cat` states place
// each rank's rows at its offset). `contributes` = false for a rank that saw the same samples as
// another (a tensor-parallel peer): it takes part in the collectives with empty states, so no
// sample is counted twice.
struct SyncGroup {
  Reducer reduce;
  int64_t rank = 0;
  int64_t world_size = 1;
  bool contributes = true;
};

class Metric;
void sync_metrics(const std::vector<Metric*>& metrics, const SyncGroup& group);
void broadcast_metrics(const std::vector<Metric*>& metrics, const std::function<at::Tensor(const at::Tensor&)>& broadcast);

class Metric {
 public:
  virtual ~Metric() = default;
  // Folds one batch in. `preds`: scores or class indices as the metric says; `target`: labels or
  // values. Any device; states follow the first batch's device.
  virtual void update(const at::Tensor& preds, const at::Tensor& target) = 0;
  // The value of everything folded in (after a sync: of every rank's data). NaN when undefined
  // (no sample yet, AUROC without a negative sample, ...).
  virtual double compute() const = 0;
  // One value per class or label where the metric has them (average = none), else undefined.
  virtual at::Tensor per_class() const { return {}; }
  // Metrics whose states are equal after the same updates (the confusion matrix behind accuracy,
  // precision, F1...; the scores behind exact AUROC and average precision) return the same key: a
  // MetricCollection then updates and syncs one of them and hands its states to the others
  // (torchmetrics' compute groups). "" = shares with nobody.
  virtual std::string state_key() const { return {}; }
  // Takes `other`'s states (a metric of the same state_key; the tensors are shared, not copied).
  void share_states_of(const Metric& other) {
    if (other.states_.size() != states_.size()) throw RunError("metrics: sharing the states of a metric of another kind");
    for (size_t i = 0; i < states_.size(); ++i) {
      states_[i].value = other.states_[i].value;
      states_[i].chunks = other.states_[i].chunks;
      states_[i].rows = other.states_[i].rows;
    }
  }

  // Bytes the states hold now (a cat state: every row it keeps).
  int64_t state_bytes() const {
    int64_t n = 0;
    for (const auto& s : states_) {
      n += static_cast<int64_t>(s.value.nbytes());
      for (const auto& c : s.chunks) n += static_cast<int64_t>(c.nbytes());
    }
    return n;
  }

  // Back to the state before the first update.
  void reset() {
    for (auto& s : states_) {
      s.value = s.initial.clone();
      s.chunks.clear();
      s.rows = 0;
    }
  }
  // Collective over the run's ranks (every rank calls it with the same metrics).
  void sync(ITrainer& trainer) {
    auto& c = trainer_service<ITrainerCollectives>(trainer, "metrics");
    sync_metrics({this}, {[&](const at::Tensor& t, ReduceOp op) { return c.reduce(t, op); }, trainer.rank(), trainer.world_size()});
  }
  void sync(const SyncGroup& group) { sync_metrics({this}, group); }
  // A reducer standing for ranks that hold the same number of rows (no cat states): tests.
  void sync(const Reducer& reduce) { sync_metrics({this}, {reduce, 0, 1}); }

  // Folds another metric of the same kind and settings in, as a sync across ranks would.
  void merge(const Metric& other) {
    if (other.states_.size() != states_.size()) throw RunError("metrics: merging metrics of different kinds");
    for (size_t i = 0; i < states_.size(); ++i) {
      auto& s = states_[i];
      const auto& o = other.states_[i];
      if (s.reduce == StateReduce::cat) {
        if (o.rows > 0) append(i, other.cat_state(i));
        continue;
      }
      const at::Tensor v = o.value.to(s.value.device());
      if (s.reduce == StateReduce::sum) s.value = s.value + v;
      else if (s.reduce == StateReduce::max) s.value = at::maximum(s.value, v);
      else s.value = at::minimum(s.value, v);
    }
  }

 protected:
  // Registers a state (in the constructor, in a fixed order: a sync pairs states by order).
  // Returns its index for state(). For `cat`, `initial` is an empty tensor of the row shape
  // ([0, ...]) and dtype, and `max_rows` bounds what it may hold (`what_to_do` ends the error).
  size_t add_state(at::Tensor initial, StateReduce reduce, int64_t max_rows = 0, std::string what_to_do = {}) {
    if (reduce == StateReduce::cat && (initial.dim() < 1 || initial.size(0) != 0))
      throw RunError("metrics: a cat state starts empty ([0, ...]), got " + std::string(c10::str(initial.sizes())));
    states_.push_back({initial.clone(), initial.clone(), reduce, {}, 0, max_rows, std::move(what_to_do)});
    return states_.size() - 1;
  }
  at::Tensor& state(size_t i) { return states_[i].value; }
  const at::Tensor& state(size_t i) const { return states_[i].value; }
  // A cat state: appends rows (bounded), and reads them as one tensor.
  void append(size_t i, const at::Tensor& rows) {
    auto& s = states_[i];
    if (s.max_rows > 0 && s.rows + rows.size(0) > s.max_rows)
      throw RunError("metrics: " + std::to_string(s.rows + rows.size(0)) + " samples exceed the " + std::to_string(s.max_rows) +
                     " an exact metric may keep" + (s.what_to_do.empty() ? std::string() : ": " + s.what_to_do));
    s.chunks.push_back(rows.detach().to(s.initial.scalar_type()));
    s.rows += rows.size(0);
  }
  at::Tensor cat_state(size_t i) const {
    const auto& s = states_[i];
    if (s.chunks.empty()) return s.initial.to(s.value.device());
    if (s.chunks.size() > 1) s.chunks = {at::cat(s.chunks)};
    return s.chunks.front();
  }
  // Moves every state to `device` (the first update's).
  void follow(const c10::Device& device) {
    for (auto& s : states_) {
      if (s.value.device() != device) s.value = s.value.to(device);
      for (auto& c : s.chunks)
        if (c.device() != device) c = c.to(device);
    }
  }

 private:
  friend void sync_metrics(const std::vector<Metric*>& metrics, const SyncGroup& group);
  friend void broadcast_metrics(const std::vector<Metric*>& metrics, const std::function<at::Tensor(const at::Tensor&)>& broadcast);
  struct State {
    at::Tensor value, initial;
    StateReduce reduce;
    mutable std::vector<at::Tensor> chunks;  // cat: the rows appended, joined when read
    int64_t rows = 0;
    int64_t max_rows = 0;
    std::string what_to_do;
  };
  std::vector<State> states_;
};

inline ReduceOp reduce_op(StateReduce r) {
  return r == StateReduce::sum ? ReduceOp::sum : r == StateReduce::max ? ReduceOp::max : ReduceOp::min;
}

// Collective: every state of `metrics` reduced over the group's ranks. One reduce per (reduction,
// dtype) for the counts and sums; the cat states take two per dtype (their row counts, then the
// rows placed at each rank's offset and summed). Every rank passes the same metrics in the same
// order.
inline void sync_metrics(const std::vector<Metric*>& metrics, const SyncGroup& group) {
  using State = Metric::State;
  std::vector<State*> fixed, cat;
  for (Metric* m : metrics)
    for (auto& s : m->states_) (s.reduce == StateReduce::cat ? cat : fixed).push_back(&s);
  if (!group.contributes) {
    for (State* s : fixed)
      if (s->reduce == StateReduce::sum) s->value = at::zeros_like(s->value);
    for (State* s : cat) {
      s->chunks.clear();
      s->rows = 0;
    }
  }
  // Counts and sums: flattened into one tensor per (reduction, dtype, device).
  std::map<std::tuple<int, int, std::string>, std::vector<State*>> buckets;
  for (State* s : fixed)
    buckets[{static_cast<int>(s->reduce), static_cast<int>(s->value.scalar_type()), s->value.device().str()}].push_back(s);
  for (auto& [key, states] : buckets) {
    std::vector<at::Tensor> flat;
    for (State* s : states) flat.push_back(s->value.reshape({-1}));
    at::Tensor reduced = group.reduce(at::cat(flat), reduce_op(states.front()->reduce)).to(states.front()->value.device());
    int64_t offset = 0;
    for (State* s : states) {
      s->value = reduced.narrow(0, offset, s->value.numel()).reshape(s->value.sizes()).clone();
      offset += s->value.numel();
    }
  }
  if (cat.empty()) return;
  // Cat states: every rank's row counts (one reduce), then each dtype's rows at this rank's offset.
  const int64_t world = std::max<int64_t>(group.world_size, 1), k = static_cast<int64_t>(cat.size());
  at::Tensor counts = at::zeros({world, k}, at::kLong);
  for (int64_t j = 0; j < k; ++j) counts[group.rank][j] = cat[static_cast<size_t>(j)]->rows;
  if (world > 1) counts = group.reduce(counts, ReduceOp::sum).to(at::kCPU);
  const at::Tensor totals = counts.sum(0), before = counts.cumsum(0) - counts;  // rows of lower ranks
  std::map<int, std::vector<int64_t>> by_dtype;
  for (int64_t j = 0; j < k; ++j) by_dtype[static_cast<int>(cat[static_cast<size_t>(j)]->initial.scalar_type())].push_back(j);
  for (auto& [dtype, js] : by_dtype) {
    std::vector<at::Tensor> parts;
    std::vector<at::Tensor> mine;
    for (int64_t j : js) {
      State* s = cat[static_cast<size_t>(j)];
      at::Tensor rows = s->chunks.empty() ? s->initial : (s->chunks.size() > 1 ? at::cat(s->chunks) : s->chunks.front());
      auto shape = s->initial.sizes().vec();
      shape[0] = totals[j].item<int64_t>();
      at::Tensor all = at::zeros(shape, s->initial.options().device(rows.device()));
      if (s->rows > 0) all.narrow(0, before[group.rank][j].item<int64_t>(), s->rows).copy_(rows);
      parts.push_back(all.reshape({-1}));
      mine.push_back(all);
    }
    at::Tensor flat = at::cat(parts);
    if (world > 1) flat = group.reduce(flat, ReduceOp::sum).to(flat.device());
    int64_t offset = 0;
    for (size_t i = 0; i < js.size(); ++i) {
      State* s = cat[static_cast<size_t>(js[i])];
      const at::Tensor all = flat.narrow(0, offset, mine[i].numel()).reshape(mine[i].sizes()).clone();
      offset += mine[i].numel();
      s->chunks = {all};
      s->rows = all.size(0);
    }
  }
}

// Collective: every rank takes one rank's states, `broadcast(t)` returning that rank's `t` on every
// rank. For states synced over a group that not every rank belongs to: a device mesh's
// data-parallel group of the pipeline's last stage, which alone saw predictions. One broadcast per
// dtype (and the cat states' row counts first).
inline void broadcast_metrics(const std::vector<Metric*>& metrics, const std::function<at::Tensor(const at::Tensor&)>& broadcast) {
  using State = Metric::State;
  std::vector<State*> fixed, cat;
  for (Metric* m : metrics)
    for (auto& s : m->states_) (s.reduce == StateReduce::cat ? cat : fixed).push_back(&s);
  std::map<std::pair<int, std::string>, std::vector<State*>> buckets;
  for (State* s : fixed) buckets[{static_cast<int>(s->value.scalar_type()), s->value.device().str()}].push_back(s);
  for (auto& [key, states] : buckets) {
    std::vector<at::Tensor> flat;
    for (State* s : states) flat.push_back(s->value.reshape({-1}));
    const at::Tensor got = broadcast(at::cat(flat)).to(states.front()->value.device());
    int64_t offset = 0;
    for (State* s : states) {
      s->value = got.narrow(0, offset, s->value.numel()).reshape(s->value.sizes()).clone();
      offset += s->value.numel();
    }
  }
  if (cat.empty()) return;
  at::Tensor rows = at::zeros({static_cast<int64_t>(cat.size())}, at::kLong);
  for (size_t j = 0; j < cat.size(); ++j) rows[static_cast<int64_t>(j)] = cat[j]->rows;
  rows = broadcast(rows).to(at::kCPU);
  std::map<int, std::vector<size_t>> by_dtype;
  for (size_t j = 0; j < cat.size(); ++j) by_dtype[static_cast<int>(cat[j]->initial.scalar_type())].push_back(j);
  for (auto& [dtype, js] : by_dtype) {
    std::vector<at::Tensor> parts;
    std::vector<std::vector<int64_t>> shapes;
    for (size_t j : js) {
      State* s = cat[j];
      auto shape = s->initial.sizes().vec();
      shape[0] = rows[static_cast<int64_t>(j)].item<int64_t>();
      const at::Tensor mine = s->chunks.empty() ? s->initial : (s->chunks.size() > 1 ? at::cat(s->chunks) : s->chunks.front());
      // The source sends its rows; the others send a buffer of the same size.
      parts.push_back((mine.size(0) == shape[0] ? mine : at::zeros(shape, mine.options())).reshape({-1}));
      shapes.push_back(shape);
    }
    const at::Tensor got = broadcast(at::cat(parts));
    int64_t offset = 0;
    for (size_t i = 0; i < js.size(); ++i) {
      State* s = cat[js[i]];
      int64_t n = 1;
      for (int64_t d : shapes[i]) n *= d;
      s->chunks = {got.narrow(0, offset, n).reshape(shapes[i]).clone()};
      s->rows = shapes[i][0];
      offset += n;
    }
  }
}

}  // namespace ember::metrics
