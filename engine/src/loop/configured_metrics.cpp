#include "loop/configured_metrics.h"

#include <ember/error.h>

#include <algorithm>
#include <limits>
#include <fstream>
#include <set>
#include <sstream>

#include "checkpoint/atomic_file.h"

#ifdef EMBER_WITH_CAIRO
#include <ember/support/cairo_chart.h>
#endif

namespace ember::engine {
namespace {

constexpr const char* kSplitNames[] = {"train", "val", "test"};

std::string joined(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
  return out;
}

bool needs_classes(const std::string& name) { return !metrics::is_regression_metric(name) && name != "perplexity"; }

}  // namespace

ConfiguredMetrics::ConfiguredMetrics(const Section& s) {
  names_ = s.get_string_list("names");
  where_ = s.where("names");
  auto fail = [&](const std::string& key, const std::string& why) { throw ConfigError(s.where(key) + ": metrics." + key + ": " + why); };
  std::set<std::string> seen;
  for (const auto& n : names_) {
    const auto& known = metrics::metric_names();
    if (std::find(known.begin(), known.end(), n) == known.end())
      fail("names", "unknown metric '" + n + "' (known: " + joined(known) + ")");
    if (!seen.insert(n).second) fail("names", "'" + n + "' is named twice");
  }
  for (const auto& split : s.get_string_list("splits")) {
    auto it = std::find(std::begin(kSplitNames), std::end(kSplitNames), split);
    if (it == std::end(kSplitNames)) fail("splits", "unknown split '" + split + "' (train, val, test)");
    splits_[static_cast<size_t>(it - std::begin(kSplitNames))] = true;
  }
  on_step_ = s.get_bool("on_step");
  if (on_step_ && !splits_[0]) fail("on_step", "per-step values are training values: add \"train\" to metrics.splits");
  spec_.task = metrics::parse_task(s.get_string("task"));
  spec_.num_classes = s.get_int("num_classes");
  spec_.average = metrics::parse_average(s.get_string("average"));
  spec_.top_k = s.get_int("top_k");
  spec_.threshold = s.get_float("threshold");
  spec_.beta = s.get_float("beta");
  spec_.thresholds = s.get_int("thresholds");
  spec_.max_samples = s.get_int("max_samples");
  spec_.bins = s.get_int("bins");
  const std::string norm = s.get_string("calibration_norm");
  spec_.norm = norm == "l2" ? metrics::CalibrationError::Norm::l2 : norm == "max" ? metrics::CalibrationError::Norm::max : metrics::CalibrationError::Norm::l1;
  const std::string scores = s.get_string("scores");
  spec_.scores = scores == "logits" ? metrics::Scores::logits : scores == "probabilities" ? metrics::Scores::probabilities : metrics::Scores::automatic;
  spec_.ignore_index = s.get_int("ignore_index");
  if (spec_.thresholds == 1) fail("thresholds", "0 (exact curves) or at least 2 bins");
  if (spec_.task == metrics::Task::binary && spec_.num_classes > 2) fail("num_classes", "a binary task has 2 classes; use task = \"multiclass\"");
  if (spec_.num_classes == 1 && spec_.task == metrics::Task::multiclass) fail("num_classes", "a multiclass task needs at least 2 classes");
  // Every setting checked now, not at the first batch: each metric made once with the classes
  // given (or 2 standing for the scores' width).
  for (const auto& n : names_) {
    metrics::MetricSpec probe = spec_;
    probe.name = n;
    probe.num_classes = std::max<int64_t>(spec_.num_classes, std::max<int64_t>(2, spec_.top_k));
    try {
      (void)metrics::make_metric(probe);
    } catch (const RunError& e) {
      std::string why = e.what();
      if (why.starts_with("metrics: ")) why = why.substr(9);
      fail("names", why);
    }
  }
}

int64_t ConfiguredMetrics::classes_of(const at::Tensor& preds) const {
  if (spec_.num_classes > 0) return spec_.num_classes;
  if (spec_.task == metrics::Task::binary) return 2;
  return preds.dim() >= 2 ? preds.size(-1) : 0;
}

void ConfiguredMetrics::make(SplitMetrics& m, int64_t num_classes) const {
  for (const auto& n : names_) {
    metrics::MetricSpec spec = spec_;
    spec.name = n;
    spec.num_classes = needs_classes(n) ? num_classes : 2;
    // The confusion matrix shares its counts with accuracy, precision, F1... (one compute group).
    m.collection.add(n, metrics::make_metric(spec));
  }
  m.made = true;
  m.classes = num_classes;
}

void ConfiguredMetrics::update(Split split, const at::Tensor& preds, const at::Tensor& target) {
  if (!active(split)) return;
  auto feed = [&](SplitMetrics& m) {
    if (!m.made) {
      const int64_t classes = classes_of(preds);
      const bool any_classified = std::any_of(names_.begin(), names_.end(), needs_classes);
      if (any_classified && classes < 2)
        throw RunError(where_ + ": [metrics] got scores of shape " + std::string(c10::str(preds.sizes())) + " for a " +
                       metrics::task_name(spec_.task) + " task: set metrics.num_classes, or metrics.task to match the model's outputs");
      make(m, classes);
    }
    m.collection.update(preds, target);
    m.updated = true;
  };
  try {
    feed(splits_metrics_[static_cast<size_t>(split)]);
    if (on_step_ && split == Split::train) {
      feed(step_window_);
      step_window_used_ = true;
    }
  } catch (const RunError& e) {
    std::string why = e.what();
    if (why.starts_with("metrics: ")) why = why.substr(9);
    throw RunError(where_ + ": [metrics] on the " + kSplitNames[static_cast<int>(split)] + " split: " + why);
  }
}

std::vector<std::pair<std::string, double>> ConfiguredMetrics::take_step_values() {
  std::vector<std::pair<std::string, double>> out;
  if (!step_window_used_) return out;
  for (const auto& [name, value] : step_window_.collection.compute())
    if (name != "confusion_matrix") out.emplace_back("train_" + name + "_step", value);
  step_window_.collection.reset();
  step_window_used_ = false;
  return out;
}

void ConfiguredMetrics::throw_no_predictions(Split split) const {
  throw RunError(where_ + ": [metrics] names " + joined(names_) + ", but the model handed no predictions on the " + kSplitNames[static_cast<int>(split)] +
                 " split: its steps must call ctx.update_metrics(scores, targets) (the built-in models do; gpt in training only without vocabulary parallelism and with model.chunked_loss = false)");
}

void ConfiguredMetrics::require_predictions(Split split) const {
  if (active(split) && !splits_metrics_[static_cast<size_t>(split)].updated) throw_no_predictions(split);
}

ConfiguredMetrics::EpochValues ConfiguredMetrics::finish(Split split, const MetricRanks& ranks, bool ran_batches) {
  EpochValues out;
  if (!active(split)) return out;
  auto& m = splits_metrics_[static_cast<size_t>(split)];
  // A rank that saw no batch (a pipeline stage before the last, a rank whose share of the split
  // was padding only) makes its metrics with the classes the others saw, so that every rank
  // reduces the same states; ranks that saw different widths all stop with the same message. One
  // small max-reduce over every rank: the most classes seen, minus the fewest, and the lowest rank
  // that got predictions (as world_size - rank).
  const std::vector<int64_t> mine = {m.made ? m.classes : 0, m.made ? -m.classes : std::numeric_limits<int64_t>::min() + 1,
                                     m.updated ? ranks.world_size - ranks.rank : 0};
  at::Tensor seen = at::tensor(mine, at::kLong);
  if (ranks.world_size > 1) seen = ranks.reduce(seen, ReduceOp::max).to(at::kCPU);
  const int64_t most = seen[0].item<int64_t>(), fewest = -seen[1].item<int64_t>();
  m.updated = false;
  if (seen[2].item<int64_t>() == 0) {
    if (!ran_batches) return out;
    throw_no_predictions(split);
  }
  const int64_t source = ranks.world_size - seen[2].item<int64_t>();
  const bool needs = spec_.num_classes == 0 && std::any_of(names_.begin(), names_.end(), needs_classes);
  if (needs && most != fewest)
    throw RunError(where_ + ": [metrics] ranks saw scores for " + std::to_string(fewest) + " and " + std::to_string(most) +
                   " classes: set metrics.num_classes");
  if (!m.made) make(m, needs ? most : std::max<int64_t>(spec_.num_classes, 2));
  // One state per compute group (the confusion matrix behind accuracy and F1, ...).
  const std::vector<metrics::Metric*> all = m.collection.distinct();
  // Sums over the data-parallel group (the cat states placed by data-parallel rank) ...
  metrics::sync_metrics(all, {ranks.reduce, ranks.data_parallel_rank, ranks.data_parallel_size});
  // ... and on a mesh, the first rank with predictions gives its totals to every rank.
  if (ranks.data_parallel_size != ranks.world_size)
    metrics::broadcast_metrics(all, [&](const at::Tensor& t) { return ranks.broadcast(t, source); });
  m.collection.share();
  const std::string prefix = kSplitNames[static_cast<int>(split)];
  for (const auto& [name, metric] : m.collection.metrics()) {
    if (name == "confusion_matrix") {
      if (const auto* labels = dynamic_cast<const metrics::MultilabelConfusionMatrix*>(metric.get()))
        out.confusion_matrix = labels->matrix();
      else
        out.confusion_matrix = static_cast<const metrics::ConfusionMatrix&>(*metric).matrix();
      continue;
    }
    const std::string key = prefix + "_" + name + (split == Split::train && on_step_ ? "_epoch" : "");
    out.values.emplace_back(key, metric->compute());
    if (spec_.average != metrics::Average::none) continue;
    const at::Tensor per = metric->per_class();
    for (int64_t c = 0; per.defined() && c < per.numel(); ++c) out.values.emplace_back(key + "_" + std::to_string(c), per[c].item<double>());
  }
  m.collection.reset();
  return out;
}

void ConfiguredMetrics::discard(Split split) {
  auto& m = splits_metrics_[static_cast<size_t>(split)];
  m.collection.reset();
  if (split == Split::train) {
    step_window_.collection.reset();
    step_window_used_ = false;
  }
}


#ifdef EMBER_WITH_CAIRO
namespace {
// A heat map of the counts, each row shaded by its share of the row's samples (so a rare class's
// errors show as clearly as a common one's), the count written in every cell.
ConfusionMatrixImage draw_confusion_matrix(const at::Tensor& matrix, const std::string& split) {
  namespace chart = ember::support::chart;
  const int64_t c = matrix.size(0);
  const int cell = static_cast<int>(std::clamp<int64_t>(560 / c, 14, 48));
  const int left = 70, top = 56, size = cell * static_cast<int>(c);
  chart::Canvas canvas(left + size + 24, top + size + 40);
  cairo_t* cr = canvas.cr();
  const at::Tensor m = matrix.to(at::kDouble);
  const at::Tensor rows = m.sum(1, true).clamp_min(1);
  const at::Tensor share = m / rows;
  cairo_set_font_size(cr, 14);
  chart::set_color(cr, {0.1, 0.1, 0.1});
  chart::draw_text(cr, split + " confusion matrix (rows: target, columns: predicted)", 8, 20);
  cairo_set_font_size(cr, std::max(8.0, cell * 0.3));
  for (int64_t i = 0; i < c; ++i) {
    for (int64_t j = 0; j < c; ++j) {
      const double v = share[i][j].item<double>();
      cairo_set_source_rgb(cr, 1 - 0.85 * v, 1 - 0.55 * v, 1 - 0.2 * v);
      cairo_rectangle(cr, left + j * cell, top + i * cell, cell, cell);
      cairo_fill(cr);
      if (cell >= 24) {
        chart::set_color(cr, v > 0.5 ? chart::Rgb{1, 1, 1} : chart::Rgb{0.1, 0.1, 0.1});
        chart::draw_text(cr, std::to_string(matrix[i][j].item<int64_t>()), left + j * cell + cell / 2.0, top + i * cell + cell * 0.62, 0.5);
      }
    }
    chart::set_color(cr, {0.2, 0.2, 0.2});
    chart::draw_text(cr, std::to_string(i), left - 6, top + i * cell + cell * 0.62, 1.0);
    chart::draw_text(cr, std::to_string(i), left + i * cell + cell / 2.0, top - 6, 0.5);
  }
  cairo_set_source_rgb(cr, 0.6, 0.6, 0.6);
  cairo_set_line_width(cr, 1);
  cairo_rectangle(cr, left + 0.5, top + 0.5, size, size);
  cairo_stroke(cr);
  return {canvas.png_bytes(), canvas.width(), canvas.height()};
}

// Multilabel: one 2 x 2 panel per label ([[tn, fp], [fn, tp]]), shaded as above, ten to a row; at
// most the first 100 labels (the CSV has them all).
ConfusionMatrixImage draw_label_matrices(const at::Tensor& matrices, const std::string& split) {
  namespace chart = ember::support::chart;
  const int64_t labels = matrices.size(0), drawn = std::min<int64_t>(labels, 100);
  const int64_t per_row = std::min<int64_t>(drawn, 10), rows = (drawn + per_row - 1) / per_row;
  const int cell = 36, panel = 2 * cell, gap = 30, left = 16, top = 56;
  // Wide enough for the title whatever the number of labels.
  chart::Canvas canvas(static_cast<int>(std::max<int64_t>(left + per_row * (panel + gap), 600)), static_cast<int>(top + rows * (panel + gap) + 8));
  cairo_t* cr = canvas.cr();
  cairo_set_font_size(cr, 14);
  chart::set_color(cr, {0.1, 0.1, 0.1});
  chart::draw_text(cr, split + " confusion matrix per label (rows: target 0 / 1, columns: predicted 0 / 1)", 8, 20);
  if (drawn < labels) chart::draw_text(cr, "labels 0-99 of " + std::to_string(labels) + "; the CSV has them all", 8, 38);
  for (int64_t l = 0; l < drawn; ++l) {
    const double x = left + static_cast<double>(l % per_row) * (panel + gap), y = top + static_cast<double>(l / per_row) * (panel + gap);
    const at::Tensor m = matrices[l].to(at::kDouble);
    const at::Tensor share = m / m.sum(1, true).clamp_min(1);
    cairo_set_font_size(cr, 11);
    chart::set_color(cr, {0.2, 0.2, 0.2});
    chart::draw_text(cr, "label " + std::to_string(l), x + panel / 2.0, y - 6, 0.5);
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j) {
        const double v = share[i][j].item<double>();
        cairo_set_source_rgb(cr, 1 - 0.85 * v, 1 - 0.55 * v, 1 - 0.2 * v);
        cairo_rectangle(cr, x + j * cell, y + i * cell, cell, cell);
        cairo_fill(cr);
        chart::set_color(cr, v > 0.5 ? chart::Rgb{1, 1, 1} : chart::Rgb{0.1, 0.1, 0.1});
        chart::draw_text(cr, std::to_string(matrices[l][i][j].item<int64_t>()), x + j * cell + cell / 2.0, y + i * cell + cell * 0.62, 0.5);
      }
    cairo_set_source_rgb(cr, 0.6, 0.6, 0.6);
    cairo_set_line_width(cr, 1);
    cairo_rectangle(cr, x + 0.5, y + 0.5, panel, panel);
    cairo_stroke(cr);
  }
  return {canvas.png_bytes(), canvas.width(), canvas.height()};
}
}  // namespace
#endif

ConfusionMatrixImage write_confusion_matrix(const at::Tensor& matrix, const std::filesystem::path& dir, const std::string& split) {
  ConfusionMatrixImage image;
  const int64_t c = matrix.size(0);
  std::ostringstream csv;
  if (matrix.dim() == 3) {
    // Multilabel: a row per label with its four counts.
    csv << "label,tn,fp,fn,tp\n";
    for (int64_t l = 0; l < c; ++l)
      csv << l << ',' << matrix[l][0][0].item<int64_t>() << ',' << matrix[l][0][1].item<int64_t>() << ',' << matrix[l][1][0].item<int64_t>() << ','
          << matrix[l][1][1].item<int64_t>() << '\n';
  } else {
    csv << "target\\predicted";
    for (int64_t j = 0; j < c; ++j) csv << ',' << j;
    csv << '\n';
    for (int64_t i = 0; i < c; ++i) {
      csv << i;
      for (int64_t j = 0; j < c; ++j) csv << ',' << matrix[i][j].item<int64_t>();
      csv << '\n';
    }
  }
  const std::string text = csv.str();
  const auto path = dir / (split + "_confusion_matrix.csv");
  atomic_write(path, text.data(), text.size());
#ifdef EMBER_WITH_CAIRO
  image = matrix.dim() == 3 ? draw_label_matrices(matrix, split) : draw_confusion_matrix(matrix, split);
  if (image.png.empty()) throw RunError("cairo could not encode " + (dir / (split + "_confusion_matrix.png")).string());
  atomic_write(dir / (split + "_confusion_matrix.png"), image.png.data(), image.png.size());
#endif
  return image;
}

}  // namespace ember::engine
