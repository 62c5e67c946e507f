// Checkpoint assembly of the training loop: what a checkpoint holds besides the model's and the
// optimizer's state (the loops' position, RNG, plugin states; docs/checkpoint.md has the layout),
// saving it through the strategy's state contract, and restoring it.
#include "training_loop.h"

#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/headeronly/version.h>
#include <torch/serialize.h>

#include <cstring>

#include <ember/predict.h>

#include "checkpoint_io.h"
#include "engine_schema.h"
#include "log.h"
#include "sharded_checkpoint.h"
#include "version.h"

namespace ember::engine {

namespace {
at::Tensor bytes_tensor(const std::string& s) {
  auto t = at::empty({static_cast<int64_t>(s.size())}, at::kByte);
  std::memcpy(t.data_ptr(), s.data(), s.size());
  return t;
}

std::string tensor_bytes(const at::Tensor& t) {
  auto c = t.contiguous().to(at::kCPU);
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.numel()));
}
}  // namespace

c10::IValue TrainingLoop::plugin_states() const {
  c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());
  auto put = [&](const std::string& key, const IPluginObject& o) {
    auto s = o.state_dict();
    if (!s.isNone()) out.insert(key, s);
  };
  put("strategy", *plugins_.strategy.object);
  put("precision", *plugins_.precision.object);
  put("model", *plugins_.model.object);
  put("data", *plugins_.data.object);
  return out;
}

IShardedCheckpoint* TrainingLoop::sharded_checkpoint() const {
  if (contract1_) return nullptr;
  return static_cast<IShardedCheckpoint*>(plugins_.strategy.object->query_interface(kShardedCheckpointIid));
}

// Everything a checkpoint holds but the model's and the optimizer's state (docs/checkpoint.md).
c10::impl::GenericDict TrainingLoop::checkpoint_meta(bool weights_only) const {
  c10::impl::GenericDict ck(c10::StringType::get(), c10::AnyType::get());
  ck.insert("format", std::string(kCheckpointFormat));
  ck.insert("format_version", kCheckpointFormatVersion);
  ck.insert("ember_version", std::string(kEmberVersion));
  ck.insert("torch_version", std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
                                 std::to_string(TORCH_VERSION_PATCH));
  ck.insert("sdk_abi", std::to_string(EMBER_SDK_ABI_MAJOR) + "." + std::to_string(EMBER_SDK_ABI_MINOR));
  ck.insert("epoch", epoch_);
  ck.insert("global_step", global_step_);
  ck.insert("weights_only", weights_only);
  ck.insert("config", config_.to_toml());
  c10::Dict<std::string, std::string> versions;
  auto add_version = [&](const std::string& n, const std::string& v) { versions.insert(n, v); };
  add_version(plugins_.strategy.name, plugins_.strategy.version);
  add_version(plugins_.precision.name, plugins_.precision.version);
  add_version(plugins_.model.name, plugins_.model.version);
  add_version(plugins_.data.name, plugins_.data.version);
  for (const auto& c : plugins_.callbacks) add_version(c.name, c.version);
  for (const auto& l : plugins_.loggers) add_version(l.name, l.version);
  ck.insert("plugin_versions", versions);
  // The data's class names, for `engine export` (a Hugging Face config's id2label) and whoever
  // reads the checkpoint later without the data.
  if (const auto* names = static_cast<IPredictionNames*>(plugins_.data.object->query_interface(kPredictionNamesIid))) {
    c10::List<std::string> classes;
    for (const auto& n : names->class_names()) classes.push_back(n);
    if (!classes.empty()) ck.insert("class_names", classes);
  }
  if (weights_only) return ck;
  c10::impl::GenericDict loops(c10::StringType::get(), c10::AnyType::get());
  loops.insert("epoch", epoch_);
  loops.insert("batches_done", batches_done_);
  loops.insert("epoch_finished", epoch_finished_);
  loops.insert("global_step", global_step_);
  loops.insert("total_batch_idx", total_batch_idx_);
  loops.insert("validation_pending", validation_pending_);
  ck.insert("loops", loops);
  c10::impl::GenericDict rng(c10::StringType::get(), c10::AnyType::get());
  rng.insert("cpu", at::detail::getDefaultCPUGenerator().get_state());
  c10::List<at::Tensor> cuda_states;
  if (torch::cuda::is_available())
    for (int64_t i = 0; i < static_cast<int64_t>(torch::cuda::device_count()); ++i)
      cuda_states.push_back(at::globalContext().defaultGenerator(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(i))).get_state());
  rng.insert("cuda", cuda_states);
  ck.insert("rng", rng);
  ck.insert("plugins", plugin_states());
  c10::impl::GenericDict callbacks(c10::StringType::get(), c10::AnyType::get());
  for (const auto& c : plugins_.callbacks) {
    auto s = c.object->state_dict();
    if (!s.isNone()) callbacks.insert(c.name, s);
  }
  ck.insert("callbacks", callbacks);
  c10::impl::GenericDict loggers(c10::StringType::get(), c10::AnyType::get());
  for (const auto& l : plugins_.loggers) {
    auto s = l.object->state_dict();
    if (!s.isNone()) loggers.insert(l.name, s);
  }
  ck.insert("loggers", loggers);
  return ck;
}

void TrainingLoop::save_checkpoint(const std::string& path, bool weights_only) {
  call_hook(Hook::on_save_checkpoint);
  auto& strategy = *plugins_.strategy.object;
  if (auto* sharded = sharded_checkpoint(); sharded && sharded->sharded_checkpoints() && !weights_only) {
    // One part per rank, nothing gathered (sharded_checkpoint.h has the layout and the commit).
    const c10::IValue part = sharded->sharded_state();
    c10::IValue meta;
    if (is_global_zero()) {
      auto ck = checkpoint_meta(false);
      c10::impl::GenericDict layout(c10::StringType::get(), c10::AnyType::get());
      layout.insert("world_size", world_size());
      layout.insert("strategy", plugins_.strategy.name);
      ck.insert("sharded", layout);
      meta = ck;
    }
    ShardedWrite how;
    how.rank = rank();
    how.world = world_size();
    how.max_over_ranks = [&](double v) { return strategy.reduce(at::scalar_tensor(v, at::kDouble), ReduceOp::max).item<double>(); };
    write_sharded_checkpoint(path, part, meta, how);
    return;
  }
  // The model and optimizer state come from the strategy (gathered where it shards); every rank
  // takes part, only rank 0 builds and writes the checkpoint.
  auto model_state = state_->full_model_state(/*rank0_only=*/true);
  std::string optimizer_state = weights_only ? std::string() : state_->full_optimizer_state(/*rank0_only=*/true);
  std::exception_ptr error;
  if (is_global_zero()) {
    try {
      auto ck = checkpoint_meta(weights_only);
      ck.insert("state_dict", model_state);
      if (!weights_only) ck.insert("optimizer", bytes_tensor(optimizer_state));
      save_checkpoint_file(path, ck);
    } catch (...) {
      error = std::current_exception();
    }
  }
  // Rank 0's failure (read-only folder, full disk) ends every rank now, with that reason on rank 0,
  // instead of leaving the others to time out in the next collective.
  if (world_size() > 1 &&
      strategy.reduce(at::scalar_tensor(error ? 1.0 : 0.0, at::kDouble), ReduceOp::max).item<double>() > 0 && !error)
    throw RunError("rank 0 could not write checkpoint " + path + " (its log says why); stopping with it");
  if (error) std::rethrow_exception(error);
}

void TrainingLoop::write_consolidated(const std::string& path, c10::impl::GenericDict meta) {
  auto model_state = state_->full_model_state(/*rank0_only=*/true);
  const std::string optimizer_state = state_->full_optimizer_state(/*rank0_only=*/true);
  c10::impl::GenericDict ck(c10::StringType::get(), c10::AnyType::get());
  for (const auto& e : meta)
    if (e.key().toStringRef() != "sharded") ck.insert(e.key(), e.value());
  ck.insert("state_dict", model_state);
  ck.insert("optimizer", bytes_tensor(optimizer_state));
  save_checkpoint_file(path, ck);
}

void TrainingLoop::restore(const std::filesystem::path& file, bool weights_only) { restore(file, weights_only, true); }

void TrainingLoop::restore(const std::filesystem::path& file, bool weights_only, bool announce) {
  const std::string where = "checkpoint " + file.string();
  const bool sharded_dir = is_sharded_checkpoint(file);
  c10::impl::GenericDict ck(c10::StringType::get(), c10::AnyType::get());
  if (sharded_dir) {
    ck = read_sharded_meta(file);
    auto layout = ck.at("sharded").toGenericDict();
    const int64_t saved_world = layout.at("world_size").toInt();
    auto* sharded = sharded_checkpoint();
    if (sharded == nullptr)
      throw RunError(where + " is a sharded checkpoint directory (" + std::to_string(saved_world) + " parts, written by '" +
                     layout.at("strategy").toStringRef() + "'); resume it with that strategy, or make one file of it first: engine checkpoint consolidate " +
                     file.string() + " OUT.ckpt");
    try {
      sharded->load_sharded_state(saved_world, [&](int64_t k) { return read_sharded_part(file, k); });
    } catch (const RunError& e) {
      throw RunError(where + ": " + e.what());
    } catch (const c10::Error& e) {
      throw RunError(where + ": its state does not fit this run (" + std::string(e.what_without_backtrace()).substr(0, 160) +
                     "); resume with the same model and [optimizer] settings");
    }
  } else {
    ck = load_checkpoint_file(file);
    if (!ck.contains("state_dict")) throw RunError(where + " has no state_dict");
    try {
      state_->load_full_model_state(c10::impl::toTypedDict<std::string, at::Tensor>(ck.at("state_dict").toGenericDict()));
    } catch (const RunError& e) {
      throw RunError(where + ": " + e.what());
    }
  }
  if (weights_only) return;
  if (!ck.contains("loops") || (!sharded_dir && !ck.contains("optimizer")))
    throw RunError(where + " holds weights only (save_weights_only); it can be tested but not resumed");
  auto loops = ck.at("loops").toGenericDict();
  epoch_ = loops.at("epoch").toInt();
  batches_done_ = loops.at("batches_done").toInt();
  epoch_finished_ = loops.at("epoch_finished").toBool();
  global_step_ = loops.at("global_step").toInt();
  total_batch_idx_ = loops.at("total_batch_idx").toInt();
  resume_batch_ = epoch_finished_ ? 0 : batches_done_;
  // Checkpoints written before this key existed were saved after their validation.
  validation_pending_ = !epoch_finished_ && loops.contains("validation_pending") && loops.at("validation_pending").toBool();
  // The position a resumed run starts from: the last finished batch of the epoch.
  batch_idx_ = epoch_finished_ ? 0 : std::max<int64_t>(batches_done_ - 1, 0);
  try {
    if (!sharded_dir) state_->load_full_optimizer_state(tensor_bytes(ck.at("optimizer").toTensor()));
  } catch (const c10::Error& e) {
    throw RunError(where + ": optimizer state does not fit this optimizer (" + std::string(e.what_without_backtrace()).substr(0, 160) +
                   "); resume with the same [optimizer] settings");
  }
  auto rng = ck.at("rng").toGenericDict();
  at::Generator cpu_gen = at::detail::getDefaultCPUGenerator();  // a handle on the global generator
  cpu_gen.set_state(rng.at("cpu").toTensor());
  auto cuda = rng.at("cuda").toTensorList();
  if (torch::cuda::is_available())
    for (size_t i = 0; i < cuda.size() && i < torch::cuda::device_count(); ++i)
    {
      at::Generator gen = at::globalContext().defaultGenerator(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(i)));
      gen.set_state(cuda.get(i));
    }
  auto plugin_state = ck.at("plugins").toGenericDict();
  auto restore_one = [&](const std::string& key, IPluginObject& o) {
    if (plugin_state.contains(key)) o.load_state_dict(plugin_state.at(key));
  };
  restore_one("strategy", *plugins_.strategy.object);
  restore_one("precision", *plugins_.precision.object);
  restore_one("model", *plugins_.model.object);
  restore_one("data", *plugins_.data.object);
  auto callbacks = ck.at("callbacks").toGenericDict();
  for (auto& c : plugins_.callbacks)
    if (callbacks.contains(c.name)) c.object->load_state_dict(callbacks.at(c.name));
  auto loggers = ck.at("loggers").toGenericDict();
  for (auto& l : plugins_.loggers)
    if (loggers.contains(l.name)) l.object->load_state_dict(loggers.at(l.name));
  call_hook(Hook::on_load_checkpoint);
  if (announce)
    log::info("resumed from " + file.string() + " at epoch " + std::to_string(epoch_) + ", step " + std::to_string(global_step_) +
            (epoch_finished_ ? " (end of epoch)" : " (batch " + std::to_string(batches_done_) + " of the epoch)"));
}

}  // namespace ember::engine
