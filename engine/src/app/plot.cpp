// `engine plot`: reads each run's metrics.csv (Lightning's layout: a "step" column and one column
// per metric, empty cells where a row lacks it) and draws one panel per kind of metric, sharing
// the step axis:
//   loss      columns with "loss" in the name (train_loss_step faint, epoch and val values bold)
//   accuracy  columns with "acc" in the name
//   lr        columns starting with "lr" (lr_monitor's lr-SGD, ...)
// Train curves are solid, validation and test curves dashed; each run has its own colour.
#include "app/plot.h"

#ifdef EMBER_WITH_CAIRO
#include <ember/support/cairo_chart.h>
#endif

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include <ember/error.h>

#include "config/run_config.h"

#ifdef EMBER_WITH_CAIRO
namespace ember::engine {
namespace {

namespace fs = std::filesystem;

struct Series {
  std::vector<double> x, y;
};
struct Run {
  std::string label;
  std::map<std::string, Series> metrics;
};

// RFC 4180 records (quoted fields may hold commas, quotes and line breaks).
std::vector<std::vector<std::string>> parse_csv(const std::string& text) {
  std::vector<std::vector<std::string>> records;
  std::vector<std::string> rec;
  std::string field;
  bool quoted = false, any = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (quoted) {
      if (c == '"' && i + 1 < text.size() && text[i + 1] == '"') field += '"', ++i;
      else if (c == '"') quoted = false;
      else field += c;
    } else if (c == '"') {
      quoted = any = true;
    } else if (c == ',') {
      rec.push_back(field), field.clear(), any = true;
    } else if (c == '\n' || c == '\r') {
      if (c == '\r' && i + 1 < text.size() && text[i + 1] == '\n') ++i;
      if (any || !field.empty()) rec.push_back(field), records.push_back(rec);
      rec.clear(), field.clear(), any = false;
    } else {
      field += c, any = true;
    }
  }
  if (any || !field.empty()) rec.push_back(field), records.push_back(rec);
  return records;
}

bool number(const std::string& s, double* v) {
  if (s.empty()) return false;
  char* end = nullptr;
  *v = std::strtod(s.c_str(), &end);
  return end && *end == '\0' && std::isfinite(*v);
}

Run read_run(const std::string& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) throw UsageError("plot: " + dir + ": no such run folder (give a run folder that holds metrics.csv)");
  const fs::path file = fs::is_directory(dir) ? fs::path(dir) / "metrics.csv" : fs::path(dir);
  std::ifstream in(file, std::ios::binary);
  if (!in) throw UsageError("plot: cannot read " + file.string() + " (give a run folder that holds metrics.csv)");
  std::stringstream ss;
  ss << in.rdbuf();
  auto records = parse_csv(ss.str());
  if (records.empty()) throw UsageError("plot: " + file.string() + " is empty");
  const auto& header = records[0];
  const auto step_col = std::find(header.begin(), header.end(), "step");
  if (step_col == header.end()) throw UsageError("plot: " + file.string() + ":1: no 'step' column (not a metrics.csv)");
  const size_t sc = static_cast<size_t>(step_col - header.begin());
  Run run;
  // Label: the last folders of the path (name/version_n).
  fs::path p = fs::weakly_canonical(file.parent_path());
  run.label = p.parent_path().filename().string() + "/" + p.filename().string();
  for (size_t r = 1; r < records.size(); ++r) {
    double step = 0;
    if (sc >= records[r].size() || !number(records[r][sc], &step)) continue;
    for (size_t c = 0; c < header.size() && c < records[r].size(); ++c) {
      double v = 0;
      if (c == sc || header[c] == "epoch" || !number(records[r][c], &v)) continue;
      auto& s = run.metrics[header[c]];
      s.x.push_back(step);
      s.y.push_back(v);
    }
  }
  return run;
}

struct Panel {
  std::string title;
  bool (*match)(const std::string&);
};
bool is_loss(const std::string& m) { return m.find("loss") != std::string::npos; }
bool is_acc(const std::string& m) { return m.find("acc") != std::string::npos; }
bool is_lr(const std::string& m) { return m.rfind("lr", 0) == 0; }

using support::chart::Rgb;
const Rgb kRunColors[] = {{0.12, 0.47, 0.71}, {0.84, 0.15, 0.16}, {0.17, 0.63, 0.17}, {1.00, 0.50, 0.05},
                          {0.58, 0.40, 0.74}, {0.55, 0.34, 0.29}, {0.89, 0.47, 0.76}, {0.50, 0.50, 0.50}};
using support::chart::format;
using support::chart::nice_step;

void text(cairo_t* cr, const std::string& s, double x, double y, double anchor, double size) {
  cairo_set_font_size(cr, size);
  support::chart::draw_text(cr, s, x, y, anchor);
}

bool is_eval(const std::string& m) { return m.rfind("val", 0) == 0 || m.rfind("test", 0) == 0; }
// Per-step training values (train_loss_step, or a metric logged only per step) are drawn faint
// when the same metric also has epoch values.
bool is_step(const std::string& m) { return m.size() > 5 && m.compare(m.size() - 5, 5, "_step") == 0; }

}  // namespace

int plot_runs(const std::vector<std::string>& run_dirs, const std::string& output, std::ostream& out) {
  if (run_dirs.empty()) throw UsageError("expected `engine plot RUN_DIR... --output FILE.png`");
  if (output.empty()) throw UsageError("plot: --output FILE.png is required");
  // It draws PNG only: another extension would get PNG bytes under a misleading name.
  if (!output.ends_with(".png") && !output.ends_with(".PNG"))
    throw UsageError("plot: --output " + output + ": engine plot writes PNG images: give a file name ending in .png");
  std::vector<Run> runs;
  for (const auto& d : run_dirs) runs.push_back(read_run(d));
  // Two runs with the same name/version_n (from different roots): label them by the path given.
  std::map<std::string, int> seen;
  for (const auto& r : runs) ++seen[r.label];
  for (size_t i = 0; i < runs.size(); ++i)
    if (seen[runs[i].label] > 1) runs[i].label = fs::path(run_dirs[i]).lexically_normal().string();
  const Panel all_panels[] = {{"loss", is_loss}, {"accuracy", is_acc}, {"learning rate", is_lr}};
  std::vector<Panel> panels;
  double xmin = std::numeric_limits<double>::infinity(), xmax = -xmin;
  for (const auto& p : all_panels) {
    bool any = false;
    for (const auto& r : runs)
      for (const auto& [m, s] : r.metrics)
        if (p.match(m) && !s.x.empty()) {
          any = true;
          xmin = std::min(xmin, *std::min_element(s.x.begin(), s.x.end()));
          xmax = std::max(xmax, *std::max_element(s.x.begin(), s.x.end()));
        }
    if (any) panels.push_back(p);
  }
  if (panels.empty()) throw UsageError("plot: no loss, accuracy or lr columns in the given runs' metrics.csv");
  if (!(xmax > xmin)) xmax = xmin + 1;

  const int width = 1100, panel_h = 330, top_pad = 20;
  const int height = top_pad + panel_h * static_cast<int>(panels.size());
  const support::chart::Canvas canvas(width, height);
  cairo_t* cr = canvas.cr();

  const double left = 90, legend_w = 250, right = 20;
  for (size_t pi = 0; pi < panels.size(); ++pi) {
    const Panel& panel = panels[pi];
    const double y0 = top_pad + pi * panel_h + 30, y1 = top_pad + (pi + 1) * panel_h - 50;
    const double x0 = left, x1 = width - right - legend_w;
    // y range over this panel's curves.
    double ylo = std::numeric_limits<double>::infinity(), yhi = -ylo;
    for (const auto& r : runs)
      for (const auto& [m, s] : r.metrics)
        if (panel.match(m))
          for (double v : s.y) ylo = std::min(ylo, v), yhi = std::max(yhi, v);
    if (!(yhi > ylo)) yhi = ylo + (ylo == 0 ? 1 : std::abs(ylo) * 0.1);
    const double pad = (yhi - ylo) * 0.06;
    ylo -= pad, yhi += pad;
    auto px = [&](double x) { return x0 + (x - xmin) / (xmax - xmin) * (x1 - x0); };
    auto py = [&](double v) { return y1 - (v - ylo) / (yhi - ylo) * (y1 - y0); };

    cairo_set_source_rgb(cr, 0.985, 0.985, 0.99);
    cairo_rectangle(cr, x0, y0, x1 - x0, y1 - y0);
    cairo_fill(cr);
    // Grid and ticks.
    cairo_set_line_width(cr, 1.0);
    const double xs = nice_step(xmin, xmax, 8), ys = nice_step(ylo, yhi, 5);
    const int ydigits = std::min(8, std::max(0, -static_cast<int>(std::floor(std::log10(ys)))));
    const std::string yfmt = "%." + std::to_string(ydigits) + "f";
    for (double v = std::ceil(xmin / xs) * xs; v <= xmax + xs * 1e-9; v += xs) {
      cairo_set_source_rgb(cr, 0.88, 0.88, 0.90);
      cairo_move_to(cr, std::round(px(v)) + 0.5, y0);
      cairo_line_to(cr, std::round(px(v)) + 0.5, y1);
      cairo_stroke(cr);
      cairo_set_source_rgb(cr, 0.15, 0.15, 0.15);
      text(cr, format("%g", v), px(v), y1 + 18, 0.5, 12);
    }
    for (double v = std::ceil(ylo / ys) * ys; v <= yhi; v += ys) {
      const double shown = std::abs(v) < ys * 1e-9 ? 0.0 : v;
      cairo_set_source_rgb(cr, 0.88, 0.88, 0.90);
      cairo_move_to(cr, x0, std::round(py(v)) + 0.5);
      cairo_line_to(cr, x1, std::round(py(v)) + 0.5);
      cairo_stroke(cr);
      cairo_set_source_rgb(cr, 0.15, 0.15, 0.15);
      text(cr, ydigits > 4 ? format("%.2e", shown) : format(yfmt.c_str(), shown), x0 - 8, py(v) + 4, 1.0, 12);
    }
    cairo_set_source_rgb(cr, 0.15, 0.15, 0.15);
    cairo_set_line_width(cr, 1.2);
    cairo_rectangle(cr, x0, y0, x1 - x0, y1 - y0);
    cairo_stroke(cr);
    cairo_select_font_face(cr, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_BOLD);
    text(cr, panel.title, (x0 + x1) / 2, y0 - 10, 0.5, 15);
    cairo_select_font_face(cr, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
    text(cr, "step", (x0 + x1) / 2, y1 + 36, 0.5, 12);

    // Curves and legend.
    double ly = y0 + 12;
    for (size_t ri = 0; ri < runs.size(); ++ri) {
      const Rgb c = kRunColors[ri % (sizeof(kRunColors) / sizeof(kRunColors[0]))];
      for (const auto& [m, s] : runs[ri].metrics) {
        if (!panel.match(m)) continue;
        const bool faint = is_step(m) && runs[ri].metrics.count(m.substr(0, m.size() - 5) + "_epoch");
        const bool dashed = is_eval(m);
        const double dash[] = {7.0, 4.0};
        cairo_save(cr);
        cairo_rectangle(cr, x0, y0, x1 - x0, y1 - y0);
        cairo_clip(cr);
        cairo_set_source_rgba(cr, c.r, c.g, c.b, faint ? 0.35 : 1.0);
        cairo_set_line_width(cr, faint ? 1.0 : 2.0);
        cairo_set_dash(cr, dash, dashed ? 2 : 0, 0);
        for (size_t i = 0; i < s.x.size(); ++i) {
          if (i == 0) cairo_move_to(cr, px(s.x[i]), py(s.y[i]));
          else cairo_line_to(cr, px(s.x[i]), py(s.y[i]));
        }
        cairo_stroke(cr);
        if (s.x.size() <= 60 && !faint) {  // few points (epoch or val values): mark them
          cairo_set_dash(cr, nullptr, 0, 0);
          for (size_t i = 0; i < s.x.size(); ++i) {
            cairo_arc(cr, px(s.x[i]), py(s.y[i]), 2.8, 0, 2 * M_PI);
            cairo_fill(cr);
          }
        }
        cairo_restore(cr);
        if (ly < y1 - 4) {
          cairo_set_source_rgba(cr, c.r, c.g, c.b, faint ? 0.35 : 1.0);
          cairo_set_line_width(cr, 2.0);
          cairo_set_dash(cr, dash, dashed ? 2 : 0, 0);
          cairo_move_to(cr, x1 + 14, ly - 4);
          cairo_line_to(cr, x1 + 42, ly - 4);
          cairo_stroke(cr);
          cairo_set_dash(cr, nullptr, 0, 0);
          cairo_set_source_rgb(cr, 0.15, 0.15, 0.15);
          std::string label = (runs.size() > 1 ? runs[ri].label + " " : std::string()) + m;
          if (label.size() > 34) {
            label.resize(31);
            label += "...";
          }
          text(cr, label, x1 + 48, ly, 0.0, 11);
          ly += 17;
        }
      }
    }
  }
  if (const std::string failed = canvas.write_png(output); !failed.empty())
    throw RunError("plot: cannot write " + output + ": " + failed);
  out << "wrote " << output << " (" << panels.size() << " panels, " << runs.size() << " run" << (runs.size() > 1 ? "s" : "")
      << ")\n";
  return 0;
}

}  // namespace ember::engine

#else  // no cairo in this build: the command exists and says why it cannot draw

namespace ember::engine {

int plot_runs(const std::vector<std::string>&, const std::string&, std::ostream&) {
  throw UsageError("engine plot: this build has no cairo, so it cannot draw (install libcairo2-dev and rebuild; "
                   "the curves are in each run's metrics.csv)");
}

}  // namespace ember::engine
#endif
