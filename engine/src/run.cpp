#include "run.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <torch/utils.h>

#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <set>
#include <sstream>

#include "checkpoint_io.h"
#include "config.h"
#include "engine_schema.h"
#include "log.h"
#include "numerics.h"
#include "plugin_registry.h"
#include "sharded_checkpoint.h"
#include "trainer.h"
#include "version.h"

namespace fs = std::filesystem;

namespace ember::engine {
namespace {

class EngineHost final : public IHost {
 public:
  void log(LogLevel level, std::string_view message) override {
    switch (level) {
      case LogLevel::debug: log::debug(message); break;
      case LogLevel::info: log::info(message); break;
      case LogLevel::warn: log::warn(message); break;
      case LogLevel::error: log::error(message); break;
    }
  }
  std::string engine_version() const override { return kEmberVersion; }
  int sdk_abi_minor() const override { return EMBER_SDK_ABI_MINOR; }
};

const std::set<std::string> kEngineSections = {"trainer", "model", "data", "optimizer", "plugins"};

// Everything decided before any plugin object exists: which plugins, and the validated config.
struct Plan {
  RawConfig raw;
  std::unique_ptr<PluginRegistry> registry;
  const PluginInfo* strategy = nullptr;
  const PluginInfo* precision = nullptr;
  const PluginInfo* model = nullptr;
  const PluginInfo* data = nullptr;
  std::vector<const PluginInfo*> callbacks, loggers;
  ResolvedConfig config;
  std::string auto_precision_note;  // what trainer.precision = "auto" chose and why ("" otherwise)
};

std::optional<bool> peek_bool(const RawConfig& raw, std::string_view section, std::string_view key) {
  for (auto it = raw.overrides.rbegin(); it != raw.overrides.rend(); ++it)
    if (it->section == section && it->key == key && it->value->is_boolean()) return it->value->as_boolean()->get();
  if (auto* tbl = raw.file.get_as<toml::table>(section))
    if (auto* v = tbl->get_as<bool>(key)) return v->get();
  return std::nullopt;
}

std::string set_where(const RawConfig& raw, std::string_view section, std::string_view key) {
  for (auto it = raw.overrides.rbegin(); it != raw.overrides.rend(); ++it)
    if (it->section == section && it->key == key) return "--set " + it->text;
  if (auto* tbl = raw.file.get_as<toml::table>(section))
    if (auto* n = tbl->get(key)) {
      const auto& b = n->source().begin;
      return raw.path + ":" + std::to_string(b.line) + ":" + std::to_string(b.column);
    }
  return "";
}

Plan make_plan(const RunRequest& req) {
  Plan plan;
  plan.raw = req.config_path.empty() ? RawConfig{} : RawConfig::load(req.config_path);
  for (const auto& s : req.sets) plan.raw.add_override(s);
  plan.raw.integer_as_string("trainer", "precision");  // Lightning's precision = 16 / 32 / 64
  plan.registry = std::make_unique<PluginRegistry>(PluginRegistry::default_search_paths(req.plugin_paths));
  auto& reg = *plan.registry;

  std::vector<std::string> requested;
  auto add = [&](const std::string& n) {
    if (!n.empty() && std::find(requested.begin(), requested.end(), n) == requested.end()) requested.push_back(n);
  };
  for (const auto& p : req.plugins) add(p);
  for (const auto& p : plan.raw.plugin_list()) add(p);

  std::vector<const PluginInfo*> strategies, precisions, models, datas;
  for (const auto& name : requested) {
    if (kEngineSections.count(name))
      throw UsageError("'" + name + "' is an engine section, not a plugin name");
    const auto& info = reg.load(name);
    switch (info.descriptor->kind) {
      case EMBER_KIND_STRATEGY: strategies.push_back(&info); break;
      case EMBER_KIND_PRECISION: precisions.push_back(&info); break;
      case EMBER_KIND_MODEL: models.push_back(&info); break;
      case EMBER_KIND_DATA: datas.push_back(&info); break;
      case EMBER_KIND_CALLBACK: plan.callbacks.push_back(&info); break;
      case EMBER_KIND_LOGGER: plan.loggers.push_back(&info); break;
      default: break;
    }
  }

  // Exclusive kinds: one plugin, from --plugins/plugins or from its trainer/model/data key.
  auto choose = [&](uint32_t kind_id, std::vector<const PluginInfo*>& named, const char* section, const char* key,
                    std::optional<std::string> configured, const std::string& fallback) -> const PluginInfo* {
    const std::string kind = kind_name(kind_id);
    if (named.size() > 1)
      throw UsageError("two " + kind + " plugins given: '" + named[0]->name + "' and '" + named[1]->name +
                       "'; a run has exactly one " + kind);
    std::string where = set_where(plan.raw, section, key);
    if (!named.empty()) {
      if (configured && *configured != named[0]->name)
        throw UsageError(where + ": " + section + "." + key + " = \"" + *configured + "\" conflicts with the " + kind +
                         " plugin '" + named[0]->name + "' named in plugins; a run has exactly one " + kind +
                         " (drop one of them)");
      return named[0];
    }
    std::string name = configured ? *configured : fallback;
    if (name.empty())
      throw UsageError(std::string(plan.raw.path.empty() ? "config" : plan.raw.path) + ": [" + section + "] " + key +
                       " is required: name the " + kind + " plugin to use (`engine plugins list` shows them)");
    const PluginInfo* info = nullptr;
    try {
      info = &reg.load(name);
    } catch (const UsageError& e) {
      std::string hint;
      if (kind_id == EMBER_KIND_PRECISION)
        hint = "; trainer.precision takes 64-true, 32-true, 16-mixed, bf16-mixed, 16-true, bf16-true, the aliases 64, 32, "
               "16, bf16, auto, or a precision plugin's name";
      throw UsageError((where.empty() ? std::string("default ") + section + "." + key : where) + ": " + e.what() + hint);
    }
    if (info->descriptor->kind != kind_id)
      throw UsageError(where + ": " + section + "." + key + ": '" + name + "' is a " + kind_name(info->descriptor->kind) +
                       " plugin, not a " + kind + " plugin");
    return info;
  };
  auto strategy_cfg = plan.raw.peek_string("trainer", "strategy");
  auto precision_cfg = plan.raw.peek_string("trainer", "precision");
  if (precision_cfg && *precision_cfg == "auto") {
    const auto choice = choose_auto_precision(
        detect_device_for_precision(plan.raw.peek_string("trainer", "accelerator").value_or("auto")));
    plan.auto_precision_note = "precision auto: " + choice.precision + " (" + choice.reason + ")";
    precision_cfg = choice.precision;
  }
  if (precision_cfg) precision_cfg = precision_plugin_for(*precision_cfg);
  plan.strategy = choose(EMBER_KIND_STRATEGY, strategies, "trainer", "strategy", strategy_cfg, "single_device");
  plan.precision = choose(EMBER_KIND_PRECISION, precisions, "trainer", "precision", precision_cfg, "fp32");
  plan.model = choose(EMBER_KIND_MODEL, models, "model", "name", plan.raw.peek_string("model", "name"), "");
  plan.data = choose(EMBER_KIND_DATA, datas, "data", "name", plan.raw.peek_string("data", "name"), "");

  // Defaults, as Lightning's logger=True / enable_checkpointing=True.
  if (plan.loggers.empty() && peek_bool(plan.raw, "trainer", "logger").value_or(true)) plan.loggers.push_back(&reg.load("csv"));
  bool has_checkpoint = std::any_of(plan.callbacks.begin(), plan.callbacks.end(), [](auto* p) { return p->name == "checkpoint"; });
  if (!has_checkpoint && peek_bool(plan.raw, "trainer", "enable_checkpointing").value_or(true))
    plan.callbacks.push_back(&reg.load("checkpoint"));
  // enable_model_summary adds the model_summary callback (Lightning's default ModelSummary); a
  // model_summary named explicitly is used as configured.
  bool has_summary = std::any_of(plan.callbacks.begin(), plan.callbacks.end(), [](auto* p) { return p->name == "model_summary"; });
  if (!has_summary && peek_bool(plan.raw, "trainer", "enable_model_summary").value_or(true))
    plan.callbacks.push_back(&reg.load("model_summary"));

  // trainer.max_time adds the timer callback (Lightning adds its Timer). A timer named as well
  // must have the same duration (the resolved config names both), never a silently ignored one.
  const auto max_time = plan.raw.peek_string("trainer", "max_time");
  if (max_time) {
    bool has_timer = std::any_of(plan.callbacks.begin(), plan.callbacks.end(), [](auto* p) { return p->name == "timer"; });
    const auto duration = plan.raw.peek_string("timer", "duration");
    if (has_timer && duration && *duration != *max_time)
      throw UsageError(set_where(plan.raw, "trainer", "max_time") + ": trainer.max_time = \"" + *max_time +
                       "\" and timer.duration = \"" + *duration + "\" (" + set_where(plan.raw, "timer", "duration") +
                       ") both set the time limit; keep one of them");
    if (!has_timer) plan.callbacks.push_back(&reg.load("timer"));
  }

  // Schemas, in the order `engine config` prints them.
  std::vector<SectionSchema> schemas;
  schemas.push_back(trainer_schema());
  auto with_base = [&](const char* name, std::vector<KeySchema> base, const PluginInfo& p) {
    SectionSchema s;
    s.name = name;
    s.description = std::string(name) + " plugin '" + p.name + "'";
    s.keys = std::move(base);
    for (auto& k : keys_from_descriptor(p.descriptor->config_keys, p.descriptor->num_config_keys)) {
      if (s.find(k.key))
        throw PluginError("plugin '" + p.name + "' (" + p.file.string() + ") declares the key '" + k.key +
                          "', which the engine already defines in [" + name + "] (rename it in the plugin)");
      s.keys.push_back(std::move(k));
    }
    return s;
  };
  schemas.push_back(with_base("model", model_base_keys(), *plan.model));
  schemas.push_back(with_base("data", data_base_keys(), *plan.data));
  schemas.push_back(optimizer_schema());
  std::vector<const PluginInfo*> own_sections = {plan.strategy, plan.precision};
  own_sections.insert(own_sections.end(), plan.callbacks.begin(), plan.callbacks.end());
  own_sections.insert(own_sections.end(), plan.loggers.begin(), plan.loggers.end());
  std::vector<std::string> printed_plugins;
  for (const auto* p : own_sections) {
    SectionSchema s;
    s.name = p->name;
    s.description = std::string(kind_name(p->descriptor->kind)) + " plugin " + p->name + " " + p->descriptor->version;
    s.keys = keys_from_descriptor(p->descriptor->config_keys, p->descriptor->num_config_keys);
    schemas.push_back(std::move(s));
    if (p->descriptor->kind == EMBER_KIND_CALLBACK || p->descriptor->kind == EMBER_KIND_LOGGER) printed_plugins.push_back(p->name);
  }
  plan.config = ResolvedConfig::resolve(plan.raw, std::move(schemas), printed_plugins);
  // The resolved config names the strategy and precision actually chosen, so that feeding it
  // back (without --plugins) runs the same plugins.
  const auto& t = plan.config.section("trainer");
  if (t.get_string("strategy") != plan.strategy->name) plan.config.set("trainer", "strategy", plan.strategy->name, "--plugins");
  if (precision_plugin_for(t.get_string("precision")) != plan.precision->name)
    plan.config.set("trainer", "precision", plan.precision->name, plan.auto_precision_note.empty() ? "--plugins" : "auto");
  if (max_time) plan.config.set("timer", "duration", *max_time, set_where(plan.raw, "trainer", "max_time"));
  return plan;
}

fs::path next_version_dir(const fs::path& base, std::optional<int64_t> version) {
  if (version) return base / ("version_" + std::to_string(*version));
  int64_t next = 0;
  std::error_code ec;
  if (fs::is_directory(base, ec))
    for (const auto& e : fs::directory_iterator(base, ec)) {
      auto n = e.path().filename().string();
      if (n.starts_with("version_")) {
        try {
          next = std::max<int64_t>(next, std::stoll(n.substr(8)) + 1);
        } catch (...) {
        }
      }
    }
  return base / ("version_" + std::to_string(next));
}

std::vector<fs::path> versions_newest_first(const fs::path& base) {
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code ec;
  if (fs::is_directory(base, ec))
    for (const auto& e : fs::directory_iterator(base, ec)) {
      auto n = e.path().filename().string();
      if (!n.starts_with("version_")) continue;
      try {
        found.emplace_back(std::stoll(n.substr(8)), e.path());
      } catch (...) {
      }
    }
  std::sort(found.begin(), found.end(), [](auto& a, auto& b) { return a.first > b.first; });
  std::vector<fs::path> out;
  for (auto& f : found) out.push_back(f.second);
  return out;
}

// trainer.stop_signals as signal numbers.
std::vector<int> parse_stop_signals(const Section& trainer) {
  static const std::vector<std::pair<std::string, int>> known = {
      {"SIGINT", SIGINT}, {"SIGTERM", SIGTERM}, {"SIGUSR1", SIGUSR1}, {"SIGUSR2", SIGUSR2},
      {"SIGHUP", SIGHUP}, {"SIGQUIT", SIGQUIT}, {"SIGXCPU", SIGXCPU}};
  std::vector<int> out;
  for (const auto& name : trainer.get_string_list("stop_signals")) {
    const std::string full = name.rfind("SIG", 0) == 0 ? name : "SIG" + name;
    auto it = std::find_if(known.begin(), known.end(), [&](const auto& k) { return k.first == full; });
    if (it == known.end())
      throw UsageError(trainer.where("stop_signals") + ": trainer.stop_signals: unknown signal '" + name +
                       "' (use SIGINT, SIGTERM, SIGUSR1, SIGUSR2, SIGHUP, SIGQUIT or SIGXCPU)");
    out.push_back(it->second);
  }
  return out;
}

// The file `--resume last` may use: `found` (what the checkpoint callback located) when it is a
// full Ember checkpoint, else the newest such file next to it; empty when there is none.
// Weights-only files, other programs' files and unreadable ones are skipped with a warning.
fs::path resumable_last(const fs::path& found) {
  auto usable = [](const fs::path& p) {
    // A sharded checkpoint directory is judged by its meta.ckpt (the run's state and flags).
    const auto probe = probe_checkpoint_file(is_sharded_checkpoint(p) ? p / "meta.ckpt" : p);
    if (probe.ember && !probe.weights_only) return true;
    log::warn("--resume last: skipping " + p.string() + ": " +
              (probe.ember ? std::string("it holds weights only (save_weights_only)") : "not an Ember checkpoint (" + probe.why + ")"));
    return false;
  };
  if (usable(found)) return found;
  std::vector<std::pair<fs::file_time_type, fs::path>> others;
  std::error_code ec;
  for (fs::directory_iterator it(found.parent_path(), ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code e2;
    if (it->path() == found || it->path().extension() != ".ckpt" || !(it->is_regular_file(e2) || is_sharded_checkpoint(it->path())))
      continue;
    others.emplace_back(it->last_write_time(e2), it->path());
  }
  std::sort(others.begin(), others.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& o : others)
    if (usable(o.second)) return o.second;
  return {};
}

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

}  // namespace

int print_config(const RunRequest& req, std::ostream& out) {
  auto plan = make_plan(req);
  out << plan.config.to_toml();
  return 0;
}

int run_training(const RunRequest& req) {
  auto plan = make_plan(req);
  const bool consolidating = !req.consolidate_to.empty();
  if (consolidating) {  // only the model's and optimizer's state are converted: no callbacks, no loggers
    plan.callbacks.clear();
    plan.loggers.clear();
  }
  if (!req.resume.empty() && req.resume != "last" && req.resume != "best") {
    std::error_code ec;
    if (!fs::is_regular_file(req.resume, ec) && !is_sharded_checkpoint(req.resume))
      throw UsageError("--resume " + req.resume + ": no such checkpoint file (give a .ckpt path, or last / best)");
  }
  const auto& cfg = plan.config;
  const auto& trainer_cfg = cfg.section("trainer");
  const std::vector<int> stop_signals = parse_stop_signals(trainer_cfg);
  EngineHost host;

  RunPlugins plugins;
  auto make = [&](auto& slot, const PluginInfo* info, const IConfig& section) {
    using T = typename std::decay_t<decltype(slot.object)>::element_type;
    slot.name = info->name;
    slot.version = info->descriptor->version ? info->descriptor->version : "";
    slot.object = create_plugin_object<T>(*info, host, section);
  };
  make(plugins.strategy, plan.strategy, cfg.section(plan.strategy->name));
  LaunchRequest launch;
  launch.argv = req.argv;
  launch.devices = trainer_cfg.get_int("devices");
  launch.num_nodes = trainer_cfg.get_int("num_nodes");
  launch.accelerator = trainer_cfg.get_string("accelerator");
  int exit_code = 0;
  if (!plugins.strategy.object->launch(launch, &exit_code)) return exit_code;
  const int64_t rank = plugins.strategy.object->rank();
  log::init(static_cast<int>(rank), log::Level::info);

  // Global numerics before any plugin builds tensors.
  const auto seed = static_cast<uint64_t>(trainer_cfg.get_int("seed"));
  torch::manual_seed(seed);
  if (torch::cuda::is_available()) torch::cuda::manual_seed_all(seed);
  {
    const bool on_cpu = plugins.strategy.object->root_device().is_cpu();
    const int64_t local = plugins.strategy.object->world_size() > 1 ? launch.devices : 1;
    const std::string numerics = apply_numerics(numerics_settings(trainer_cfg, on_cpu, local));
    if (rank == 0) {
      log::info(numerics);
      if (!plan.auto_precision_note.empty()) log::info(plan.auto_precision_note);
    }
  }
  if (trainer_cfg.get_bool("deterministic")) at::globalContext().setDeterministicAlgorithms(true, false);

  make(plugins.data, plan.data, cfg.section("data"));
  plugins.data.object->setup(DataSetup{seed, rank, plugins.strategy.object->world_size()});
  make(plugins.model, plan.model, cfg.section("model"));
  make(plugins.precision, plan.precision, cfg.section(plan.precision->name));
  for (const auto* c : plan.callbacks) {
    Named<ICallback> n;
    make(n, c, cfg.section(c->name));
    plugins.callbacks.push_back(std::move(n));
  }
  if (rank == 0)
    for (const auto* l : plan.loggers) {
      Named<ILogger> n;
      make(n, l, cfg.section(l->name));
      plugins.loggers.push_back(std::move(n));
    }

  // Run folder: <root>/<name>/version_<n>. `--resume last|best` continues the newest run that
  // has such a checkpoint, in its own folder.
  std::string name = trainer_cfg.has("name") ? trainer_cfg.get_string("name")
                     : req.config_path.empty() ? "default" : fs::path(req.config_path).stem().string();
  fs::path base = fs::path(trainer_cfg.get_string("default_root_dir")) / name;
  std::optional<int64_t> version;
  if (trainer_cfg.has("version")) version = trainer_cfg.get_int("version");
  fs::path run_dir;
  fs::path checkpoint;
  bool resume_in_place = false;
  const bool wants_locator = !req.resume.empty() && (req.resume == "last" || req.resume == "best");
  auto has_locator = [&] {
    return std::any_of(plugins.callbacks.begin(), plugins.callbacks.end(),
                       [](auto& c) { return c.object->query_interface(kCheckpointLocatorIid) != nullptr; });
  };
  const std::string test_ckpt = trainer_cfg.get_string("test_ckpt");
  if ((wants_locator || (trainer_cfg.get_bool("test_after_fit") && test_ckpt != "current")) && !has_locator())
    throw UsageError(wants_locator ? "--resume " + req.resume + " needs a checkpoint callback (enable trainer.enable_checkpointing or add one), or give a checkpoint file"
                                   : trainer_cfg.where("test_ckpt") + ": trainer.test_ckpt = \"" + test_ckpt +
                                         "\" needs a checkpoint callback (enable checkpointing, or set test_ckpt = \"current\")");

  bool start_fresh = false;
  if (wants_locator) {
    auto candidates = version ? std::vector<fs::path>{base / ("version_" + std::to_string(*version))} : versions_newest_first(base);
    for (const auto& dir : candidates) {
      auto found = locate_checkpoint(plugins.callbacks, req.resume, dir.string());
      // `last` is what a requeued job resumes from: only a full Ember checkpoint will do.
      if (!found.empty() && req.resume == "last") found = resumable_last(found).string();
      if (!found.empty()) {
        run_dir = dir;
        checkpoint = found;
        break;
      }
    }
    if (checkpoint.empty() && req.resume == "last") {
      // Lightning's ckpt_path="last": a job that is (re)started with --resume last before it
      // ever saved starts from scratch.
      log::warn("--resume last: no checkpoint to resume from under " + base.string() + "; starting from scratch");
      start_fresh = true;
    } else if (checkpoint.empty()) {
      throw UsageError("--resume " + req.resume + ": no '" + req.resume + "' checkpoint found under " + base.string() +
                       " (train first, or give the checkpoint's path)");
    } else {
      resume_in_place = true;
    }
  }
  if (!wants_locator || start_fresh) {
    if (!req.resume.empty() && !start_fresh) checkpoint = req.resume;
    run_dir = next_version_dir(base, version);
    // Every rank uses rank 0's folder: another rank could already see the folder rank 0 makes
    // below and count one more.
    if (!version && plugins.strategy.object->world_size() > 1) {
      const double mine = rank == 0 ? static_cast<double>(std::stoll(run_dir.filename().string().substr(8))) : 0.0;
      const auto zeros = plugins.strategy.object->reduce(at::scalar_tensor(mine, at::kDouble), ReduceOp::sum).item<double>();
      run_dir = base / ("version_" + std::to_string(static_cast<int64_t>(zeros)));
    }
  }
  if (rank == 0) fs::create_directories(run_dir);
  auto trainer = std::make_unique<Trainer>(host, cfg, std::move(plugins), run_dir);
  try {
    trainer->setup();
    if (!checkpoint.empty()) trainer->restore(checkpoint, /*weights_only=*/false);
    if (consolidating) {
      trainer->write_consolidated(req.consolidate_to, read_sharded_meta(checkpoint));
      trainer->finalize("success");
      return 0;
    }
    // A run resumed in its own folder that already reached max_epochs/max_steps: nothing to
    // train or test again, and nothing is added to its logs (a requeued job that already ended).
    if (resume_in_place && trainer->fit_done()) {
      log::info("the run in " + run_dir.string() + " already finished (epoch " + std::to_string(trainer->current_epoch()) +
                ", step " + std::to_string(trainer->global_step()) +
                "): nothing to do; raise trainer.max_epochs or trainer.max_steps to train on");
      return 0;
    }
    if (rank == 0) {
      std::ofstream(run_dir / "config.toml") << cfg.to_toml();
      log::info("run folder " + run_dir.string());
    }
    // Loggers of a run resumed in its own folder continue its files; fresh folders (including a
    // resume from an explicit path) start new ones.
    trainer->setup_loggers(resume_in_place);
    install_stop_signal_handlers(stop_signals);
    trainer->fit();
    if (const int sig = stop_signal()) {
      trainer->finalize("interrupted");
      log::warn("interrupted; continue with --resume last");
      return 128 + sig;
    }
    if (trainer_cfg.get_bool("test_after_fit")) {
      if (test_ckpt != "current") {
        auto path = trainer->locate_checkpoint(test_ckpt);
        if (path.empty()) throw RunError("test_after_fit: no '" + test_ckpt + "' checkpoint was saved in " + run_dir.string());
        log::info("testing " + test_ckpt + " checkpoint " + path);
        trainer->restore(path, /*weights_only=*/true);
      }
      auto results = trainer->test();
      if (rank == 0) print_results(results);
    }
    trainer->finalize("success");
  } catch (...) {
    trainer->notify_exception();
    trainer->finalize("failed");
    throw;
  }
  return 0;
}

int consolidate_checkpoint(const RunRequest& base, const std::string& dir, const std::string& out) {
  if (!is_sharded_checkpoint(dir))
    throw UsageError(dir + " is not a sharded checkpoint directory (a folder with meta.ckpt and rank<k>.ckpt parts)");
  auto meta = read_sharded_meta(dir);
  const std::string strategy = meta.at("sharded").toGenericDict().at("strategy").toStringRef();
  // The run's own configuration, on one CPU process, with a scratch run folder.
  const fs::path scratch = fs::temp_directory_path() / ("ember-consolidate-" + std::to_string(::getpid()));
  fs::create_directories(scratch);
  struct Cleanup {
    fs::path p;
    ~Cleanup() { remove_tree(p); }
  } cleanup{scratch};
  std::ofstream(scratch / "run.toml") << meta.at("config").toStringRef();
  RunRequest req = base;
  req.config_path = (scratch / "run.toml").string();
  req.plugins = {strategy};
  req.resume = dir;
  req.consolidate_to = out;
  for (const char* s : {"trainer.devices=1", "trainer.num_nodes=1", "trainer.accelerator=\"cpu\"", "trainer.test_after_fit=false",
                        "trainer.enable_progress_bar=false"})
    req.sets.emplace_back(s);
  req.sets.push_back("trainer.default_root_dir=\"" + (scratch / "runs").string() + "\"");
  req.sets.push_back(strategy + ".state_dict_type=\"full\"");
  const int code = run_training(req);
  if (code == 0) log::info("wrote " + out + " from the " + std::to_string(meta.at("sharded").toGenericDict().at("world_size").toInt()) +
                           " parts of " + dir);
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
      << f.cxx11_abi << ", cuda " << f.cuda_version << ", libstdc++ " << f.glibcxx_release << "\n"
      << "description: " << d->description << "\n";
  std::string section = d->kind == EMBER_KIND_MODEL ? "model" : d->kind == EMBER_KIND_DATA ? "data" : d->name;
  out << "config [" << section << "]:" << (d->num_config_keys == 0 ? " (no keys)" : "") << "\n";
  for (const auto& k : keys_from_descriptor(d->config_keys, d->num_config_keys)) {
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
  return 0;
}

}  // namespace ember::engine
