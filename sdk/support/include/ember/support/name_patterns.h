// Name patterns for choosing a model's layers or parameters from a config list (lora's
// target_modules, optimizer.no_weight_decay): a name matches an entry when it ends with the
// entry at a '.' boundary ("bias" matches "h.0.attn.c_attn.bias" but not "h.0.unbias"; "mlp.c_fc"
// matches "h.3.mlp.c_fc") or when the entry, as an ECMAScript regular expression, matches the
// whole name ("h\\.[0-3]\\..*\\.weight"). An entry that is not a valid expression matches as a
// suffix only.
//
// Header-only, so the engine and plugins (which depend on the SDK only) share one rule.
#pragma once

#include <optional>
#include <regex>
#include <string>
#include <utility>
#include <vector>

namespace ember {

class NamePatterns {
 public:
  explicit NamePatterns(std::vector<std::string> entries) : entries_(std::move(entries)) {
    expressions_.reserve(entries_.size());
    for (const auto& e : entries_) {
      try {
        expressions_.emplace_back(std::regex(e, std::regex::ECMAScript));
      } catch (const std::regex_error&) {
        expressions_.emplace_back(std::nullopt);
      }
    }
  }

  const std::vector<std::string>& entries() const { return entries_; }
  bool empty() const { return entries_.empty(); }

  // Whether `name` matches entry `i`.
  bool matches(const std::string& name, size_t i) const {
    const std::string& p = entries_.at(i);
    if (name.size() >= p.size() && name.compare(name.size() - p.size(), p.size(), p) == 0 &&
        (name.size() == p.size() || name[name.size() - p.size() - 1] == '.'))
      return true;
    return expressions_[i] && std::regex_match(name, *expressions_[i]);
  }

  // Whether `name` matches any entry.
  bool matches(const std::string& name) const {
    for (size_t i = 0; i < entries_.size(); ++i)
      if (matches(name, i)) return true;
    return false;
  }

 private:
  std::vector<std::string> entries_;
  std::vector<std::optional<std::regex>> expressions_;
};

}  // namespace ember
