#include "app/commands.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <iostream>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <set>
#include <sstream>

#include "checkpoint/checkpoint_io.h"
#include "registry/composition.h"
#include "config/engine_schema.h"
#include "common/log.h"
#include "registry/plugin_registry.h"
#include "config/run_config.h"
#include "session/run_session.h"
#include "app/scratch_dir.h"
#include "checkpoint/sharded_checkpoint.h"
#include "loop/training_loop.h"
#include "common/version.h"

namespace fs = std::filesystem;

namespace ember::engine {
namespace {

void print_results(const std::vector<std::pair<std::string, double>>& results) {
  if (results.empty()) return;
  size_t w = 6;
  for (const auto& r : results) w = std::max(w, r.first.size());
  std::ostringstream out;
  out << std::left << std::setw(static_cast<int>(w)) << "metric" << "  value\n";
  for (const auto& r : results) out << std::left << std::setw(static_cast<int>(w)) << r.first << "  " << std::setprecision(6) << r.second << "\n";
  std::fputs(out.str().c_str(), stdout);
  std::fflush(stdout);
}

// --ckpt: best, last, or an existing checkpoint file or sharded folder (checked before any rank starts).
void require_checkpoint_argument(const std::string& checkpoint) {
  if (checkpoint.empty() || checkpoint == "best" || checkpoint == "last") return;
  std::error_code ec;
  if (!fs::is_regular_file(checkpoint, ec) && !is_sharded_checkpoint(checkpoint))
    throw UsageError("--ckpt " + checkpoint + ": no such checkpoint file (give a .ckpt path, or best / last)");
}

}  // namespace

int print_config(const RunRequest& req, std::ostream& out) {
  auto plan = make_plan(req);
  out << plan.config.to_toml();
  return 0;
}

int run_training(const RunRequest& req) {
  RunSession session(req);
  if (!session.is_rank()) return session.launcher_exit_code();
  const auto outcome = session.fit();
  if (outcome.already_finished) return 0;
  if (outcome.stop_signal) return 128 + outcome.stop_signal;
  const auto& trainer_cfg = session.config().section("trainer");
  if (trainer_cfg.get_bool("test_after_fit")) {
    const std::string test_ckpt = trainer_cfg.get_string("test_ckpt");
    auto results = session.test(test_ckpt == "current" ? "" : test_ckpt);
    if (session.loop().is_global_zero()) print_results(results);
  }
  session.finish("success");
  return 0;
}

int evaluate_checkpoint(const RunRequest& req, Split split, const std::string& checkpoint, bool predict) {
  require_checkpoint_argument(checkpoint);
  RunRequest with_ckpt = req;
  with_ckpt.weights_from_ckpt = !checkpoint.empty();
  RunSession session(with_ckpt);
  if (!session.is_rank()) return session.launcher_exit_code();
  if (predict) {
    session.predict(checkpoint);
  } else {
    auto results = split == Split::test ? session.test(checkpoint) : session.validate(checkpoint);
    if (session.loop().is_global_zero()) print_results(results);
  }
  session.finish("success");
  return 0;
}

int generate_text(const RunRequest& req, const std::string& checkpoint, const GenerationOptions& options) {
  require_checkpoint_argument(checkpoint);
  RunRequest with_ckpt = req;
  with_ckpt.weights_from_ckpt = !checkpoint.empty();
  RunSession session(with_ckpt);
  if (!session.is_rank()) return session.launcher_exit_code();
  session.generate(checkpoint, options, std::cout);
  session.finish("success");
  return 0;
}

int consolidate_checkpoint(const RunRequest& base, const std::string& dir, const std::string& out, bool weights_only) {
  if (!is_sharded_checkpoint(dir))
    throw UsageError(dir + " is not a sharded checkpoint directory (a folder with meta.ckpt and rank<k>.ckpt parts)");
  auto meta = read_sharded_meta(dir);
  const std::string strategy = meta.at("sharded").toGenericDict().at("strategy").toStringRef();
  // The run's own configuration, on one CPU process, with a scratch run folder.
  const ScratchDir scratch_dir("ember-consolidate");
  const fs::path& scratch = scratch_dir.path();
  std::ofstream(scratch / "run.toml") << meta.at("config").toStringRef();
  RunRequest req = base;
  req.config_path = (scratch / "run.toml").string();
  req.plugins = {strategy};
  req.resume = dir;
  req.consolidate_to = out;
  req.consolidate_weights_only = weights_only;
  // One rank holds the whole model, whatever mesh wrote the parts (they load onto any other).
  for (const char* s : {"trainer.devices=1", "trainer.num_nodes=1", "trainer.accelerator=\"cpu\"", "trainer.test_after_fit=false",
                        "trainer.enable_progress_bar=false", "parallelism.data_parallel_replicate=1", "parallelism.data_parallel_shard=-1",
                        "parallelism.tensor_parallel=1", "parallelism.pipeline_parallel=1", "parallelism.sequence_parallel=false",
                        "parallelism.schedule=\"1f1b\"", "parallelism.virtual_stages=1", "parallelism.stage_units=[]"})
    req.sets.emplace_back(s);
  req.sets.push_back("trainer.default_root_dir=\"" + (scratch / "runs").string() + "\"");
  req.sets.push_back(strategy + ".state_dict_type=\"full\"");
  RunSession session(req);
  int code = session.launcher_exit_code();
  if (session.is_rank()) {
    session.write_consolidated(out);
    session.finish("success");
  }
  if (code == 0) log::info("wrote " + out + (weights_only ? " (the model's weights alone)" : "") + " from the " +
                           std::to_string(meta.at("sharded").toGenericDict().at("world_size").toInt()) + " parts of " + dir);
  return code;
}

int list_plugins(const std::vector<std::string>& plugin_paths, std::ostream& out) {
  PluginRegistry reg(PluginRegistry::default_search_paths(plugin_paths));
  auto loaded = reg.load_all([](const std::string& w) { log::warn(w); });
  std::sort(loaded.begin(), loaded.end(), [](auto* a, auto* b) {
    return std::make_pair(a->descriptor->kind, a->name) < std::make_pair(b->descriptor->kind, b->name);
  });
  // Each column as wide as its longest entry, plus two spaces.
  size_t name_w = 4, kind_w = 4, version_w = 7;
  for (const auto* p : loaded) {
    name_w = std::max(name_w, p->name.size());
    kind_w = std::max(kind_w, std::string(kind_name(p->descriptor->kind)).size());
    version_w = std::max(version_w, std::string(p->descriptor->version ? p->descriptor->version : "").size());
  }
  auto col = [](size_t w) { return std::setw(static_cast<int>(w + 2)); };
  out << std::left << col(name_w) << "NAME" << col(kind_w) << "KIND" << col(version_w) << "VERSION" << "DESCRIPTION\n";
  for (const auto* p : loaded)
    out << std::left << col(name_w) << p->name << col(kind_w) << kind_name(p->descriptor->kind) << col(version_w)
        << (p->descriptor->version ? p->descriptor->version : "") << p->descriptor->description << "\n";
  for (const auto& [name, why] : not_built_plugins()) out << "(not in this build: " << name << ": " << why << ")\n";
  if (loaded.empty()) {
    out << "(no plugins found; searched:";
    for (const auto& d : reg.search_paths()) out << " " << d.string();
    out << ")\n";
  }
  return 0;
}

int plugin_info(const std::string& name, const std::vector<std::string>& plugin_paths, std::ostream& out) {
  PluginRegistry reg(PluginRegistry::default_search_paths(plugin_paths));
  const auto& p = reg.load(name);
  const auto* d = p.descriptor;
  const auto& f = d->fingerprint;
  out << "name:        " << d->name << "\n"
      << "kind:        " << kind_name(d->kind) << "\n"
      << "version:     " << d->version << "\n"
      << "license:     " << d->license << "\n"
      << "file:        " << p.file.string() << "\n"
      << "sdk abi:     " << d->sdk_abi_major << "." << d->sdk_abi_minor << "\n"
      << "built for:   libtorch " << f.torch_major << "." << f.torch_minor << "." << f.torch_patch << ", cxx11 abi "
      << f.cxx11_abi << ", " << device_runtime_string(f.device_runtime, f.device_runtime_version) << ", libstdc++ " << f.glibcxx_release << "\n"
      << "description: " << d->description << "\n";
  std::string section = d->kind == EMBER_KIND_MODEL ? "model" : d->kind == EMBER_KIND_DATA ? "data" : d->name;
  const auto keys = keys_from_descriptor(d->config_keys, d->num_config_keys);
  out << "config [" << section << "]:" << (keys.empty() ? " (no keys)" : "") << "\n";
  for (const auto& k : keys) {
    out << "  " << k.key << " (" << type_name(k.type) << ") = " << (k.default_toml ? *k.default_toml : "(unset)");
    if (!k.choices.empty()) out << "  [" << k.choices << "]";
    if (k.flags & (EMBER_KEY_HAS_MIN | EMBER_KEY_HAS_MAX)) {
      out << "  range " << ((k.flags & EMBER_KEY_HAS_MIN) ? ((k.flags & EMBER_KEY_MIN_EXCLUSIVE) ? "(" : "[") : "(");
      if (k.flags & EMBER_KEY_HAS_MIN) out << k.min_value; else out << "-inf";
      out << ", ";
      if (k.flags & EMBER_KEY_HAS_MAX) out << k.max_value << ((k.flags & EMBER_KEY_MAX_EXCLUSIVE) ? ")" : "]"); else out << "inf)";
    }
    out << "\n      " << k.help << "\n";
  }
  const auto elsewhere = elsewhere_from_descriptor(d->config_keys, d->num_config_keys);
  if (!elsewhere.empty()) {
    out << "not keys here (other tools' names; setting one is an error that says this):\n";
    for (const auto& [name, instead] : elsewhere) out << "  " << name << ": " << instead << "\n";
  }
  return 0;
}

}  // namespace ember::engine

