#include "loop/metrics.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace ember::engine {

namespace {
// at::maximum / at::minimum on one element: NaN wins.
double nan_max(double a, double b) { return std::isnan(a) || std::isnan(b) ? std::numeric_limits<double>::quiet_NaN() : std::max(a, b); }
double nan_min(double a, double b) { return std::isnan(a) || std::isnan(b) ? std::numeric_limits<double>::quiet_NaN() : std::min(a, b); }
}  // namespace

double MetricStore::Value::read() const { return device.defined() ? device.item<double>() : host; }

void MetricStore::require_scalar(const std::string& name, const at::Tensor& value) {
  if (value.numel() != 1)
    throw std::invalid_argument("log('" + name + "'): expected a scalar, got a tensor of shape " +
                                std::string(c10::str(value.sizes())));
}

void MetricStore::log(const std::string& name, const at::Tensor& raw, const LogOptions& o, Stage stage,
                      int64_t batch_size) {
  require_scalar(name, raw);
  Value value;
  if (raw.is_cpu()) value.host = raw.item<double>();
  else value.device = raw.detach().reshape({});
  record(name, value, o, stage, batch_size);
}

void MetricStore::log(const std::string& name, double value, const LogOptions& o, Stage stage, int64_t batch_size) {
  record(name, Value{at::Tensor(), value}, o, stage, batch_size);
}

void MetricStore::record(const std::string& name, const Value& value, const LogOptions& o, Stage stage,
                         int64_t batch_size) {
  const bool training = stage == Stage::fit;
  const bool on_step = o.on_step < 0 ? training : o.on_step != 0;
  const bool on_epoch = o.on_epoch < 0 ? !training : o.on_epoch != 0;
  // A batch of 0 samples is exact evaluation's padding (data/data_loader.h): it counts for
  // nothing, but the metric exists on this rank, so every rank reduces the same metrics.
  const bool counts = batch_size != 0;
  if (on_step && counts && stage != Stage::sanity_check) {
    const std::string key = on_epoch ? name + "_step" : name;
    step_values_[key] = StepValue{value, o.prog_bar, o.logger};
    if (o.prog_bar) step_prog_bar_[key] = true;
  }
  if (on_epoch) {
    auto& acc = epoch_[static_cast<int>(stage)][name];
    const double w = static_cast<double>(o.batch_size > 0 ? o.batch_size : std::max<int64_t>(batch_size, 1));
    if (!acc.configured) {
      acc.configured = true;
      acc.reduce = o.reduce;
      acc.prog_bar = o.prog_bar;
      acc.logger = o.logger;
      acc.sync_dist = o.sync_dist;
      acc.key = on_step ? name + "_epoch" : name;
      acc.plain = name;
    }
    if (counts) accumulate(acc, value, w);
  }
}

// The first value starts the accumulator; the others are folded in. A device accumulator takes
// one fused op per value; a host one the same arithmetic in doubles, so both give the same bits
// (ATen's add with alpha is a fused multiply-add on CPUs that have one).
void MetricStore::accumulate(Accumulator& acc, const Value& value, double w) {
  const bool first = !acc.started;
  acc.started = true;
  acc.weight += w;
  if (!acc.sum.defined() && !value.device.defined()) {
    const double v = value.host;
    if (first) {
      acc.host_sum = v * (acc.reduce == Reduce::mean ? w : 1.0);
      return;
    }
    switch (acc.reduce) {
      case Reduce::mean: acc.host_sum = std::fma(v, w, acc.host_sum); break;
      case Reduce::sum: acc.host_sum += v; break;
      case Reduce::max: acc.host_sum = nan_max(acc.host_sum, v); break;
      case Reduce::min: acc.host_sum = nan_min(acc.host_sum, v); break;
    }
    return;
  }
  // Values on a device accumulate there (a host accumulator moves to the device once).
  const at::Tensor v = value.device.defined() ? value.device : at::scalar_tensor(value.host, at::kDouble);
  if (first) {
    acc.sum = v.to(at::kDouble) * (acc.reduce == Reduce::mean ? w : 1.0);
    return;
  }
  if (!acc.sum.defined()) acc.sum = at::scalar_tensor(acc.host_sum, at::kDouble).to(v.device());
  switch (acc.reduce) {
    case Reduce::mean: acc.sum.add_(v, w); break;
    case Reduce::sum: acc.sum.add_(v); break;
    case Reduce::max: acc.sum = at::maximum(acc.sum, v); break;
    case Reduce::min: acc.sum = at::minimum(acc.sum, v); break;
  }
}

std::vector<std::pair<std::string, double>> MetricStore::take_step_values() {
  std::vector<std::pair<std::string, double>> out;
  for (auto& [key, sv] : step_values_) {
    double v = sv.value.read();
    callback_metrics_[key] = v;
    // Lightning keeps the plain name pointing at the latest value too.
    if (key.size() > 5 && key.ends_with("_step")) callback_metrics_[key.substr(0, key.size() - 5)] = v;
    if (sv.logger) out.emplace_back(key, v);
  }
  step_values_.clear();
  return out;
}

std::vector<std::pair<std::string, double>> MetricStore::progress_values() {
  std::vector<std::pair<std::string, double>> out;
  for (const auto& [key, _] : step_prog_bar_) {
    auto it = step_values_.find(key);
    std::string shown = key.ends_with("_step") ? key.substr(0, key.size() - 5) : key;
    if (it != step_values_.end()) out.emplace_back(shown, it->second.value.read());
    else if (auto c = callback_metrics_.find(key); c != callback_metrics_.end()) out.emplace_back(shown, c->second);
  }
  for (const auto& [key, _] : prog_bar_epoch_)
    if (auto c = callback_metrics_.find(key); c != callback_metrics_.end()) out.emplace_back(key, c->second);
  return out;
}

std::vector<std::pair<std::string, double>> MetricStore::finish_epoch(Stage stage, const Reducer& reduce) {
  std::vector<std::pair<std::string, double>> out;
  auto it = epoch_.find(static_cast<int>(stage));
  if (it == epoch_.end()) return out;
  for (auto& [name, acc] : it->second) {
    // Nothing counted on this rank: the reduction's identity (a mean of no samples is NaN here,
    // and the other ranks' value once reduced).
    if (!acc.started)
      acc.host_sum = acc.reduce == Reduce::max   ? -std::numeric_limits<double>::infinity()
                     : acc.reduce == Reduce::min ? std::numeric_limits<double>::infinity()
                                                 : 0.0;
    double v = acc.host_sum;
    double weight = acc.weight;
    if (acc.sync_dist && reduce) {
      // Reduced as a tensor wherever it was accumulated (a host value as a CPU tensor).
      const at::Tensor sum = acc.sum.defined() ? acc.sum : at::scalar_tensor(acc.host_sum, at::kDouble);
      at::Tensor total;
      switch (acc.reduce) {
        case Reduce::mean: {
          total = reduce(sum, ReduceOp::sum);
          weight = reduce(at::scalar_tensor(acc.weight, at::kDouble).to(sum.device()), ReduceOp::sum).item<double>();
          break;
        }
        case Reduce::sum: total = reduce(sum, ReduceOp::sum); break;
        case Reduce::max: total = reduce(sum, ReduceOp::max); break;
        case Reduce::min: total = reduce(sum, ReduceOp::min); break;
      }
      v = total.item<double>();
    } else if (acc.sum.defined()) {
      v = acc.sum.item<double>();
    }
    if (acc.reduce == Reduce::mean) v /= weight;
    callback_metrics_[acc.key] = v;
    if (acc.key != acc.plain) callback_metrics_[acc.plain] = v;
    if (acc.prog_bar) prog_bar_epoch_[acc.key] = true;
    if (acc.logger) out.emplace_back(acc.key, v);
  }
  epoch_.erase(it);
  return out;
}

void MetricStore::discard_epoch(Stage stage) { epoch_.erase(static_cast<int>(stage)); }

std::optional<double> MetricStore::get(const std::string& name) const {
  auto it = callback_metrics_.find(name);
  if (it == callback_metrics_.end()) return std::nullopt;
  return it->second;
}

std::vector<std::string> MetricStore::names() const {
  std::vector<std::string> out;
  for (const auto& [k, _] : callback_metrics_) out.push_back(k);
  return out;
}

}  // namespace ember::engine
