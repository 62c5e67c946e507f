#include "checkpoint/omitted_parameters.h"

#include <ATen/ATen.h>
#include <ember/error.h>

#include <filesystem>
#include <set>

#include "checkpoint/checkpoint_document.h"
#include "checkpoint/crc32c.h"

namespace ember::engine {

c10::IValue OmittedParameters::to_ivalue() const {
  auto d = checkpoint_dict();
  c10::List<std::string> n;
  c10::List<int64_t> t;
  for (const auto& name : names) n.push_back(name);
  for (auto dtype : dtypes) t.push_back(static_cast<int64_t>(dtype));
  d.insert("names", n);
  d.insert("dtypes", t);
  d.insert("fingerprint", fingerprint);
  if (!base.empty()) {
    c10::List<std::string> b;
    for (const auto& name : from_base) b.push_back(name);
    d.insert("base", base);
    d.insert("from_base", b);
    if (!base_relative.empty()) d.insert("base_relative", base_relative);
  }
  d.insert("why", std::string(base.empty() ? "frozen parameters the model builds itself (ember::IFrozenParameters); loading takes them from the model"
                                            : "frozen parameters (ember::IFrozenParameters) whose values came from the run's model.init_checkpoint "
                                              "('base'); loading reads them from it, and the others from the model as it is built"));
  return d;
}

OmittedParameters OmittedParameters::from_ivalue(const c10::IValue& v, const std::string& where, const std::filesystem::path& holder) {
  const std::string bad = where + ": its omitted_parameters record is damaged (a foreign or broken checkpoint)";
  if (!v.isGenericDict()) throw RunError(bad);
  const auto d = v.toGenericDict();
  if (!d.contains("names") || !d.contains("dtypes") || !d.contains("fingerprint") || !d.at("names").isList() || !d.at("dtypes").isList() ||
      !d.at("fingerprint").isInt())
    throw RunError(bad);
  OmittedParameters o;
  for (const auto& e : d.at("names").toListRef()) {
    if (!e.isString()) throw RunError(bad);
    o.names.push_back(e.toStringRef());
  }
  for (const auto& e : d.at("dtypes").toListRef()) {
    if (!e.isInt()) throw RunError(bad);
    o.dtypes.push_back(static_cast<c10::ScalarType>(e.toInt()));
  }
  if (o.names.size() != o.dtypes.size()) throw RunError(bad);
  o.fingerprint = d.at("fingerprint").toInt();
  if (d.contains("base")) {
    if (!d.at("base").isString() || !d.contains("from_base") || !d.at("from_base").isList()) throw RunError(bad);
    o.base = d.at("base").toStringRef();
    const std::set<std::string> named(o.names.begin(), o.names.end());
    for (const auto& e : d.at("from_base").toListRef()) {
      if (!e.isString() || !named.count(e.toStringRef())) throw RunError(bad);
      o.from_base.push_back(e.toStringRef());
    }
    if (d.contains("base_relative")) {
      if (!d.at("base_relative").isString()) throw RunError(bad);
      o.base_relative = d.at("base_relative").toStringRef();
    }
    if (!o.base_relative.empty() && !holder.empty()) {
      std::error_code ec;
      const auto found = std::filesystem::weakly_canonical(std::filesystem::absolute(holder, ec).parent_path() / o.base_relative, ec);
      if (!ec) o.beside = found.string();
      if (!o.beside.empty() && !std::filesystem::exists(o.base, ec) && std::filesystem::exists(o.beside, ec)) {
        o.base = o.beside;
        o.moved = true;
      }
    }
  }
  return o;
}

std::string base_relative_to(const std::string& base, const std::vector<std::string>& checkpoints) {
  if (base.empty() || checkpoints.empty()) return {};
  std::error_code ec;
  const auto folder = std::filesystem::absolute(checkpoints.front(), ec).parent_path();
  if (ec) return {};
  for (const auto& c : checkpoints)
    if (std::filesystem::absolute(c, ec).parent_path() != folder) return {};
  // (weakly_canonical on both sides: `..` then means the same on disk as the path the OS resolves)
  const auto relative = std::filesystem::relative(base, folder, ec);
  return ec ? std::string() : relative.string();
}

int64_t fingerprint_of(const std::vector<std::string>& names, const std::function<at::Tensor(const std::string&)>& tensor_of) {
  std::vector<uint32_t> parts;
  for (const auto& name : names) {
    const at::Tensor t = tensor_of(name).detach().to(at::kCPU).to(at::kFloat).contiguous();
    std::vector<int64_t> shape = t.sizes().vec();
    parts.push_back(crc32c(name.data(), name.size()));
    parts.push_back(crc32c(shape.data(), shape.size() * sizeof(int64_t)));
    parts.push_back(crc32c(t.data_ptr(), t.nbytes()));
  }
  return static_cast<int64_t>(crc32c(parts.data(), parts.size() * sizeof(uint32_t)));
}

c10::Dict<std::string, at::Tensor> without_omitted(const c10::Dict<std::string, at::Tensor>& state, const std::vector<std::string>& names,
                                                   std::optional<int64_t>& fingerprint, OmittedParameters& record) {
  const std::set<std::string> omit(names.begin(), names.end());
  c10::Dict<std::string, at::Tensor> kept;
  record = OmittedParameters{};
  for (const auto& e : state) {
    if (!omit.count(e.key())) {
      kept.insert(e.key(), e.value());
      continue;
    }
    record.names.push_back(e.key());
    record.dtypes.push_back(e.value().scalar_type());
  }
  if (!fingerprint) fingerprint = fingerprint_of(record.names, [&](const std::string& n) { return state.at(n); });
  record.fingerprint = *fingerprint;
  return kept;
}

std::string from_base_text(const std::string& where, size_t count, const std::string& base) {
  return where + " leaves out " + std::to_string(count) + " frozen parameters whose values come from " + base +
         " (model.init_checkpoint of the run that wrote it)";
}

std::string unreadable_base(const std::string& where, const OmittedParameters& omitted, int depth) {
  std::error_code ec;
  const size_t count = omitted.from_base.size();
  if (!std::filesystem::exists(omitted.base, ec))
    return from_base_text(where, count, omitted.base) + ", and that is gone" +
           (omitted.beside.empty() || omitted.beside == omitted.base
                ? std::string()
                : " (nor is it at " + omitted.beside + ", where it lay relative to this checkpoint)") +
           ": put it (or a link to it) back there; checkpoints that stand alone are written with the frozen weights kept "
           "(lora.save_frozen = true)";
  if (depth >= 8)
    return from_base_text(where, count, omitted.base) +
           ", which takes them from yet another checkpoint, more than 8 deep (does a checkpoint name itself as its base?)";
  return {};
}

void fill_omitted(c10::Dict<std::string, at::Tensor>& state, const OmittedParameters& omitted,
                  const std::function<std::optional<at::Tensor>(const std::string&)>& own, const std::string& where) {
  c10::Dict<std::string, at::Tensor> mine;
  for (size_t i = 0; i < omitted.names.size(); ++i) {
    const auto& name = omitted.names[i];
    auto t = own(name);
    if (!t)
      throw RunError(where + " leaves out the frozen parameter '" + name + "' (it holds the trained ones only), and this model has no such "
                             "parameter: load it into the model it was trained on");
    mine.insert(name, t->detach().to(omitted.dtypes[i]));
  }
  const int64_t here = fingerprint_of(omitted.names, [&](const std::string& n) { return mine.at(n); });
  if (here != omitted.fingerprint)
    throw RunError(where + " holds only what was trained (" + std::to_string(state.size()) + " tensors) and its " +
                   std::to_string(omitted.names.size()) + " frozen parameters differ in this run from the ones it was trained on " +
                   "(fingerprint " + hex32(static_cast<uint32_t>(here)) + ", saved " + hex32(static_cast<uint32_t>(omitted.fingerprint)) +
                   (omitted.base.empty()
                        ? "): use the same base model (model_dir, seed, precision), or train with the frozen weights saved (lora.save_frozen = true)"
                        : "; " + std::to_string(omitted.from_base.size()) + " of them come from " + omitted.base +
                              ", its run's model.init_checkpoint): put that checkpoint back as it was, and build the model as that run did "
                              "(model_dir, seed, precision)"));
  for (const auto& e : mine) state.insert(e.key(), e.value());
}

}  // namespace ember::engine
