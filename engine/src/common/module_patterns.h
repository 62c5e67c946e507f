// The engine's rule for naming parts of a model in a config list (optimizer.backbone,
// model.init_exclude): an entry names a module (every parameter or buffer under it: "encoder"
// takes encoder.*), or one tensor by its whole name, or matches whole names as an ECMAScript
// regular expression ("layer[1-3]\\..*"). An entry that is not a valid expression matches as a
// name only. (optimizer.no_weight_decay and lora's target_modules match name endings instead:
// <ember/support/name_patterns.h>.)
#pragma once
#include <optional>
#include <regex>
#include <string>
#include <vector>

namespace ember::engine {

class ModulePatterns {
 public:
  explicit ModulePatterns(std::vector<std::string> entries) : entries_(std::move(entries)) {
    for (const auto& e : entries_) {
      try {
        expressions_.emplace_back(std::regex(e, std::regex::ECMAScript));
      } catch (const std::regex_error&) {
        expressions_.emplace_back(std::nullopt);
      }
    }
  }
  size_t size() const { return entries_.size(); }
  const std::string& entry(size_t i) const { return entries_.at(i); }
  // Whether `name` matches entry `i`.
  bool matches(const std::string& name, size_t i) const {
    const std::string& e = entries_[i];
    if (name == e || (name.size() > e.size() && name.compare(0, e.size(), e) == 0 && name[e.size()] == '.')) return true;
    return expressions_[i] && std::regex_match(name, *expressions_[i]);
  }
  bool matches(const std::string& name) const {
    for (size_t i = 0; i < entries_.size(); ++i)
      if (matches(name, i)) return true;
    return false;
  }

 private:
  std::vector<std::string> entries_;
  std::vector<std::optional<std::regex>> expressions_;
};

}  // namespace ember::engine
