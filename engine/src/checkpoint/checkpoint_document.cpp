#include "checkpoint/checkpoint_document.h"

#include <ember/abi.h>

#include <ATen/ATen.h>
#include <torch/headeronly/version.h>

#include <cstring>

#include "checkpoint/checkpoint_io.h"
#include "common/version.h"
#include "runtime/accelerator.h"

namespace ember::engine {

c10::impl::GenericDict checkpoint_dict() { return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()); }

c10::impl::GenericDict checkpoint_header(int64_t epoch, int64_t global_step, bool weights_only, const std::string& config_toml) {
  auto ck = checkpoint_dict();
  ck.insert("format", std::string(kCheckpointFormat));
  ck.insert("format_version", kCheckpointFormatVersion);
  ck.insert("ember_version", std::string(kEmberVersion));
  ck.insert("torch_version", std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
                                 std::to_string(TORCH_VERSION_PATCH));
  ck.insert("sdk_abi", std::to_string(EMBER_SDK_ABI_MAJOR) + "." + std::to_string(EMBER_SDK_ABI_MINOR));
  ck.insert("epoch", epoch);
  ck.insert("global_step", global_step);
  ck.insert("weights_only", weights_only);
  ck.insert("config", config_toml);
  return ck;
}

// The CPU's state is one tensor under "cpu"; every other accelerator's a list, one per device
// (an empty list where it has none), so the table has the same keys on every machine.
c10::impl::GenericDict rng_state() {
  auto rng = checkpoint_dict();
  for (const auto* a : all_accelerators()) {
    const auto states = a->rng_states();
    if (a->device_type() == c10::kCPU) {
      rng.insert(a->name(), states.front());
      continue;
    }
    c10::List<at::Tensor> list;
    for (const auto& s : states) list.push_back(s);
    rng.insert(a->name(), list);
  }
  return rng;
}

void restore_rng_state(const c10::impl::GenericDict& rng) {
  for (const auto* a : all_accelerators()) {
    if (!rng.contains(a->name())) continue;  // saved by a build without this device kind
    const auto& saved = rng.at(a->name());
    if (a->device_type() == c10::kCPU) {
      a->set_rng_states({saved.toTensor()});
      continue;
    }
    auto list = saved.toTensorList();
    a->set_rng_states(std::vector<at::Tensor>(list.begin(), list.end()));
  }
}

at::Tensor bytes_tensor(const std::string& bytes) {
  auto t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

std::string tensor_bytes(const at::Tensor& t) {
  auto c = t.contiguous().to(at::kCPU);
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.numel()));
}

}  // namespace ember::engine
