// Static types of a checkpoint's containers. Untagged pickles (what torch.load accepts without
// allow-listing) lose the static types of dicts and lists (Dict[str, Tensor], List[float], ...),
// which C++ readers rely on (toTensorList, toTypedDict). The writer records them in `ember/types`,
// one TorchScript annotation per line, in the order for_each_container visits the containers; the
// reader puts them back.
#pragma once
#include <ATen/core/ivalue.h>

#include <string>

namespace ember::engine {

template <typename F>
void for_each_container(const c10::IValue& v, const F& f) {
  if (v.isGenericDict()) {
    f(v);
    for (const auto& e : v.toGenericDict()) {
      for_each_container(e.key(), f);
      for_each_container(e.value(), f);
    }
  } else if (v.isList()) {
    f(v);
    const auto list = v.toList();
    for (size_t i = 0; i < list.size(); ++i) for_each_container(list.get(i), f);
  } else if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) for_each_container(e, f);
  }
}

// The TorchScript annotation of a dict's or list's static type ("Dict[str, Tensor]").
std::string container_type(const c10::IValue& v);
// `v` with every list as a plain List[Any]: LibTorch's pickler writes List[int], List[float],
// List[bool] and List[Tensor] through torch.jit._pickle helpers that torch.load refuses.
c10::IValue plain(const c10::IValue& v);
// The inverse: every dict and list of `v` rebuilt with the types `record` lists. Throws
// std::invalid_argument when the record does not fit.
c10::IValue restore_types(const c10::IValue& v, const std::string& record);

}  // namespace ember::engine
