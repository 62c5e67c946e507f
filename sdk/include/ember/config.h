// ember::IConfig: a plugin's own config table, as the engine resolved it.
//
// The engine validates the table against the plugin's EmberConfigKey list before create():
// unknown keys, wrong types, out-of-range values and invalid choices never reach a plugin.
// Every key with a default is present; a key without a default is present only if the user set it.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ember/export.h"

namespace ember {

class EMBER_SDK_API IConfig {
 public:
  virtual ~IConfig() = default;
  // Requires: nothing. Ensures: true when the key has a value (set by the user or by a default).
  virtual bool has(std::string_view key) const = 0;
  // Requires: has(key) and the key's type matches. Throws ember::ConfigError otherwise.
  virtual bool get_bool(std::string_view key) const = 0;
  virtual int64_t get_int(std::string_view key) const = 0;
  // Accepts INT, FLOAT and NUMBER keys.
  virtual double get_float(std::string_view key) const = 0;
  virtual std::string get_string(std::string_view key) const = 0;
  virtual std::vector<int64_t> get_int_list(std::string_view key) const = 0;
  virtual std::vector<double> get_float_list(std::string_view key) const = 0;
  virtual std::vector<std::string> get_string_list(std::string_view key) const = 0;
  // For NUMBER keys: true when the user wrote an integer (a count), false for a float (a fraction).
  virtual bool is_integer(std::string_view key) const = 0;
  // "run.toml:12:7" where the key was set, "default" or "--set" otherwise: for error messages.
  virtual std::string where(std::string_view key) const = 0;
  // The table's name ("checkpoint", "model", ...).
  virtual std::string section() const = 0;
};

}  // namespace ember
