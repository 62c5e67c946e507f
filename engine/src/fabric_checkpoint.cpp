// Fabric::save / Fabric::load: the program's state in the engine's checkpoint format
// (docs/checkpoint.md), so `engine --resume` reads the model and optimizer of a Fabric checkpoint,
// and Fabric::load reads the engine's. The program's own values go under the key `fabric`.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>
#include <torch/headeronly/version.h>
#include <torch/optim/optimizer.h>

#include <cstring>

#include "checkpoint_io.h"
#include "fabric_impl.h"
#include "version.h"

namespace ember {

namespace {

at::Tensor bytes_tensor(const std::string& s) {
  auto t = at::empty({static_cast<int64_t>(s.size())}, at::kByte);
  if (!s.empty()) std::memcpy(t.data_ptr(), s.data(), s.size());
  return t;
}

std::string tensor_bytes(const at::Tensor& t) {
  auto c = t.contiguous().to(at::kCPU);
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.numel()));
}

c10::impl::GenericDict string_dict() { return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()); }

}  // namespace

c10::Dict<std::string, at::Tensor> Fabric::full_model_state(bool rank0_only) {
  impl_->require_setup("full_model_state");
  return impl_->state->full_model_state(rank0_only);
}

void Fabric::save(const std::string& path, const FabricState& state) {
  auto& d = *impl_;
  d.ensure_launched();
  if ((state.model || state.optimizer) && !d.state)
    throw RunError("ember::Fabric::save: call setup(module, optimizer factory) first, or save with model = optimizer = false");
  auto& strategy = *d.strategy.object;
  // Collective: the strategy gathers the full state onto rank 0 (sharding strategies).
  c10::Dict<std::string, at::Tensor> model_state;
  std::string optimizer_state;
  if (state.model) model_state = d.state->full_model_state(/*rank0_only=*/true);
  if (state.optimizer) optimizer_state = d.state->full_optimizer_state(/*rank0_only=*/true);
  std::exception_ptr error;
  if (strategy.rank() == 0) {
    try {
      auto ck = string_dict();
      ck.insert("format", std::string(engine::kCheckpointFormat));
      ck.insert("format_version", engine::kCheckpointFormatVersion);
      ck.insert("ember_version", std::string(engine::kEmberVersion));
      ck.insert("torch_version", std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
                                     std::to_string(TORCH_VERSION_PATCH));
      ck.insert("sdk_abi", std::to_string(EMBER_SDK_ABI_MAJOR) + "." + std::to_string(EMBER_SDK_ABI_MINOR));
      ck.insert("epoch", state.epoch);
      ck.insert("global_step", state.global_step);
      ck.insert("weights_only", !state.optimizer);
      ck.insert("config", d.plan.config.to_toml());
      c10::Dict<std::string, std::string> versions;
      versions.insert(d.strategy.name, d.strategy.version);
      if (d.precision.object) versions.insert(d.precision.name, d.precision.version);
      ck.insert("plugin_versions", versions);
      // The engine's loop position: the end of epoch `epoch`, so a resume goes on with the next.
      auto loops = string_dict();
      loops.insert("epoch", state.epoch);
      loops.insert("batches_done", int64_t{0});
      loops.insert("epoch_finished", true);
      loops.insert("global_step", state.global_step);
      loops.insert("total_batch_idx", int64_t{0});
      loops.insert("validation_pending", false);
      ck.insert("loops", loops);
      auto rng = string_dict();
      rng.insert("cpu", at::detail::getDefaultCPUGenerator().get_state());
      c10::List<at::Tensor> cuda_states;
      if (torch::cuda::is_available())
        for (int64_t i = 0; i < static_cast<int64_t>(torch::cuda::device_count()); ++i)
          cuda_states.push_back(
              at::globalContext().defaultGenerator(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(i))).get_state());
      rng.insert("cuda", cuda_states);
      ck.insert("rng", rng);
      auto plugins = string_dict();
      if (auto s = strategy.state_dict(); !s.isNone()) plugins.insert("strategy", s);
      if (d.precision.object)
        if (auto s = d.precision.object->state_dict(); !s.isNone()) plugins.insert("precision", s);
      ck.insert("plugins", plugins);
      ck.insert("callbacks", string_dict());
      ck.insert("loggers", string_dict());
      if (state.model) ck.insert("state_dict", model_state);
      if (state.optimizer) ck.insert("optimizer", bytes_tensor(optimizer_state));
      auto values = string_dict();
      for (const auto& [k, v] : state.values) values.insert(k, v);
      ck.insert("fabric", values);
      engine::save_checkpoint_file(path, ck);
    } catch (...) {
      error = std::current_exception();
    }
  }
  // Rank 0's failure ends every rank now (as the engine's save does), instead of a hang later.
  if (strategy.world_size() > 1 &&
      strategy.reduce(at::scalar_tensor(error ? 1.0 : 0.0, at::kDouble), ReduceOp::max).item<double>() > 0 && !error)
    throw RunError("rank 0 could not write checkpoint " + path + " (its log says why); stopping with it");
  if (error) std::rethrow_exception(error);
}

FabricState Fabric::load(const std::string& path) {
  auto& d = *impl_;
  d.ensure_launched();
  const std::string where = "checkpoint " + path;
  c10::impl::GenericDict ck = engine::load_checkpoint_file(path);  // checks every record's CRC32C
  FabricState out;
  out.model = ck.contains("state_dict");
  out.optimizer = ck.contains("optimizer");
  if ((out.model || out.optimizer) && !d.state)
    throw RunError("ember::Fabric::load: " + where + " holds a model; call setup(module, optimizer factory) before load");
  if (out.model) {
    try {
      d.state->load_full_model_state(c10::impl::toTypedDict<std::string, at::Tensor>(ck.at("state_dict").toGenericDict()));
    } catch (const RunError& e) {
      throw RunError(where + ": " + e.what());
    }
  }
  if (out.optimizer) {
    try {
      d.state->load_full_optimizer_state(tensor_bytes(ck.at("optimizer").toTensor()));
    } catch (const c10::Error& e) {
      throw RunError(where + ": optimizer state does not fit this optimizer (" +
                     std::string(e.what_without_backtrace()).substr(0, 160) + "); build the same optimizer in setup()");
    }
  }
  if (ck.contains("plugins")) {
    auto plugins = ck.at("plugins").toGenericDict();
    if (plugins.contains("strategy")) d.strategy.object->load_state_dict(plugins.at("strategy"));
    if (plugins.contains("precision") && d.precision.object) d.precision.object->load_state_dict(plugins.at("precision"));
  }
  if (ck.contains("loops")) {
    auto loops = ck.at("loops").toGenericDict();
    out.global_step = loops.at("global_step").toInt();
    out.epoch = loops.at("epoch").toInt();
  }
  if (ck.contains("fabric"))
    for (const auto& e : ck.at("fabric").toGenericDict()) out.values.emplace(e.key().toStringRef(), e.value());
  return out;
}

}  // namespace ember
