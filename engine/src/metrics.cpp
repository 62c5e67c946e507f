#include "metrics.h"

#include <ATen/ATen.h>

namespace ember::engine {

void MetricStore::log(const std::string& name, const at::Tensor& raw, const LogOptions& o, Stage stage,
                      int64_t batch_size) {
  const bool training = stage == Stage::fit;
  const bool on_step = o.on_step < 0 ? training : o.on_step != 0;
  const bool on_epoch = o.on_epoch < 0 ? !training : o.on_epoch != 0;
  at::Tensor value = raw.detach();
  if (value.numel() != 1)
    throw std::invalid_argument("log('" + name + "'): expected a scalar, got a tensor of shape " +
                                std::string(c10::str(value.sizes())));
  value = value.reshape({});
  if (on_step && stage != Stage::sanity_check) {
    const std::string key = on_epoch ? name + "_step" : name;
    step_values_[key] = StepValue{value, o.prog_bar, o.logger};
    if (o.prog_bar) step_prog_bar_[key] = true;
  }
  if (on_epoch) {
    auto& acc = epoch_[static_cast<int>(stage)][name];
    const double w = static_cast<double>(o.batch_size > 0 ? o.batch_size : std::max<int64_t>(batch_size, 1));
    if (!acc.sum.defined()) {
      acc.reduce = o.reduce;
      acc.prog_bar = o.prog_bar;
      acc.logger = o.logger;
      acc.sync_dist = o.sync_dist;
      acc.key = on_step ? name + "_epoch" : name;
      acc.plain = name;
      // Accumulated in double on the value's device; one fused op per logged value afterwards.
      acc.sum = value.to(at::kDouble) * (o.reduce == Reduce::mean ? w : 1.0);
      acc.weight = w;
      return;
    }
    switch (acc.reduce) {
      case Reduce::mean: acc.sum.add_(value, w); break;
      case Reduce::sum: acc.sum.add_(value); break;
      case Reduce::max: acc.sum = at::maximum(acc.sum, value); break;
      case Reduce::min: acc.sum = at::minimum(acc.sum, value); break;
    }
    acc.weight += w;
  }
}

std::vector<std::pair<std::string, double>> MetricStore::take_step_values() {
  std::vector<std::pair<std::string, double>> out;
  for (auto& [key, sv] : step_values_) {
    double v = sv.value.item<double>();
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
    if (it != step_values_.end()) out.emplace_back(shown, it->second.value.item<double>());
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
    at::Tensor total = acc.sum;
    double weight = acc.weight;
    if (acc.sync_dist && reduce) {
      switch (acc.reduce) {
        case Reduce::mean: {
          total = reduce(acc.sum, ReduceOp::sum);
          weight = reduce(at::scalar_tensor(acc.weight, at::kDouble).to(acc.sum.device()), ReduceOp::sum).item<double>();
          break;
        }
        case Reduce::sum: total = reduce(acc.sum, ReduceOp::sum); break;
        case Reduce::max: total = reduce(acc.sum, ReduceOp::max); break;
        case Reduce::min: total = reduce(acc.sum, ReduceOp::min); break;
      }
    }
    double v = total.item<double>();
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
