// Checkpoint file names, as Lightning's ModelCheckpoint.format_checkpoint_name builds them.
//
//   "{epoch}-{val_loss:.2f}"  ->  "epoch=3-val_loss=0.25"  (auto_insert_metric_name = true)
//                             ->  "3-0.25"                 (auto_insert_metric_name = false)
//
// A field is "{name}" or "{name:SPEC}"; the name runs up to the first ':' or '}' (so "val/acc"
// works, as in Lightning). SPEC is the printf-like subset of Python's format spec that file names
// use: [+][0][width][.precision][type], type one of d f F e E g G (or none). Header-only and free
// of Ember and LibTorch types so unit tests can compile it directly.
#pragma once
#include <ember/support/number_text.h>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace ember_checkpoint {

inline constexpr const char* kJoinChar = "-";       // Lightning's CHECKPOINT_JOIN_CHAR
inline constexpr const char* kEqualsChar = "=";     // CHECKPOINT_EQUALS_CHAR
inline constexpr const char* kNameLast = "last";    // CHECKPOINT_NAME_LAST
inline constexpr const char* kExtension = ".ckpt";  // FILE_EXTENSION
inline constexpr int kStartingVersion = 1;          // STARTING_VERSION

// The shortest text that reads back as the same number (see <ember/support/number_text.h>).
inline std::string shortest_number(double v) { return ember::shortest_number(v); }

// The parsed form of one SPEC.
struct FormatSpec {
  bool plus = false;   // '+': always print a sign
  bool zero = false;   // '0': pad with zeros to `width`
  int width = -1;      // -1: none
  int precision = -1;  // -1: none
  char type = 0;       // 'd', 'f', 'F', 'e', 'E', 'g', 'G' or 0 (shortest form)

  // Throws std::invalid_argument naming what is wrong.
  static FormatSpec parse(std::string_view s) {
    FormatSpec spec;
    size_t i = 0;
    auto digits = [&](int& out) {
      size_t start = i;
      int v = 0;
      while (i < s.size() && s[i] >= '0' && s[i] <= '9') {
        v = v * 10 + (s[i] - '0');
        if (v > 64) throw std::invalid_argument("width/precision over 64 in format '" + std::string(s) + "'");
        ++i;
      }
      if (i > start) out = v;
      return i > start;
    };
    if (i < s.size() && s[i] == '+') spec.plus = true, ++i;
    if (i < s.size() && s[i] == '0') spec.zero = true, ++i;
    digits(spec.width);
    if (i < s.size() && s[i] == '.') {
      ++i;
      if (!digits(spec.precision)) {
        throw std::invalid_argument("format '" + std::string(s) + "' has '.' without a precision");
      }
    }
    if (i < s.size()) {
      const char t = s[i++];
      if (std::string_view("dfFeEgG").find(t) == std::string_view::npos) {
        throw std::invalid_argument("format '" + std::string(s) + "' has unsupported type '" +
                                    std::string(1, t) + "' (use d, f, e or g)");
      }
      spec.type = t;
    }
    if (i != s.size()) {
      throw std::invalid_argument("format '" + std::string(s) +
                                  "' is not [+][0][width][.precision][d|f|e|g]");
    }
    if (spec.type == 'd' && spec.precision >= 0) {
      throw std::invalid_argument("format '" + std::string(s) + "': 'd' takes no precision");
    }
    return spec;
  }

  std::string format(double v) const {
    std::string flags = plus ? "+" : "";
    if (zero) flags += '0';
    const int w = width < 0 ? 0 : width;
    char buf[160];
    if (type == 'd') {
      // A metric formatted as an integer rounds to the nearest one (Python would refuse a float).
      const auto n = static_cast<long long>(std::llround(v));
      std::snprintf(buf, sizeof buf, ("%" + flags + "*lld").c_str(), w, n);
      return buf;
    }
    if (type != 0 || precision >= 0) {
      const char t = type != 0 ? type : 'g';  // Python: a bare precision behaves like 'g'
      const int p = precision >= 0 ? precision : 6;
      std::snprintf(buf, sizeof buf, ("%" + flags + "*.*" + std::string(1, t)).c_str(), w, p, v);
      return buf;
    }
    // No type: the shortest form, padded like a string of digits would be.
    std::string text = shortest_number(v);
    if (plus && !(text.size() > 0 && text[0] == '-')) text.insert(text.begin(), '+');
    if (static_cast<int>(text.size()) < w) {
      const size_t pad = static_cast<size_t>(w) - text.size();
      const bool sign = !text.empty() && (text[0] == '-' || text[0] == '+');
      if (zero && std::isfinite(v)) {
        text.insert(text.begin() + (sign ? 1 : 0), pad, '0');
      } else {
        text.insert(text.begin(), pad, ' ');
      }
    }
    return text;
  }
};

// Thrown by FilenameTemplate::format when a field names something the lookup does not know.
class UnknownName : public std::runtime_error {
 public:
  explicit UnknownName(std::string name)
      : std::runtime_error("unknown name '" + name + "'"), name_(std::move(name)) {}
  const std::string& name() const { return name_; }

 private:
  std::string name_;
};

// A parsed template: literal text and fields, in order.
class FilenameTemplate {
 public:
  struct Part {
    bool field = false;
    std::string text;  // literal text, or the field's name
    std::string spec_text;
    FormatSpec spec;
  };
  // Returns the value of a name, or nullopt when it is not known.
  using Lookup = std::function<std::optional<double>(const std::string&)>;

  // Throws std::invalid_argument on a syntax error (unclosed '{', stray '}', empty name, bad SPEC).
  explicit FilenameTemplate(std::string text) : text_(std::move(text)) {
    std::string literal;
    for (size_t i = 0; i < text_.size(); ++i) {
      const char c = text_[i];
      if (c == '}') throw std::invalid_argument("'}' without a matching '{' at offset " + std::to_string(i));
      if (c != '{') {
        literal += c;
        continue;
      }
      const size_t close = text_.find('}', i + 1);
      if (close == std::string::npos) {
        throw std::invalid_argument("'{' at offset " + std::to_string(i) + " is never closed");
      }
      const std::string inner = text_.substr(i + 1, close - i - 1);
      const size_t colon = inner.find(':');
      Part part;
      part.field = true;
      part.text = inner.substr(0, colon);
      if (part.text.empty() || part.text.find('{') != std::string::npos) {
        throw std::invalid_argument("empty or malformed field name at offset " + std::to_string(i));
      }
      if (colon != std::string::npos) {
        part.spec_text = inner.substr(colon + 1);
        part.spec = FormatSpec::parse(part.spec_text);
      }
      if (!literal.empty()) parts_.push_back(Part{false, std::move(literal), {}, {}});
      literal.clear();
      parts_.push_back(std::move(part));
      i = close;
    }
    if (!literal.empty()) parts_.push_back(Part{false, std::move(literal), {}, {}});
  }

  const std::string& text() const { return text_; }
  const std::vector<Part>& parts() const { return parts_; }
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& p : parts_) {
      if (p.field) out.push_back(p.text);
    }
    return out;
  }

  // The file name stem (no extension). With `auto_insert_metric_name`, each field becomes
  // "name=value" (Lightning's rule, applied even if the template already says "name=").
  // Throws UnknownName for a field the lookup does not know.
  std::string format(const Lookup& lookup, bool auto_insert_metric_name) const {
    std::string out;
    for (const auto& p : parts_) {
      if (!p.field) {
        out += p.text;
        continue;
      }
      const std::optional<double> v = lookup(p.text);
      if (!v) throw UnknownName(p.text);
      if (auto_insert_metric_name) out += p.text + kEqualsChar;
      out += p.spec.format(*v);
    }
    return out;
  }

 private:
  std::string text_;
  std::vector<Part> parts_;
};

// "<dir>/<stem>.ckpt", or with Lightning's version counter "<stem>-v1.ckpt", "<stem>-v2.ckpt"...
// while that file exists and is not `replacing` (the file this save is allowed to overwrite).
inline std::string checkpoint_path(const std::string& dir, const std::string& stem, int version = 0) {
  std::string name = stem;
  if (version > 0) name += std::string(kJoinChar) + "v" + std::to_string(version);
  name += kExtension;
  return dir.empty() ? name : (std::filesystem::path(dir) / name).string();
}

inline std::string versioned_checkpoint_path(const std::string& dir, const std::string& stem,
                                             const std::function<bool(const std::string&)>& exists,
                                             const std::string& replacing = "") {
  std::string path = checkpoint_path(dir, stem);
  for (int v = kStartingVersion; exists(path) && path != replacing; ++v) {
    path = checkpoint_path(dir, stem, v);
  }
  return path;
}

}  // namespace ember_checkpoint
