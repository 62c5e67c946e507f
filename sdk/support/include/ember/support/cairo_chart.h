// Drawing pieces shared by the PNG charts Ember draws with cairo: `engine plot` (a run's metric
// curves) and the lr_find callback (the LR range test). Header-only; include it only where the
// build has cairo (Debian: libcairo2-dev; CMake: EMBER_WITH_CAIRO and PkgConfig::EMBER_CAIRO_PC).
#pragma once
#include <cairo.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>

namespace ember::support::chart {

struct Rgb {
  double r, g, b;
};
inline void set_color(cairo_t* cr, Rgb c, double alpha = 1.0) { cairo_set_source_rgba(cr, c.r, c.g, c.b, alpha); }

// 1-2-5 steps giving about `target` ticks over [lo, hi].
inline double nice_step(double lo, double hi, int target) {
  const double raw = (hi - lo) / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  return (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * mag;
}

// printf of one number (`f` is a format such as "%.3g").
inline std::string format(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

// Text in the current font and size.
inline double text_width(cairo_t* cr, const std::string& s) {
  cairo_text_extents_t e;
  cairo_text_extents(cr, s.c_str(), &e);
  return e.x_advance;
}
// Draws `s` with its anchor at (x, y): anchor 0 = left, 0.5 = centre, 1 = right; y is the baseline.
inline void draw_text(cairo_t* cr, const std::string& s, double x, double y, double anchor = 0.0) {
  cairo_move_to(cr, x - anchor * text_width(cr, s), y);
  cairo_show_text(cr, s.c_str());
}

// A white width x height ARGB image with its drawing context (antialiased, DejaVu Sans).
class Canvas {
 public:
  Canvas(int width, int height)
      : surface_(cairo_image_surface_create(CAIRO_FORMAT_ARGB32, width, height), &cairo_surface_destroy),
        cr_(cairo_create(surface_.get()), &cairo_destroy) {
    cairo_set_antialias(cr(), CAIRO_ANTIALIAS_BEST);
    cairo_select_font_face(cr(), "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
    cairo_set_source_rgb(cr(), 1, 1, 1);
    cairo_paint(cr());
  }
  cairo_t* cr() const { return cr_.get(); }
  // Writes the image as PNG; "" on success, else cairo's reason.
  std::string write_png(const std::string& path) const {
    cairo_surface_flush(surface_.get());
    const cairo_status_t status = cairo_surface_write_to_png(surface_.get(), path.c_str());
    return status == CAIRO_STATUS_SUCCESS ? std::string() : cairo_status_to_string(status);
  }
  // The image as PNG bytes (empty when cairo fails).
  std::string png_bytes() const {
    cairo_surface_flush(surface_.get());
    std::string out;
    auto append = [](void* closure, const unsigned char* data, unsigned int length) {
      static_cast<std::string*>(closure)->append(reinterpret_cast<const char*>(data), length);
      return CAIRO_STATUS_SUCCESS;
    };
    if (cairo_surface_write_to_png_stream(surface_.get(), append, &out) != CAIRO_STATUS_SUCCESS) return {};
    return out;
  }
  int width() const { return cairo_image_surface_get_width(surface_.get()); }
  int height() const { return cairo_image_surface_get_height(surface_.get()); }

 private:
  std::unique_ptr<cairo_surface_t, decltype(&cairo_surface_destroy)> surface_;
  std::unique_ptr<cairo_t, decltype(&cairo_destroy)> cr_;
};

}  // namespace ember::support::chart
