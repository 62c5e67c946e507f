// Draws the LR range test with cairo: log-scaled rate axis with decade ticks, the raw losses as
// faint points, the smoothed curve, and the suggested rate as a point, a dashed vertical line
// and a legend entry.
#include "plot.h"

#include <ember/support/cairo_chart.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace ember_lr_find {
namespace {

namespace support = ember::support;

constexpr double kPi = 3.14159265358979323846;

using support::chart::format;
using support::chart::nice_step;
using support::chart::Rgb;
constexpr Rgb kInk{0.15, 0.15, 0.15};
constexpr Rgb kGrid{0.88, 0.88, 0.90};
constexpr Rgb kMinorGrid{0.94, 0.94, 0.95};
constexpr Rgb kCurve{0.12, 0.47, 0.71};
constexpr Rgb kMark{0.84, 0.15, 0.16};

void color(cairo_t* cr, Rgb c, double alpha = 1.0) { support::chart::set_color(cr, c, alpha); }

struct Text {
  cairo_t* cr;
  void size(double s) const { cairo_set_font_size(cr, s); }
  double width(const std::string& s) const { return support::chart::text_width(cr, s); }
  void draw(const std::string& s, double x, double y, double ax = 0.0) const { support::chart::draw_text(cr, s, x, y, ax); }
};

}  // namespace

void write_plot(const std::string& path, const PlotData& d, int width, int height) {
  const size_t n = d.lrs.size();
  const support::chart::Canvas canvas(width, height);
  cairo_t* cr = canvas.cr();
  cairo_font_options_t* fo = cairo_font_options_create();
  cairo_font_options_set_antialias(fo, CAIRO_ANTIALIAS_GRAY);
  cairo_font_options_set_hint_style(fo, CAIRO_HINT_STYLE_SLIGHT);
  cairo_set_font_options(cr, fo);
  cairo_font_options_destroy(fo);
  Text text{cr};

  const double left = 92, right = 28, top = 62, bottom = 72;
  const double x0 = left, x1 = width - right, y0 = top, y1 = height - bottom;

  // Data ranges. The y range follows the smoothed curve (the raw points scatter around it) and
  // is capped at 3x the first smoothed loss so a final blow-up does not flatten the rest.
  auto X = [&](double lr) { return d.log_x ? std::log10(lr) : lr; };
  double xlo = n ? X(d.lrs.front()) : 0, xhi = n ? X(d.lrs.back()) : 1;
  if (!(xhi > xlo)) xhi = xlo + 1;
  double ylo = std::numeric_limits<double>::infinity(), yhi = -ylo;
  for (size_t i = 0; i < n; ++i) {
    if (std::isfinite(d.smoothed[i])) {
      ylo = std::min(ylo, d.smoothed[i]);
      yhi = std::max(yhi, d.smoothed[i]);
    }
  }
  if (!std::isfinite(ylo)) ylo = 0, yhi = 1;
  if (n && std::isfinite(d.smoothed.front()) && d.smoothed.front() > 0) yhi = std::min(yhi, 3.0 * std::max(d.smoothed.front(), ylo));
  for (size_t i = 0; i < n; ++i)
    if (std::isfinite(d.losses[i]) && d.losses[i] <= yhi) ylo = std::min(ylo, d.losses[i]);
  if (!(yhi > ylo)) yhi = ylo + (ylo == 0 ? 1 : std::abs(ylo) * 0.1);
  const double pad = (yhi - ylo) * 0.06;
  ylo -= pad;
  yhi += pad;
  const double ystep = nice_step(ylo, yhi, 6);

  auto px = [&](double lr) { return x0 + (X(lr) - xlo) / (xhi - xlo) * (x1 - x0); };
  auto py = [&](double v) { return y1 - (v - ylo) / (yhi - ylo) * (y1 - y0); };

  // Plot area and grid.
  cairo_set_source_rgb(cr, 0.985, 0.985, 0.99);
  cairo_rectangle(cr, x0, y0, x1 - x0, y1 - y0);
  cairo_fill(cr);
  cairo_set_line_width(cr, 1.0);
  struct Tick {
    double x;
    std::string base, exponent;  // label "10" with a superscript, or plain text in base
  };
  std::vector<Tick> xticks;
  if (d.log_x) {
    for (int e = static_cast<int>(std::floor(xlo)); e <= static_cast<int>(std::ceil(xhi)); ++e) {
      for (int m = 1; m <= 9; ++m) {
        const double v = e + std::log10(static_cast<double>(m));
        if (v < xlo - 1e-9 || v > xhi + 1e-9) continue;
        const double x = x0 + (v - xlo) / (xhi - xlo) * (x1 - x0);
        if (m == 1) {
          xticks.push_back({x, "10", std::to_string(e)});
        } else {
          color(cr, kMinorGrid);
          cairo_move_to(cr, std::round(x) + 0.5, y0);
          cairo_line_to(cr, std::round(x) + 0.5, y1);
          cairo_stroke(cr);
        }
      }
    }
    if (xticks.size() < 2) {  // less than a decade: label the ends instead
      xticks.clear();
      xticks.push_back({x0, format("%.3g", d.lrs.front()), ""});
      xticks.push_back({x1, format("%.3g", d.lrs.back()), ""});
    }
  } else {
    const double s = nice_step(xlo, xhi, 6);
    for (double v = std::ceil(xlo / s) * s; v <= xhi + s * 1e-9; v += s)
      xticks.push_back({x0 + (v - xlo) / (xhi - xlo) * (x1 - x0), format("%g", std::abs(v) < s * 1e-9 ? 0.0 : v), ""});
  }
  color(cr, kGrid);
  for (const auto& t : xticks) {
    cairo_move_to(cr, std::round(t.x) + 0.5, y0);
    cairo_line_to(cr, std::round(t.x) + 0.5, y1);
  }
  std::vector<double> yticks;
  for (double v = std::ceil(ylo / ystep) * ystep; v <= yhi; v += ystep) yticks.push_back(std::abs(v) < ystep * 1e-9 ? 0.0 : v);
  for (double v : yticks) {
    cairo_move_to(cr, x0, std::round(py(v)) + 0.5);
    cairo_line_to(cr, x1, std::round(py(v)) + 0.5);
  }
  cairo_stroke(cr);

  // Axes frame and tick labels.
  color(cr, kInk);
  cairo_set_line_width(cr, 1.2);
  cairo_rectangle(cr, x0, y0, x1 - x0, y1 - y0);
  cairo_stroke(cr);
  text.size(13);
  for (const auto& t : xticks) {
    cairo_move_to(cr, t.x, y1);
    cairo_line_to(cr, t.x, y1 + 5);
    cairo_stroke(cr);
    if (t.exponent.empty()) {
      text.draw(t.base, t.x, y1 + 22, 0.5);
    } else {
      text.size(13);
      const double wb = text.width(t.base);
      text.size(9.5);
      const double we = text.width(t.exponent);
      const double start = t.x - (wb + we) / 2;
      text.size(13);
      text.draw(t.base, start, y1 + 24);
      text.size(9.5);
      text.draw(t.exponent, start + wb + 0.5, y1 + 16);
      text.size(13);
    }
  }
  const int ydigits = std::max(0, -static_cast<int>(std::floor(std::log10(ystep))));
  const std::string yfmt = "%." + std::to_string(std::min(ydigits, 8)) + "f";
  for (double v : yticks) {
    cairo_move_to(cr, x0 - 5, py(v));
    cairo_line_to(cr, x0, py(v));
    cairo_stroke(cr);
    text.draw(format(yfmt.c_str(), v), x0 - 9, py(v) + 4.5, 1.0);
  }

  // Titles.
  text.size(18);
  cairo_select_font_face(cr, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_BOLD);
  text.draw(d.title, (x0 + x1) / 2, 36, 0.5);
  cairo_select_font_face(cr, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
  text.size(14);
  text.draw(d.log_x ? "learning rate (log scale)" : "learning rate", (x0 + x1) / 2, height - 22, 0.5);
  cairo_save(cr);
  cairo_translate(cr, 26, (y0 + y1) / 2);
  cairo_rotate(cr, -kPi / 2);
  text.draw("loss", 0, 0, 0.5);
  cairo_restore(cr);

  // Data, clipped to the plot area.
  cairo_save(cr);
  cairo_rectangle(cr, x0, y0, x1 - x0, y1 - y0);
  cairo_clip(cr);
  color(cr, kCurve, 0.28);
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(d.losses[i])) continue;
    cairo_new_sub_path(cr);
    cairo_arc(cr, px(d.lrs[i]), py(d.losses[i]), 2.3, 0, 2 * kPi);
  }
  cairo_fill(cr);
  color(cr, kCurve);
  cairo_set_line_width(cr, 2.4);
  cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
  bool pen = false;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(d.smoothed[i])) {
      pen = false;
      continue;
    }
    const double y = std::min(py(d.smoothed[i]), y1 + 1e4);
    if (pen) cairo_line_to(cr, px(d.lrs[i]), std::max(y, y0 - 1e4));
    else cairo_move_to(cr, px(d.lrs[i]), std::max(y, y0 - 1e4));
    pen = true;
  }
  cairo_stroke(cr);
  if (d.suggested) {
    const double sx = px(d.lrs[*d.suggested]), sy = py(d.smoothed[*d.suggested]);
    color(cr, kMark, 0.8);
    cairo_set_line_width(cr, 1.5);
    const double dash[] = {6.0, 4.0};
    cairo_set_dash(cr, dash, 2, 0);
    cairo_move_to(cr, sx, y0);
    cairo_line_to(cr, sx, y1);
    cairo_stroke(cr);
    cairo_set_dash(cr, nullptr, 0, 0);
    cairo_new_path(cr);
    cairo_arc(cr, sx, sy, 6.5, 0, 2 * kPi);
    cairo_set_source_rgb(cr, 1, 1, 1);
    cairo_fill_preserve(cr);
    color(cr, kMark);
    cairo_set_line_width(cr, 2.5);
    cairo_stroke(cr);
    cairo_arc(cr, sx, sy, 3.0, 0, 2 * kPi);
    cairo_fill(cr);
  }
  cairo_restore(cr);

  // Legend, top right inside the plot.
  struct Entry {
    int kind;  // 0 dot, 1 line, 2 marker
    std::string label;
  };
  std::vector<Entry> entries = {{0, "loss per step"}, {1, "smoothed loss"}};
  if (d.suggested) entries.push_back({2, "suggested lr = " + format("%.3g", d.lrs[*d.suggested])});
  text.size(13);
  double lw = 0;
  for (const auto& e : entries) lw = std::max(lw, text.width(e.label));
  const double bw = lw + 58, bh = 12 + 22.0 * entries.size();
  // The corner whose box covers the fewest data points (top right first).
  double bx = x1 - bw - 12, by = y0 + 12;
  size_t fewest = SIZE_MAX;
  for (const auto& [cx, cy] : {std::pair{x1 - bw - 12, y0 + 12}, std::pair{x0 + 12, y0 + 12},
                               std::pair{x1 - bw - 12, y1 - bh - 12}, std::pair{x0 + 12, y1 - bh - 12}}) {
    size_t covered = 0;
    for (size_t i = 0; i < n; ++i)
      for (double v : {d.smoothed[i], d.losses[i]}) {
        const double x = px(d.lrs[i]), y = std::isfinite(v) ? py(v) : -1;
        if (x >= cx - 4 && x <= cx + bw + 4 && y >= cy - 4 && y <= cy + bh + 4) ++covered;
      }
    if (covered < fewest) {
      fewest = covered;
      bx = cx;
      by = cy;
    }
  }
  cairo_rectangle(cr, bx, by, bw, bh);
  cairo_set_source_rgba(cr, 1, 1, 1, 0.92);
  cairo_fill_preserve(cr);
  color(cr, kGrid);
  cairo_set_line_width(cr, 1);
  cairo_stroke(cr);
  for (size_t i = 0; i < entries.size(); ++i) {
    const double cy = by + 17 + 22.0 * i, cx = bx + 24;
    const auto& e = entries[i];
    cairo_new_path(cr);  // show_text left a current point: arcs would start with a line from it
    if (e.kind == 0) {
      color(cr, kCurve, 0.45);
      cairo_arc(cr, cx, cy, 3, 0, 2 * kPi);
      cairo_fill(cr);
    } else if (e.kind == 1) {
      color(cr, kCurve);
      cairo_set_line_width(cr, 2.4);
      cairo_move_to(cr, cx - 14, cy);
      cairo_line_to(cr, cx + 14, cy);
      cairo_stroke(cr);
    } else {
      cairo_arc(cr, cx, cy, 5.5, 0, 2 * kPi);
      cairo_set_source_rgb(cr, 1, 1, 1);
      cairo_fill_preserve(cr);
      color(cr, kMark);
      cairo_set_line_width(cr, 2.2);
      cairo_stroke(cr);
      cairo_arc(cr, cx, cy, 2.5, 0, 2 * kPi);
      cairo_fill(cr);
    }
    color(cr, kInk);
    text.draw(e.label, bx + 46, cy + 4.5);
  }

  if (const std::string failed = canvas.write_png(path); !failed.empty())
    throw std::runtime_error("cannot write " + path + ": " + failed);
}

}  // namespace ember_lr_find
