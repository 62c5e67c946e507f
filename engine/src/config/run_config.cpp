#include "config/run_config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <sstream>

namespace ember::engine {
namespace {

std::shared_ptr<toml::node> copy_node(const toml::node& n) {
  return n.visit([](const auto& v) -> std::shared_ptr<toml::node> {
    return std::make_shared<std::decay_t<decltype(v)>>(v);
  });
}

std::string position(const toml::node& n, const std::string& fallback_path) {
  const auto& src = n.source();
  if (src.begin.line == 0) return fallback_path;
  std::string file = src.path ? *src.path : fallback_path;
  return file + ":" + std::to_string(src.begin.line) + ":" + std::to_string(src.begin.column);
}

std::string render(const toml::node& n) {
  std::ostringstream out;
  n.visit([&](const auto& v) { out << v; });
  return out.str();
}

std::string describe(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::string: return "string " + render(n);
    case toml::node_type::integer: return "integer " + render(n);
    case toml::node_type::floating_point: return "float " + render(n);
    case toml::node_type::boolean: return "boolean " + render(n);
    case toml::node_type::array: return "array " + render(n);
    case toml::node_type::table: return "table";
    default: return "date/time " + render(n);
  }
}

std::vector<std::string> split(std::string_view text, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    auto pos = text.find(sep, start);
    out.emplace_back(text.substr(start, pos == std::string_view::npos ? text.npos : pos - start));
    if (pos == std::string_view::npos) break;
    start = pos + 1;
  }
  return out;
}

// Errors name what the user wrote (keys, values, --set text), which may hold line breaks or
// other control characters: they are escaped, so every error stays one line.
UsageError usage_error(const std::string& message) {
  std::string out;
  out.reserve(message.size());
  for (const char c : message) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (u < 0x20 || u == 0x7F) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[u >> 4];
      out += kHex[u & 15];
    } else out += c;
  }
  return UsageError(out);
}

// Whether `text` is well-formed UTF-8 (what TOML requires of a file; --set text is checked the same).
bool valid_utf8(std::string_view s) {
  static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};  // smallest code point per length
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t extra = 0;
    uint32_t cp = c;
    if (c < 0x80) {
      ++i;
      continue;
    }
    if ((c & 0xE0) == 0xC0) extra = 1, cp = c & 0x1F;
    else if ((c & 0xF0) == 0xE0) extra = 2, cp = c & 0x0F;
    else if ((c & 0xF8) == 0xF0) extra = 3, cp = c & 0x07;
    else return false;
    if (i + extra >= s.size()) return false;
    for (size_t k = 1; k <= extra; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    // Overlong forms, surrogates and code points past U+10FFFF are not UTF-8 either.
    if (cp < kMin[extra] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += extra + 1;
  }
  return true;
}

std::shared_ptr<toml::node> parse_value(const std::string& text) {
  auto tbl = toml::parse("v = " + text);
  return copy_node(*tbl.get("v"));
}

std::string format_number(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

// Checks one value against its key schema. Returns "" when valid, else what is wrong.
std::string check_value(const KeySchema& k, const toml::node& n) {
  auto number_ok = [&](const toml::node& e, bool int_only) -> std::string {
    if (int_only && !e.is_integer()) return "expected an integer, got " + describe(e);
    if (!e.is_integer() && !e.is_floating_point()) return "expected a number, got " + describe(e);
    double v = e.is_integer() ? static_cast<double>(e.as_integer()->get()) : e.as_floating_point()->get();
    if (std::isnan(v)) return "must be a number, got nan";
    // TOML's inf is a number. A key with a range is a bounded quantity whose range reads
    // "[0, inf)": infinity is outside it, unless the range names it as an inclusive end (an lr of
    // inf trained nothing but nan). A key without a range (a scripted metric value, a threshold)
    // may take it.
    if (std::isinf(v) && (k.flags & (EMBER_KEY_HAS_MIN | EMBER_KEY_HAS_MAX))) {
      const bool named = v > 0 ? (k.flags & EMBER_KEY_HAS_MAX) && !(k.flags & EMBER_KEY_MAX_EXCLUSIVE) && std::isinf(k.max_value)
                               : (k.flags & EMBER_KEY_HAS_MIN) && !(k.flags & EMBER_KEY_MIN_EXCLUSIVE) && std::isinf(k.min_value);
      if (!named) return "must be a finite number, got " + render(e);
    }
    if (k.flags & EMBER_KEY_HAS_MIN) {
      bool excl = k.flags & EMBER_KEY_MIN_EXCLUSIVE;
      if (excl ? !(v > k.min_value) : !(v >= k.min_value))
        return std::string("must be ") + (excl ? "> " : ">= ") + format_number(k.min_value) + ", got " + render(e);
    }
    if (k.flags & EMBER_KEY_HAS_MAX) {
      bool excl = k.flags & EMBER_KEY_MAX_EXCLUSIVE;
      if (excl ? !(v < k.max_value) : !(v <= k.max_value))
        return std::string("must be ") + (excl ? "< " : "<= ") + format_number(k.max_value) + ", got " + render(e);
    }
    return "";
  };
  auto string_ok = [&](const toml::node& e) -> std::string {
    if (!e.is_string()) return "expected a string, got " + describe(e);
    if (!k.choices.empty()) {
      auto choices = split(k.choices, '|');
      const auto& s = e.as_string()->get();
      if (std::find(choices.begin(), choices.end(), s) == choices.end()) {
        std::string hint = did_you_mean(s, choices);
        return "must be one of " + k.choices + ", got \"" + s + "\"" + hint;
      }
    }
    return "";
  };
  auto list_ok = [&](auto&& element_ok) -> std::string {
    if (!n.is_array()) return "expected an array, got " + describe(n);
    for (const auto& e : *n.as_array())
      if (auto err = element_ok(e); !err.empty()) return "element " + err;
    return "";
  };
  switch (k.type) {
    case EMBER_TYPE_BOOL: return n.is_boolean() ? "" : "expected true or false, got " + describe(n);
    case EMBER_TYPE_INT: return number_ok(n, true);
    case EMBER_TYPE_FLOAT:
    case EMBER_TYPE_NUMBER: return number_ok(n, false);
    case EMBER_TYPE_STRING: return string_ok(n);
    case EMBER_TYPE_INT_LIST: return list_ok([&](const toml::node& e) { return number_ok(e, true); });
    case EMBER_TYPE_FLOAT_LIST: return list_ok([&](const toml::node& e) { return number_ok(e, false); });
    case EMBER_TYPE_STRING_LIST: return list_ok(string_ok);
  }
  return "has an unknown type";
}

// Optimal string alignment distance: a swap of two neighbours ("mpl" for "mlp") counts as one
// edit, so typos like that find their name before shorter, unrelated ones ("dp").
size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> before(b.size() + 1), prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) cur[j] = std::min(cur[j], before[j - 2] + 1);
    }
    std::swap(before, prev);
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

}  // namespace

std::string closest_name(std::string_view name, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = std::max<size_t>(2, name.size() / 3) + 1;
  for (const auto& c : candidates) {
    size_t d = edit_distance(name, c);
    // Rewriting every letter of a short name is no hint ("17" is not a typo of "dp").
    if (d >= std::min(name.size(), c.size())) continue;
    if (c.starts_with(name) || name.starts_with(c)) d = std::min(d, std::max<size_t>(1, d / 2));
    if (d < best_d) best_d = d, best = c;
  }
  return best;
}

std::string did_you_mean(std::string_view name, const std::vector<std::string>& candidates) {
  auto c = closest_name(name, candidates);
  return c.empty() ? "" : " (did you mean '" + c + "'?)";
}

namespace {
// What follows "unknown key": for a name another tool uses (SectionSchema::elsewhere), what to
// write instead; else the closest key, or the closest such name with its advice (a typo of
// Lightning's `period` is still Lightning's period).
std::string unknown_key_hint(const SectionSchema& schema, const std::string& key, const std::vector<std::string>& key_names) {
  if (auto it = schema.elsewhere.find(key); it != schema.elsewhere.end()) return "; " + it->second;
  std::vector<std::string> names = key_names;
  for (const auto& [name, instead] : schema.elsewhere) names.push_back(name);
  const std::string closest = closest_name(key, names);
  if (closest.empty()) return "";
  if (auto it = schema.elsewhere.find(closest); it != schema.elsewhere.end())
    return " (did you mean '" + closest + "'? " + it->second + ")";
  return " (did you mean '" + closest + "'?)";
}
}  // namespace

std::string type_name(EmberConfigType type) {
  switch (type) {
    case EMBER_TYPE_BOOL: return "bool";
    case EMBER_TYPE_INT: return "int";
    case EMBER_TYPE_FLOAT: return "float";
    case EMBER_TYPE_STRING: return "string";
    case EMBER_TYPE_NUMBER: return "int|float";
    case EMBER_TYPE_INT_LIST: return "[int]";
    case EMBER_TYPE_FLOAT_LIST: return "[float]";
    case EMBER_TYPE_STRING_LIST: return "[string]";
  }
  return "?";
}

const KeySchema* SectionSchema::find(std::string_view key) const {
  for (const auto& k : keys)
    if (k.key == key) return &k;
  return nullptr;
}

std::vector<KeySchema> keys_from_descriptor(const EmberConfigKey* keys, uint32_t count) {
  std::vector<KeySchema> out;
  for (uint32_t i = 0; i < count; ++i) {
    const auto& k = keys[i];
    if (k.flags & EMBER_KEY_ELSEWHERE) continue;
    KeySchema s;
    s.key = k.key ? k.key : "";
    s.type = static_cast<EmberConfigType>(k.type);
    s.flags = k.flags;
    if (k.default_toml) s.default_toml = k.default_toml;
    s.help = k.help ? k.help : "";
    s.choices = k.choices ? k.choices : "";
    s.min_value = k.min_value;
    s.max_value = k.max_value;
    out.push_back(std::move(s));
  }
  return out;
}

std::map<std::string, std::string> elsewhere_from_descriptor(const EmberConfigKey* keys, uint32_t count) {
  std::map<std::string, std::string> out;
  for (uint32_t i = 0; i < count; ++i)
    if ((keys[i].flags & EMBER_KEY_ELSEWHERE) && keys[i].key) out[keys[i].key] = keys[i].help ? keys[i].help : "";
  return out;
}

// ---------------------------------------------------------------------------------------------
namespace {
template <class Parse>
RawConfig parse_raw(const std::string& path, Parse parse) {
  RawConfig raw;
  raw.path = path;
  try {
    raw.file = parse();
  } catch (const toml::parse_error& e) {
    const auto& b = e.source().begin;
    if (b.line == 0) throw usage_error(path + ": " + std::string(e.description()));
    throw usage_error(path + ":" + std::to_string(b.line) + ":" + std::to_string(b.column) + ": " +
                     std::string(e.description()));
  }
  return raw;
}
}  // namespace

RawConfig RawConfig::load(const std::string& path) {
  // TOML++ says "File could not be opened for reading" for a missing file, and reads a folder as
  // an empty config (then "[model] name is required"): say what is wrong with the path.
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw usage_error(path + " is a folder, not a config file: give a run's .toml file (configs/ holds examples)");
  if (!std::filesystem::exists(path, ec)) throw usage_error(path + ": no such config file (configs/ holds examples)");
  return parse_raw(path, [&] { return toml::parse_file(path); });
}

RawConfig RawConfig::parse(std::string_view text, const std::string& path) {
  return parse_raw(path, [&] { return toml::parse(text, path); });
}

void RawConfig::add_override(const std::string& assignment) {
  if (!valid_utf8(assignment))
    throw usage_error("--set " + assignment + ": not valid UTF-8 (configuration text must be UTF-8, as TOML requires)");
  auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0)
    throw usage_error("--set " + assignment + ": expected section.key=value, e.g. --set trainer.max_epochs=3");
  std::string lhs = assignment.substr(0, eq), text = assignment.substr(eq + 1);
  auto dot = lhs.find('.');
  if (dot == std::string::npos || dot == 0 || dot + 1 == lhs.size() || lhs.find('.', dot + 1) != std::string::npos)
    throw usage_error("--set " + assignment + ": expected section.key=value with exactly one dot, e.g. --set optimizer.lr=0.01");
  std::shared_ptr<toml::node> value;
  std::string not_a_number;
  try {
    value = parse_value(text);
  } catch (const toml::parse_error& e) {
    // Not a TOML literal: take it as a bare string (`--set model.name=cnn`).
    value = std::make_shared<toml::value<std::string>>(text);
    const size_t digit = text.find_first_not_of("+-.");
    if (digit != std::string::npos && digit <= 1 && std::isdigit(static_cast<unsigned char>(text[digit]))) {
      const std::string_view why = e.description();
      const size_t colon = why.find(": ");  // after "Error while parsing decimal integer"
      not_a_number = std::string(colon == std::string_view::npos ? why : why.substr(colon + 2));
    }
  }
  overrides.push_back({lhs.substr(0, dot), lhs.substr(dot + 1), assignment, value, not_a_number});
}

std::optional<std::string> RawConfig::peek_string(std::string_view section, std::string_view key) const {
  for (auto it = overrides.rbegin(); it != overrides.rend(); ++it)
    if (it->section == section && it->key == key && it->value->is_string()) return it->value->as_string()->get();
  if (auto* tbl = file.get_as<toml::table>(section))
    if (auto* v = tbl->get_as<std::string>(key)) return v->get();
  return std::nullopt;
}

void RawConfig::integer_as_string(const std::string& section, const std::string& key) {
  if (auto* tbl = file.get_as<toml::table>(section))
    if (auto* v = tbl->get_as<int64_t>(key)) {
      const auto source = v->source();
      toml::value<std::string> text(std::to_string(v->get()));
      tbl->insert_or_assign(key, std::move(text));
      // Keep the position, so later errors about this value still name file:line:col.
      if (auto* n = tbl->get(key)) const_cast<toml::source_region&>(n->source()) = source;
    }
  for (auto& o : overrides)
    if (o.section == section && o.key == key && o.value->is_integer())
      o.value = std::make_shared<toml::value<std::string>>(std::to_string(o.value->as_integer()->get()));
}

void RawConfig::bool_as_integer(const std::string& section, const std::string& key) {
  if (auto* tbl = file.get_as<toml::table>(section))
    if (auto* v = tbl->get_as<bool>(key)) {
      const auto source = v->source();
      tbl->insert_or_assign(key, toml::value<int64_t>(v->get() ? 1 : 0));
      if (auto* n = tbl->get(key)) const_cast<toml::source_region&>(n->source()) = source;
    }
  for (auto& o : overrides)
    if (o.section == section && o.key == key && o.value->is_boolean())
      o.value = std::make_shared<toml::value<int64_t>>(o.value->as_boolean()->get() ? 1 : 0);
}

void RawConfig::rewrite_as_integer(const std::string& section, const std::string& key,
                                   const std::function<std::optional<int64_t>(const toml::node&)>& to) {
  if (auto* tbl = file.get_as<toml::table>(section))
    if (auto* n = tbl->get(key))
      if (const auto value = to(*n)) {
        const auto source = n->source();
        tbl->insert_or_assign(key, toml::value<int64_t>(*value));
        if (auto* m = tbl->get(key)) const_cast<toml::source_region&>(m->source()) = source;
      }
  for (auto& o : overrides)
    if (o.section == section && o.key == key)
      if (const auto value = to(*o.value)) o.value = std::make_shared<toml::value<int64_t>>(*value);
}

std::vector<std::string> RawConfig::plugin_list() const {
  std::vector<std::string> out;
  const toml::node* n = file.get("plugins");
  if (!n) return out;
  if (!n->is_array())
    throw usage_error(position(*n, path) + ": plugins: expected an array of plugin names, e.g. plugins = [\"csv\", \"checkpoint\"]");
  for (const auto& e : *n->as_array()) {
    if (!e.is_string())
      throw usage_error(position(e, path) + ": plugins: expected plugin names (strings), got " + describe(e));
    out.push_back(e.as_string()->get());
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
const toml::node& Section::node(std::string_view key) const {
  auto it = entries_.find(std::string(key));
  if (it == entries_.end() || !it->second.value)
    throw ConfigError(schema_->name + "." + std::string(key) + " is not set" +
                      (schema_->find(key) ? "" : " (the plugin asked for a key it did not declare)"));
  return *it->second.value;
}

bool Section::has(std::string_view key) const {
  auto it = entries_.find(std::string(key));
  return it != entries_.end() && it->second.value != nullptr;
}

bool Section::get_bool(std::string_view key) const {
  const auto& n = node(key);
  if (!n.is_boolean()) throw ConfigError(schema_->name + "." + std::string(key) + " is not a bool");
  return n.as_boolean()->get();
}

int64_t Section::get_int(std::string_view key) const {
  const auto& n = node(key);
  if (n.is_integer()) return n.as_integer()->get();
  if (n.is_floating_point()) {
    // Only integral values int64 can hold: casting 1e300 would be undefined (found by fuzzing).
    double v = n.as_floating_point()->get();
    if (std::floor(v) == v && v >= -0x1p63 && v < 0x1p63) return static_cast<int64_t>(v);
  }
  throw ConfigError(schema_->name + "." + std::string(key) + " is not an integer");
}

double Section::get_float(std::string_view key) const {
  const auto& n = node(key);
  if (n.is_integer()) return static_cast<double>(n.as_integer()->get());
  if (n.is_floating_point()) return n.as_floating_point()->get();
  throw ConfigError(schema_->name + "." + std::string(key) + " is not a number");
}

std::string Section::get_string(std::string_view key) const {
  const auto& n = node(key);
  if (!n.is_string()) throw ConfigError(schema_->name + "." + std::string(key) + " is not a string");
  return n.as_string()->get();
}

std::vector<int64_t> Section::get_int_list(std::string_view key) const {
  std::vector<int64_t> out;
  const auto& n = node(key);
  if (!n.is_array()) throw ConfigError(schema_->name + "." + std::string(key) + " is not a list");
  for (const auto& e : *n.as_array()) out.push_back(e.value<int64_t>().value_or(0));
  return out;
}

std::vector<double> Section::get_float_list(std::string_view key) const {
  std::vector<double> out;
  const auto& n = node(key);
  if (!n.is_array()) throw ConfigError(schema_->name + "." + std::string(key) + " is not a list");
  for (const auto& e : *n.as_array())
    out.push_back(e.is_integer() ? static_cast<double>(e.as_integer()->get()) : e.value<double>().value_or(0));
  return out;
}

std::vector<std::string> Section::get_string_list(std::string_view key) const {
  std::vector<std::string> out;
  const auto& n = node(key);
  if (!n.is_array()) throw ConfigError(schema_->name + "." + std::string(key) + " is not a list");
  for (const auto& e : *n.as_array()) out.push_back(e.value<std::string>().value_or(""));
  return out;
}

bool Section::is_integer(std::string_view key) const { return node(key).is_integer(); }

std::string Section::where(std::string_view key) const {
  auto it = entries_.find(std::string(key));
  return it == entries_.end() ? "unset" : it->second.where;
}

// ---------------------------------------------------------------------------------------------
ResolvedConfig ResolvedConfig::resolve(const RawConfig& raw, std::vector<SectionSchema> schemas,
                                       std::vector<std::string> plugins) {
  ResolvedConfig rc;
  rc.plugins_ = std::move(plugins);
  std::vector<std::string> section_names;
  for (auto& s : schemas) {
    section_names.push_back(s.name);
    rc.schemas_.push_back(std::make_unique<SectionSchema>(std::move(s)));
  }
  const std::string& path = raw.path;

  // Every table in the file must be a known section, every key a known key.
  for (const auto& [k, node] : raw.file) {
    std::string name(k.str());
    if (name == "plugins") continue;
    if (!node.is_table())
      throw usage_error(position(node, path) + ": '" + name + "' is not a section; settings belong in a table such as [trainer]" +
                       did_you_mean(name, section_names));
    if (std::find(section_names.begin(), section_names.end(), name) == section_names.end())
      throw usage_error(position(node, path) + ": unknown section [" + name + "]" + did_you_mean(name, section_names) +
                       "; a plugin's section is only valid when the plugin is loaded (--plugins or plugins = [...])");
  }
  for (const auto& o : raw.overrides) {
    if (std::find(section_names.begin(), section_names.end(), o.section) == section_names.end())
      throw usage_error("--set " + o.text + ": unknown section '" + o.section + "'" + did_you_mean(o.section, section_names));
  }

  for (const auto& schema : rc.schemas_) {
    auto section = std::make_unique<Section>(schema.get());
    std::vector<std::string> key_names;
    for (const auto& k : schema->keys) key_names.push_back(k.key);
    const toml::table* tbl = raw.file.get_as<toml::table>(schema->name);
    if (tbl) {
      for (const auto& [k, node] : *tbl) {
        std::string key(k.str());
        if (!schema->find(key))
          throw usage_error(position(node, path) + ": " + schema->name + "." + key + ": unknown key" +
                           unknown_key_hint(*schema, key, key_names) +
                           (schema->elsewhere.count(key) ? "" : "; `engine config` lists the valid keys"));
      }
    }
    for (const auto& o : raw.overrides)
      if (o.section == schema->name && !schema->find(o.key))
        throw usage_error("--set " + o.text + ": unknown key '" + o.key + "' in [" + schema->name + "]" +
                         unknown_key_hint(*schema, o.key, key_names));

    for (const auto& k : schema->keys) {
      Section::Entry entry;
      const RawConfig::Override* over = nullptr;
      for (const auto& o : raw.overrides)
        if (o.section == schema->name && o.key == k.key) over = &o;
      if (over) {
        entry.value = over->value;
        entry.where = "--set " + over->text;
      } else if (const toml::node* n = tbl ? tbl->get(k.key) : nullptr) {
        entry.value = copy_node(*n);
        entry.where = position(*n, path);
      } else if (k.default_toml) {
        entry.value = parse_value(*k.default_toml);
        entry.where = "default";
      }
      if (entry.value) {
        // A string key whose choices include true and false (data.on_device = "auto|true|false",
        // checkpoint.save_last = "true|false|link") takes TOML's true and false as those words:
        // its help says "true = always", so `on_device = true` must not be a type error.
        if (k.type == EMBER_TYPE_STRING && entry.value->is_boolean()) {
          const auto choices = split(k.choices, '|');
          if (std::find(choices.begin(), choices.end(), "true") != choices.end() &&
              std::find(choices.begin(), choices.end(), "false") != choices.end())
            entry.value = std::make_shared<toml::value<std::string>>(entry.value->as_boolean()->get() ? "true" : "false");
        }
        if (auto err = check_value(k, *entry.value); !err.empty()) {
          // A value of the wrong type says what the key takes (its help): "all" for devices, say.
          const bool wrong_type = err.rfind("expected ", 0) == 0 || err.rfind("element expected ", 0) == 0;
          if (over && !over->not_a_number.empty() && (err.rfind("expected a number", 0) == 0 || err.rfind("expected an integer", 0) == 0))
            err += " (TOML does not read it as a number: " + over->not_a_number + ")";
          throw usage_error(entry.where + ": " + schema->name + "." + k.key + ": " + err +
                            (entry.where == "default" ? " (a bug in the plugin's schema)"
                             : wrong_type && !k.help.empty() ? " -- " + k.help
                                                             : ""));
        }
      }
      section->entries()[k.key] = std::move(entry);
    }
    rc.sections_.push_back(std::move(section));
  }
  return rc;
}

const Section& ResolvedConfig::section(std::string_view name) const {
  for (const auto& s : sections_)
    if (s->section() == name) return *s;
  throw std::logic_error("no config section [" + std::string(name) + "]");
}

void ResolvedConfig::set(std::string_view section, std::string_view key, const std::string& value, const std::string& where) {
  for (auto& s : sections_)
    if (s->section() == section) {
      s->entries()[std::string(key)] = Section::Entry{std::make_shared<toml::value<std::string>>(value), where};
      return;
    }
  throw std::logic_error("no config section [" + std::string(section) + "]");
}

bool ResolvedConfig::has_section(std::string_view name) const {
  for (const auto& s : sections_)
    if (s->section() == name) return true;
  return false;
}

std::string ResolvedConfig::to_toml() const {
  std::ostringstream out;
  out << "# Resolved by `engine config`: defaults, the file and --set overrides. Feed it back with\n"
         "# `engine this.toml`. Unset optional keys are shown as comments.\n";
  out << "plugins = [";
  for (size_t i = 0; i < plugins_.size(); ++i) out << (i ? ", " : "") << '"' << plugins_[i] << '"';
  out << "]\n";
  for (const auto& s : sections_) {
    out << "\n[" << s->section() << "]";
    if (!s->schema().description.empty()) out << "  # " << s->schema().description;
    out << "\n";
    for (const auto& k : s->schema().keys) {
      const auto& e = s->entries().at(k.key);
      if (e.value)
        out << k.key << " = " << render(*e.value) << "\n";
      else
        out << "# " << k.key << " =   # unset: " << k.help << "\n";
    }
  }
  return out.str();
}

}  // namespace ember::engine
