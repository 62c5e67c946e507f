// The checkpoint callback's state as a checkpoint holds it (the layout state_dict() writes, like
// Lightning's ModelCheckpoint.state_dict), read back and checked: a malformed state is one clear
// error naming what is wrong, not a crash.
#pragma once
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <limits>
#include <optional>
#include <string>

#include <ember/error.h>

#include "topk.h"

namespace ember_checkpoint {

// A number stored in a checkpoint state: a float, an int or a one-element tensor (Lightning
// stores tensors).
inline std::optional<double> as_number(const c10::IValue& v) {
  if (v.isDouble()) return v.toDouble();
  if (v.isInt()) return static_cast<double>(v.toInt());
  if (v.isTensor() && v.toTensor().numel() == 1) return v.toTensor().item<double>();
  return std::nullopt;
}

// The callback's state after it was read from a checkpoint and checked.
struct SavedState {
  std::string dirpath, monitor, mode;
  TopKState topk;
};

[[noreturn]] inline void malformed(const std::string& what) {
  throw ember::RunError("checkpoint: malformed state in the checkpoint: " + what +
                        " (was it written by another plugin named 'checkpoint'?)");
}

// Checks the layout that state_dict() writes (see there) and converts it.
inline SavedState parse_state(const c10::IValue& state, Mode default_mode) {
  if (!state.isGenericDict()) malformed(std::string("expected a dict, got ") + state.tagKind());
  const auto dict = state.toGenericDict();
  for (const auto& entry : dict) {
    if (!entry.key().isString()) malformed("a key is a " + entry.key().tagKind() + ", not a string");
  }
  auto get = [&](const char* key) -> std::optional<c10::IValue> {
    auto it = dict.find(c10::IValue(std::string(key)));
    if (it == dict.end()) return std::nullopt;
    return it->value();
  };
  auto get_string = [&](const char* key, bool required) -> std::string {
    auto v = get(key);
    if (!v) {
      if (required) malformed(std::string("'") + key + "' is missing");
      return "";
    }
    if (!v->isString()) malformed(std::string("'") + key + "' is a " + v->tagKind() + ", not a string");
    return v->toStringRef();
  };

  SavedState out;
  out.dirpath = get_string("dirpath", false);
  out.monitor = get_string("monitor", false);
  out.mode = get_string("mode", false);
  if (out.mode.empty()) out.mode = mode_name(default_mode);
  if (out.mode != "min" && out.mode != "max") malformed("'mode' is '" + out.mode + "'");
  auto& t = out.topk;
  t.best_model_path = get_string("best_model_path", true);
  t.kth_best_model_path = get_string("kth_best_model_path", false);
  t.last_model_path = get_string("last_model_path", false);

  if (auto v = get("best_model_score"); v && !v->isNone()) {
    auto n = as_number(*v);
    if (!n) malformed("'best_model_score' is a " + v->tagKind() + ", not a number");
    t.best_model_score = *n;
  }
  const double inf = std::numeric_limits<double>::infinity();
  t.kth_value = out.mode == "min" ? inf : -inf;
  if (auto v = get("kth_value"); v && !v->isNone()) {
    auto n = as_number(*v);
    if (!n) malformed("'kth_value' is a " + v->tagKind() + ", not a number");
    t.kth_value = *n;
  }
  if (auto v = get("best_k_models"); v && !v->isNone()) {
    if (!v->isGenericDict()) malformed("'best_k_models' is a " + v->tagKind() + ", not a dict");
    for (const auto& e : v->toGenericDict()) {
      auto score = as_number(e.value());
      if (!e.key().isString() || !score) malformed("'best_k_models' must map file paths to numbers");
      t.best_k_models.emplace_back(e.key().toStringRef(), *score);
    }
  }
  if (!t.kth_best_model_path.empty() && t.find(t.kth_best_model_path) == nullptr) {
    malformed("'kth_best_model_path' is not one of 'best_k_models'");
  }
  return out;
}

}  // namespace ember_checkpoint
