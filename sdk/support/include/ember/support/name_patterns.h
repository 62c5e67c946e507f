// Name patterns for choosing a model's layers or parameters from a config list. Two rules:
//
// NameRule::suffix (lora's target_modules, optimizer.no_weight_decay): a name matches an entry
// when it ends with the entry at a '.' boundary ("bias" matches "h.0.attn.c_attn.bias" but not
// "h.0.unbias"; "mlp.c_fc" matches "h.3.mlp.c_fc").
// NameRule::module (optimizer.backbone, model.init_exclude): a name matches an entry that names
// it or a module above it ("encoder" matches "encoder.layer.0.weight", not "encoder_2.weight").
//
// Under either rule a name also matches when the entry, as an ECMAScript regular expression,
// matches the whole name ("h\\.[0-3]\\..*\\.weight"). An entry that is not a valid expression
// matches by the rule only.
//
// Header-only, so the engine and plugins (which depend on the SDK only) share one rule.
#pragma once

#include <optional>
#include <regex>
#include <string>
#include <utility>
#include <vector>

namespace ember {

enum class NameRule { suffix, module };

class NamePatterns {
 public:
  explicit NamePatterns(std::vector<std::string> entries, NameRule rule = NameRule::suffix) : entries_(std::move(entries)), rule_(rule) {
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
  size_t size() const { return entries_.size(); }

  // Whether `name` matches entry `i`.
  bool matches(const std::string& name, size_t i) const {
    const std::string& p = entries_.at(i);
    if (name.size() == p.size() ? name == p : name.size() > p.size() && by_rule(name, p)) return true;
    return expressions_[i] && std::regex_match(name, *expressions_[i]);
  }

  // Whether `name` matches any entry.
  bool matches(const std::string& name) const {
    for (size_t i = 0; i < entries_.size(); ++i)
      if (matches(name, i)) return true;
    return false;
  }

 private:
  // `name` is longer than `p`: it ends with ".p" (suffix) or starts with "p." (module).
  bool by_rule(const std::string& name, const std::string& p) const {
    if (rule_ == NameRule::suffix) return name.compare(name.size() - p.size(), p.size(), p) == 0 && name[name.size() - p.size() - 1] == '.';
    return name.compare(0, p.size(), p) == 0 && name[p.size()] == '.';
  }

  std::vector<std::string> entries_;
  NameRule rule_;
  std::vector<std::optional<std::regex>> expressions_;
};

}  // namespace ember
