// Building and reading a plugin's state_dict (a dict str -> value) with clear errors when a
// checkpoint holds something else. Header-only, shared by the scheduler and averaging plugins.
#pragma once
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <string>
#include <vector>

#include <ember/error.h>

namespace ember::support {

using StateDict = c10::impl::GenericDict;

inline StateDict new_state() { return StateDict(c10::StringType::get(), c10::AnyType::get()); }

// Reads entries of a state written by the same plugin; any mismatch is one RunError that names
// the plugin and the entry.
class StateReader {
 public:
  StateReader(const c10::IValue& state, std::string plugin) : plugin_(std::move(plugin)) {
    if (!state.isGenericDict()) fail(std::string("expected a dict, got ") + state.tagKind());
    dict_ = state.toGenericDict();
  }
  bool has(const std::string& key) const { return dict_.contains(key); }
  c10::IValue get(const std::string& key) const {
    auto it = dict_.find(c10::IValue(key));
    if (it == dict_.end()) fail("'" + key + "' is missing");
    return it->value();
  }
  int64_t get_int(const std::string& key) const {
    auto v = get(key);
    if (!v.isInt()) fail("'" + key + "' is a " + v.tagKind() + ", not an int");
    return v.toInt();
  }
  double get_double(const std::string& key) const {
    auto v = get(key);
    if (v.isInt()) return static_cast<double>(v.toInt());
    if (!v.isDouble()) fail("'" + key + "' is a " + v.tagKind() + ", not a float");
    return v.toDouble();
  }
  bool get_bool(const std::string& key) const {
    auto v = get(key);
    if (!v.isBool()) fail("'" + key + "' is a " + v.tagKind() + ", not a bool");
    return v.toBool();
  }
  std::string get_string(const std::string& key) const {
    auto v = get(key);
    if (!v.isString()) fail("'" + key + "' is a " + v.tagKind() + ", not a string");
    return v.toStringRef();
  }
  std::vector<double> get_doubles(const std::string& key) const {
    auto v = get(key);
    if (!v.isDoubleList()) fail("'" + key + "' is a " + v.tagKind() + ", not a list of floats");
    auto l = v.toDoubleList();
    return std::vector<double>(l.begin(), l.end());
  }
  std::vector<at::Tensor> get_tensors(const std::string& key) const {
    auto v = get(key);
    if (!v.isTensorList()) fail("'" + key + "' is a " + v.tagKind() + ", not a list of tensors");
    return v.toTensorVector();
  }
  [[noreturn]] void fail(const std::string& what) const {
    throw ember::RunError(plugin_ + ": malformed state in the checkpoint: " + what +
                          " (was it written by another plugin named '" + plugin_ + "'?)");
  }

 private:
  std::string plugin_;
  c10::impl::GenericDict dict_{c10::StringType::get(), c10::AnyType::get()};
};

inline c10::List<double> double_list(const std::vector<double>& v) {
  c10::List<double> out;
  for (double x : v) out.push_back(x);
  return out;
}

inline c10::List<at::Tensor> tensor_list(const std::vector<at::Tensor>& v) {
  c10::List<at::Tensor> out;
  for (const auto& t : v) out.push_back(t);
  return out;
}

}  // namespace ember::support
