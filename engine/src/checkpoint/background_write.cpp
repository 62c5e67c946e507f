#include "checkpoint/background_write.h"

#include <ATen/ATen.h>

#include <exception>
#include <utility>
#include <vector>

namespace ember::engine {

namespace {
at::Tensor host_copy(const at::Tensor& t) {
  if (!t.defined()) return t;
  if (t.device().is_cpu()) return t.detach().clone();
  // Pinned host memory (LibTorch's caching host allocator reuses it from one save to the next).
  at::Tensor out = at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kCPU).pinned_memory(true));
  out.copy_(t.detach(), /*non_blocking=*/false);
  return out;
}
}  // namespace

c10::IValue host_snapshot(const c10::IValue& v) {
  if (v.isTensor()) return host_copy(v.toTensor());
  if (v.isGenericDict()) {
    const auto in = v.toGenericDict();
    c10::impl::GenericDict out(in.keyType(), in.valueType());
    out.reserve(in.size());
    for (const auto& e : in) out.insert(host_snapshot(e.key()), host_snapshot(e.value()));
    return out;
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) out.push_back(host_copy(t));
    return out;
  }
  if (v.isList()) {
    const auto in = v.toList();
    c10::impl::GenericList out(in.elementType());
    out.reserve(in.size());
    for (const auto& e : in) out.push_back(host_snapshot(e));
    return out;
  }
  if (v.isTuple()) {
    std::vector<c10::IValue> elements;
    for (const auto& e : v.toTupleRef().elements()) elements.push_back(host_snapshot(e));
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  return v;  // numbers, strings, None: immutable
}

namespace {
// `v` is reached from the handed-over value through dictionaries that only their parent holds.
// A tensor then is the only handle on its TensorImpl (its IValue holds the one reference) and the
// only TensorImpl on its storage: no other code can write to it. Lists and tuples are copied
// (their elements are not reached by reference).
c10::IValue take(const c10::IValue& v, int64_t* taken_bytes) {
  if (v.use_count() != 1) return host_snapshot(v);
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    // (No allocator: memory the storage does not own, from_blob's, which its owner may change.)
    if (!t.defined() || !t.device().is_cpu() || !t.has_storage() || t.storage().use_count() != 1 || t.storage().allocator() == nullptr)
      return host_snapshot(v);
    *taken_bytes += static_cast<int64_t>(t.storage().nbytes());
    return v;
  }
  if (!v.isGenericDict()) return host_snapshot(v);
  const auto in = v.toGenericDict();
  c10::impl::GenericDict out(in.keyType(), in.valueType());
  out.reserve(in.size());
  for (const auto& e : in) out.insert(host_snapshot(e.key()), take(e.value(), taken_bytes));
  return out;
}
}  // namespace

c10::IValue take_host_snapshot(c10::IValue&& value, int64_t* taken_bytes) {
  const c10::IValue owned = std::move(value);
  return take(owned, taken_bytes);
}

c10::Dict<std::string, at::Tensor> host_snapshot(const c10::Dict<std::string, at::Tensor>& tensors) {
  c10::Dict<std::string, at::Tensor> out;
  out.reserve(tensors.size());
  for (const auto& e : tensors) out.insert(e.key(), host_copy(e.value()));
  return out;
}

BackgroundWrite::~BackgroundWrite() {
  if (thread_.joinable()) thread_.join();
}

void BackgroundWrite::start(std::function<void()> write) {
  done_.store(false, std::memory_order_relaxed);
  error_.clear();
  thread_ = std::thread([this, write = std::move(write)] {
    try {
      write();
    } catch (const std::exception& e) {
      error_ = e.what();
      if (error_.empty()) error_ = "unknown error";
    } catch (...) {
      error_ = "unknown error";
    }
    done_.store(true, std::memory_order_release);
  });
}

std::string BackgroundWrite::wait() {
  if (thread_.joinable()) thread_.join();
  return std::move(error_);
}

}  // namespace ember::engine
