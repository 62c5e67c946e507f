// Run configuration: the TOML file, `--set` overrides and every section's schema, resolved into
// validated values with their source (file:line:column, "--set" or "default").
#pragma once
#include <ember/abi.h>
#include <ember/config.h>
#include <ember/error.h>
#include <ember/library.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <toml++/toml.h>

namespace ember::engine {

// A bad configuration or command line: printed as one line, exit code 2.
class EMBER_API UsageError : public std::runtime_error {  // exported: `engine` catches it by type
 public:
  using std::runtime_error::runtime_error;
};

struct KeySchema {
  std::string key;
  EmberConfigType type = EMBER_TYPE_STRING;
  uint32_t flags = 0;
  std::optional<std::string> default_toml;  // nullopt: optional key without a default
  std::string help;
  std::string choices;  // "a|b|c" or empty
  double min_value = 0, max_value = 0;
};

struct SectionSchema {
  std::string name;         // table name in run.toml
  std::string description;  // what the section configures (shown by `engine config`)
  std::vector<KeySchema> keys;
  // Keys users bring from another tool (Lightning's Trainer flags) that Ember takes elsewhere:
  // key -> what to write instead, added to the "unknown key" error.
  std::map<std::string, std::string> elsewhere;
  const KeySchema* find(std::string_view key) const;
};

// A descriptor's keys, without the names flagged EMBER_KEY_ELSEWHERE (which are not keys).
std::vector<KeySchema> keys_from_descriptor(const EmberConfigKey* keys, uint32_t count);
// The names flagged EMBER_KEY_ELSEWHERE: name -> what to write instead (SectionSchema::elsewhere).
std::map<std::string, std::string> elsewhere_from_descriptor(const EmberConfigKey* keys, uint32_t count);

// The user's input before schemas are known: the parsed file and the overrides.
struct RawConfig {
  std::string path;  // "" when no file was given
  toml::table file;
  struct Override {
    std::string section, key, text;
    std::shared_ptr<toml::node> value;
    // Why TOML did not read a number-like value as a number ("'1e999' could not be interpreted
    // as a value"): it is taken as a string, and a number key's error says why.
    std::string not_a_number;
  };
  std::vector<Override> overrides;

  static RawConfig load(const std::string& path);             // throws UsageError with file:line:col
  // The same for TOML text already in memory; `path` names it in positions and errors.
  static RawConfig parse(std::string_view text, const std::string& path);
  void add_override(const std::string& assignment);           // "section.key=value"
  // A raw string value (override first, then file) before validation; used to pick plugins.
  std::optional<std::string> peek_string(std::string_view section, std::string_view key) const;
  std::vector<std::string> plugin_list() const;  // top-level `plugins = [...]`
  // Rewrites an integer value of section.key (file and overrides) as its decimal string, for keys
  // that take Lightning's integer shorthands (precision = 16).
  void integer_as_string(const std::string& section, const std::string& key);
  // Rewrites a boolean value of section.key as 1 / 0, for integer keys that take Lightning's
  // boolean shorthand (fast_dev_run = true).
  void bool_as_integer(const std::string& section, const std::string& key);
  // Replaces a value of section.key (file and overrides) by the integer `to` returns for it, where
  // it returns one (devices = "auto" -> the visible GPUs); file positions are kept.
  void rewrite_as_integer(const std::string& section, const std::string& key,
                          const std::function<std::optional<int64_t>(const toml::node&)>& to);
};

// One validated section; implements the SDK's IConfig for the plugin that owns it.
class Section final : public IConfig {
 public:
  struct Entry {
    std::shared_ptr<toml::node> value;  // null when unset
    std::string where;                  // "run.toml:3:14", "--set", "default"
  };
  Section(const SectionSchema* schema) : schema_(schema) {}
  const SectionSchema& schema() const { return *schema_; }
  std::map<std::string, Entry>& entries() { return entries_; }
  const std::map<std::string, Entry>& entries() const { return entries_; }

  bool has(std::string_view key) const override;
  bool get_bool(std::string_view key) const override;
  int64_t get_int(std::string_view key) const override;
  double get_float(std::string_view key) const override;
  std::string get_string(std::string_view key) const override;
  std::vector<int64_t> get_int_list(std::string_view key) const override;
  std::vector<double> get_float_list(std::string_view key) const override;
  std::vector<std::string> get_string_list(std::string_view key) const override;
  bool is_integer(std::string_view key) const override;
  std::string where(std::string_view key) const override;
  std::string section() const override { return schema_->name; }

 private:
  const toml::node& node(std::string_view key) const;
  const SectionSchema* schema_;
  std::map<std::string, Entry> entries_;
};

class ResolvedConfig {
 public:
  // Validates `raw` against `schemas` (in print order). Throws UsageError on the first problem.
  static ResolvedConfig resolve(const RawConfig& raw, std::vector<SectionSchema> schemas,
                                std::vector<std::string> plugins);
  const Section& section(std::string_view name) const;
  bool has_section(std::string_view name) const;
  // Replaces a value after validation (used to record the plugins actually chosen).
  void set(std::string_view section, std::string_view key, const std::string& value, const std::string& where);
  // The whole configuration as TOML that can be fed back to the engine.
  std::string to_toml() const;
  const std::vector<std::string>& plugins() const { return plugins_; }

 private:
  std::vector<std::unique_ptr<SectionSchema>> schemas_;
  std::vector<std::unique_ptr<Section>> sections_;
  std::vector<std::string> plugins_;
};

// The closest candidate to `name` by edit distance, or "" when nothing is close.
std::string closest_name(std::string_view name, const std::vector<std::string>& candidates);
std::string did_you_mean(std::string_view name, const std::vector<std::string>& candidates);
std::string type_name(EmberConfigType type);

}  // namespace ember::engine
