// Rates over a sliding window of batches (Lightning's Throughput), free of Ember types.
#pragma once
#include <cstdint>
#include <deque>

namespace ember_tp {

struct Sample {
  double time;      // seconds of training (pauses such as validation excluded)
  double batches;   // cumulative
  double samples;   // cumulative
  double items;     // cumulative (tokens, ...); < 0 when unknown
  double flops = -1;  // cumulative; < 0 when unknown
};

struct Rates {
  double batches_per_sec = 0, samples_per_sec = 0, items_per_sec = -1, flops_per_sec = -1;
};

class Window {
 public:
  explicit Window(int64_t size) : size_(size) {}
  void add(const Sample& s) {
    samples_.push_back(s);
    while (static_cast<int64_t>(samples_.size()) > size_ + 1) samples_.pop_front();
  }
  // False until two samples span some time.
  bool rates(Rates* out) const {
    if (samples_.size() < 2) return false;
    const Sample& a = samples_.front();
    const Sample& b = samples_.back();
    const double dt = b.time - a.time;
    if (dt <= 0) return false;
    out->batches_per_sec = (b.batches - a.batches) / dt;
    out->samples_per_sec = (b.samples - a.samples) / dt;
    out->items_per_sec = a.items >= 0 && b.items >= 0 ? (b.items - a.items) / dt : -1;
    out->flops_per_sec = a.flops >= 0 && b.flops >= 0 ? (b.flops - a.flops) / dt : -1;
    return true;
  }
  void clear() { samples_.clear(); }

 private:
  int64_t size_;
  std::deque<Sample> samples_;
};

}  // namespace ember_tp
