#include "checkpoint/container_types.h"

#include <torch/csrc/jit/serialization/unpickler.h>

#include <map>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace ember::engine {
namespace {
// Rebuilds every dict and list of a value with its recorded type (restore_types). Throws
// std::invalid_argument when the record does not fit the pickle.
struct Retyper {
  std::vector<c10::TypePtr> types;
  size_t next = 0;

  c10::TypePtr take() {
    if (next >= types.size()) throw std::invalid_argument("more containers than recorded types");
    return types[next++];
  }
  c10::IValue operator()(const c10::IValue& v) {
    if (v.isGenericDict()) {
      const auto t = take()->cast<c10::DictType>();
      if (!t) throw std::invalid_argument("a dict's recorded type is not a Dict");
      c10::impl::GenericDict out(t->getKeyType(), t->getValueType());
      const auto d = v.toGenericDict();
      out.reserve(d.size());
      for (const auto& e : d) {
        auto key = (*this)(e.key());
        out.insert_or_assign(std::move(key), (*this)(e.value()));
      }
      return out;
    }
    if (v.isList()) {
      const auto t = take()->cast<c10::ListType>();
      if (!t) throw std::invalid_argument("a list's recorded type is not a List");
      c10::impl::GenericList out(t->getElementType());
      const auto list = v.toList();
      out.reserve(list.size());
      for (size_t i = 0; i < list.size(); ++i) out.push_back((*this)(list.get(i)));
      return out;
    }
    if (v.isTuple()) {
      std::vector<c10::IValue> elements;
      for (const auto& e : v.toTupleRef().elements()) elements.push_back((*this)(e));
      return c10::ivalue::Tuple::create(std::move(elements));
    }
    return v;
  }
};
}  // namespace

std::string container_type(const c10::IValue& v) {
  if (v.isGenericDict()) {
    const auto d = v.toGenericDict();
    return c10::DictType::create(d.keyType(), d.valueType())->annotation_str();
  }
  return c10::ListType::create(v.toList().elementType())->annotation_str();
}

c10::IValue plain(const c10::IValue& v) {
  if (v.isGenericDict()) {
    const auto d = v.toGenericDict();
    c10::impl::GenericDict out(d.keyType(), d.valueType());
    out.reserve(d.size());
    for (const auto& e : d) out.insert_or_assign(plain(e.key()), plain(e.value()));
    return out;
  }
  if (v.isList()) {
    const auto list = v.toList();
    c10::impl::GenericList out(c10::AnyType::get());
    out.reserve(list.size());
    for (size_t i = 0; i < list.size(); ++i) out.push_back(plain(list.get(i)));
    return out;
  }
  if (v.isTuple()) {
    std::vector<c10::IValue> elements;
    for (const auto& e : v.toTupleRef().elements()) elements.push_back(plain(e));
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  return v;
}

c10::IValue restore_types(const c10::IValue& v, const std::string& record) {
  Retyper r;
  std::map<std::string, c10::TypePtr> parsed;
  std::istringstream in(record);
  for (std::string line; std::getline(in, line);) {
    auto it = parsed.find(line);
    if (it == parsed.end()) it = parsed.emplace(line, torch::jit::Unpickler::defaultTypeParser(line)).first;
    r.types.push_back(it->second);
  }
  auto out = r(v);
  if (r.next != r.types.size()) throw std::invalid_argument("fewer containers than recorded types");
  return out;
}

}  // namespace ember::engine
