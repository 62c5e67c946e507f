// Top-k bookkeeping of Lightning's ModelCheckpoint: which checkpoint files are the k best by a
// monitored value, which one drops out next, which is the best. Pure state, no file access, no
// Ember or LibTorch types, so unit tests can compile it directly. The callback (checkpoint.cpp)
// decides when to save and does the file work around it.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ember_checkpoint {

enum class Mode { min, max };

inline const char* mode_name(Mode m) { return m == Mode::min ? "min" : "max"; }

// Everything ModelCheckpoint remembers across saves (and across a resume, through state_dict).
struct TopKState {
  // path -> score, in insertion order like Lightning's dict (ties resolve to the earlier entry).
  std::vector<std::pair<std::string, double>> best_k_models;
  std::string kth_best_model_path;
  double kth_value = std::numeric_limits<double>::infinity();  // the worst value while not full
  std::string best_model_path;
  std::optional<double> best_model_score;  // unset until a finite value was saved
  std::string last_model_path;

  const double* find(const std::string& path) const {
    for (const auto& [p, s] : best_k_models) {
      if (p == path) return &s;
    }
    return nullptr;
  }
  // True when `path` is a file this state still points at (it must not be deleted).
  bool references(const std::string& path) const {
    return !path.empty() &&
           (find(path) != nullptr || path == best_model_path || path == last_model_path);
  }
};

class TopK {
 public:
  // `save_top_k`: -1 keeps every checkpoint, 0 none, k > 0 the k best.
  TopK(Mode mode, int64_t save_top_k) : mode_(mode), save_top_k_(save_top_k) {
    state_.kth_value = worst();
  }

  Mode mode() const { return mode_; }
  int64_t save_top_k() const { return save_top_k_; }
  const TopKState& state() const { return state_; }
  TopKState& state() { return state_; }  // for restoring a saved state or rolling back

  // The value that loses against every other: +inf for min, -inf for max.
  double worst() const {
    const double inf = std::numeric_limits<double>::infinity();
    return mode_ == Mode::min ? inf : -inf;
  }
  // The score a monitored value is ranked by. Non-finite values (NaN, and +-inf, which would
  // otherwise win in one of the modes) rank as the worst, so they never become the best.
  double score_of(double value) const { return std::isfinite(value) ? value : worst(); }
  // Strictly better (Lightning compares with torch.lt / torch.gt).
  bool better(double a, double b) const { return mode_ == Mode::min ? a < b : a > b; }

  // Lightning's check_monitor_top_k: does a checkpoint with this score get saved?
  bool should_save(double score) const {
    if (save_top_k_ == 0) return false;
    if (save_top_k_ == -1) return true;
    if (static_cast<int64_t>(state_.best_k_models.size()) < save_top_k_) return true;
    const double* kth = state_.find(state_.kth_best_model_path);
    return kth == nullptr || better(score, *kth);
  }

  struct Added {
    std::string path;     // the file to write
    std::string dropped;  // the file that left the top k ("" if none): delete it after the write
  };
  // Lightning's _update_best_and_save, without the file work: when the top k are full the k-th
  // drops out first; then `name_for(dropped)` picks the new file's path (it may reuse the dropped
  // name); then the k-th and the best are recomputed. Call only when should_save(score).
  Added add(double score, const std::function<std::string(const std::string& dropped)>& name_for) {
    const auto n = static_cast<int64_t>(state_.best_k_models.size());
    const int64_t k = save_top_k_ == -1 ? n + 1 : save_top_k_;
    Added out;
    if (n >= k && k > 0) {  // '>': a resumed state may hold more than this run's k
      out.dropped = state_.kth_best_model_path;
      erase(out.dropped);
    }
    out.path = name_for(out.dropped);
    put(out.path, score);
    if (static_cast<int64_t>(state_.best_k_models.size()) >= k) {
      // The k-th best is the worst of the k kept: the next to drop out.
      const auto* kth = pick([&](double a, double b) { return better(b, a); }, /*finite_only=*/false);
      state_.kth_best_model_path = kth->first;
      state_.kth_value = kth->second;
    }
    // The best is chosen among finite scores only; with none, there is no best yet.
    if (const auto* best = pick([&](double a, double b) { return better(a, b); }, true)) {
      state_.best_model_path = best->first;
      state_.best_model_score = best->second;
    } else {
      state_.best_model_path.clear();
      state_.best_model_score.reset();
    }
    return out;
  }

 private:
  void erase(const std::string& path) {
    auto& v = state_.best_k_models;
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (it->first == path) {
        v.erase(it);
        return;
      }
    }
  }
  void put(const std::string& path, double score) {
    for (auto& [p, s] : state_.best_k_models) {
      if (p == path) {
        s = score;  // a dict assignment keeps the entry's position
        return;
      }
    }
    state_.best_k_models.emplace_back(path, score);
  }
  // The first entry that no later entry beats under `wins(a, b)` (Python's min/max on a dict).
  template <class Wins>
  const std::pair<std::string, double>* pick(Wins wins, bool finite_only) const {
    const std::pair<std::string, double>* best = nullptr;
    for (const auto& e : state_.best_k_models) {
      if (finite_only && !std::isfinite(e.second)) continue;
      if (best == nullptr || wins(e.second, best->second)) best = &e;
    }
    return best;
  }

  Mode mode_;
  int64_t save_top_k_;
  TopKState state_;
};

// True when `path` lies inside the folder `dir` (lexically, after making both absolute).
inline bool is_inside(const std::string& dir, const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (dir.empty() || path.empty()) return false;
  fs::path d = fs::absolute(fs::path(dir), ec).lexically_normal();
  const fs::path p = fs::absolute(fs::path(path), ec).lexically_normal();
  if (!d.has_filename()) d = d.parent_path();  // "a/b/" -> "a/b"
  const auto [di, pi] = std::mismatch(d.begin(), d.end(), p.begin(), p.end());
  return di == d.end() && pi != p.end();
}

// Lightning's _should_remove_checkpoint, with one more guard: a file that was replaced by
// `current` may be deleted only if it is not `current` itself, lies inside `dirpath` (files
// elsewhere are the user's), and the state no longer points at it (never the best, the last or
// another top-k file).
inline bool should_remove_checkpoint(const TopKState& state, const std::string& previous,
                                     const std::string& current, const std::string& dirpath) {
  if (previous.empty() || previous == current) return false;
  if (state.references(previous)) return false;
  return is_inside(dirpath, previous);
}

}  // namespace ember_checkpoint
