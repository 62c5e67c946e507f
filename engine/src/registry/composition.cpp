#include "registry/composition.h"
#include "registry/defaults.h"

#include <ember/deferred_init.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <set>

#include "config/engine_schema.h"
#include "config/run_request.h"
#include "common/log.h"
#include "runtime/numerics.h"
#include "common/version.h"
#include "loop/configured_metrics.h"

namespace ember::engine {

void EngineHost::log(LogLevel level, std::string_view message) {
  switch (level) {
    case LogLevel::debug: log::debug(message); break;
    case LogLevel::info: log::info(message); break;
    case LogLevel::warn: log::warn(message); break;
    case LogLevel::error: log::error(message); break;
  }
}
std::string EngineHost::engine_version() const { return kEmberVersion; }
int EngineHost::sdk_abi_minor() const { return EMBER_SDK_ABI_MINOR; }
void* EngineHost::query_interface(const char* iid) {
  if (deferred_init_ != nullptr && std::strcmp(iid, kDeferredInitIid) == 0) return deferred_init_;
  return nullptr;
}

namespace {

const std::set<std::string> kEngineSections = {"trainer", "model", "data", "optimizer", "parallelism", "metrics", "plugins"};

// A raw bool or integer value (override first, then file) before validation, to pick plugins;
// nullopt when unset or of another type (the validation then says what is wrong).
template <class T>
std::optional<T> peek(const RawConfig& raw, std::string_view section, std::string_view key) {
  for (auto it = raw.overrides.rbegin(); it != raw.overrides.rend(); ++it)
    if (it->section == section && it->key == key)
      if (auto* v = it->value->template as<T>()) return v->get();
  if (auto* tbl = raw.file.get_as<toml::table>(section))
    if (auto* v = tbl->get_as<T>(key)) return v->get();
  return std::nullopt;
}

// Lightning's strategy names that Ember spells otherwise: the one-line fix to add to "unknown plugin".
std::string lightning_strategy_hint(const std::string& name) {
  if (name == "fsdp" || name.starts_with("fsdp_"))
    return "; Lightning's fsdp is Ember's sharded strategy: trainer.strategy = \"sharded\" (sharded.stage = 3, the default, "
           "shards parameters, gradients and optimizer state as FSDP's FULL_SHARD does)";
  if (name.starts_with("deepspeed")) {
    if (name.ends_with("_offload") || name.ends_with("_offload_nvme"))
      return "; Lightning's " + name + " is Ember's offload strategy: trainer.strategy = \"offload\" (docs/strategy.md)";
    const char stage = name.size() > 16 && name.starts_with("deepspeed_stage_") ? name[16] : '3';
    return "; Lightning's " + name + " is Ember's sharded strategy (ZeRO): trainer.strategy = \"sharded\" with sharded.stage = " +
           std::string(1, stage);
  }
  if (name.starts_with("ddp_"))
    return "; Ember's ddp starts its own processes and takes its options in [ddp] (find_unused_parameters, ...): "
           "trainer.strategy = \"ddp\"";
  return "";
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

}  // namespace

Plan make_plan(const RunRequest& req) {
  Plan plan;
  plan.raw = !req.config_text.empty() ? RawConfig::parse(req.config_text, req.config_path.empty() ? "config" : req.config_path)
             : req.config_path.empty()   ? RawConfig{}
                                         : RawConfig::load(req.config_path);
  for (const auto& s : req.sets) plan.raw.add_override(s);
  plan.raw.integer_as_string("trainer", "precision");  // Lightning's precision = 16 / 32 / 64
  plan.raw.bool_as_integer("trainer", "fast_dev_run");  // Lightning's fast_dev_run = true (1 batch)
  // Lightning's devices = "auto" / -1: every visible device of the accelerator (1 on a CPU).
  plan.raw.rewrite_as_integer("trainer", "devices", [&](const toml::node& n) -> std::optional<int64_t> {
    if (!(n.is_string() && n.as_string()->get() == "auto") && !(n.is_integer() && n.as_integer()->get() == -1)) return std::nullopt;
    return visible_devices(plan.raw.peek_string("trainer", "accelerator").value_or("auto"));
  });
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
      // A precision is suggested among the precision names, not among every plugin ("did you
      // mean 'transformer'?" for "transformer-engine").
      static const std::vector<std::string> precision_names = {"64-true", "32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true",
                                                               "64", "32", "16", "bf16", "auto"};
      info = &reg.load(name, kind_id == EMBER_KIND_PRECISION ? precision_names : std::vector<std::string>{});
    } catch (const UsageError& e) {
      std::string hint;
      if (kind_id == EMBER_KIND_PRECISION)
        hint = "; trainer.precision takes 64-true, 32-true, 16-mixed, bf16-mixed, 16-true, bf16-true, the aliases 64, 32, "
               "16, bf16, auto, or a precision plugin's name";
      if (kind_id == EMBER_KIND_STRATEGY) hint = lightning_strategy_hint(name);
      throw UsageError((where.empty() ? std::string("default ") + section + "." + key : where) + ": " + e.what() + hint);
    }
    if (info->descriptor->kind != kind_id)
      throw UsageError(where + ": " + section + "." + key + ": '" + name + "' is a " + kind_name(info->descriptor->kind) +
                       " plugin, not a " + kind + " plugin");
    return info;
  };
  auto strategy_cfg = plan.raw.peek_string("trainer", "strategy");
  if (strategy_cfg && *strategy_cfg == "auto" && !strategies.empty()) strategy_cfg.reset();  // the plugin named in plugins
  if ((!strategy_cfg || *strategy_cfg == "auto") && strategies.empty()) {
    // Lightning's strategy "auto" (the default): one process on one device, ddp for more ranks or
    // an elastic job (num_nodes = 0, whose size the launcher decides).
    const int64_t devices = peek<int64_t>(plan.raw, "trainer", "devices").value_or(1), nodes = peek<int64_t>(plan.raw, "trainer", "num_nodes").value_or(1);
    strategy_cfg = defaults::auto_strategy(nodes == 0 ? 2 : devices * nodes);
  }
  auto precision_cfg = plan.raw.peek_string("trainer", "precision");
  if (precision_cfg && *precision_cfg == "auto") {
    const auto choice = choose_auto_precision(
        detect_device_for_precision(plan.raw.peek_string("trainer", "accelerator").value_or("auto")));
    plan.auto_precision_note = "precision auto: " + choice.precision + " (" + choice.reason + ")";
    precision_cfg = choice.precision;
  }
  if (precision_cfg) precision_cfg = precision_plugin_for(*precision_cfg);
  plan.strategy = choose(EMBER_KIND_STRATEGY, strategies, "trainer", "strategy", strategy_cfg, defaults::kStrategy);
  plan.precision = choose(EMBER_KIND_PRECISION, precisions, "trainer", "precision", precision_cfg, defaults::kPrecision);
  // A model or data object the program made replaces the plugin [model]/[data] name would choose.
  auto provided = [&](const char* section, const std::vector<const PluginInfo*>& named) {
    const std::string kind = section;
    if (!named.empty())
      throw UsageError("the " + kind + " plugin '" + named[0]->name + "' is named in plugins, but the program provides its own " +
                       kind + " object; drop one of them");
    if (auto n = plan.raw.peek_string(section, "name"))
      throw UsageError(set_where(plan.raw, section, "name") + ": " + kind + ".name = \"" + *n + "\", but the program provides its own " +
                       kind + " object; drop [" + kind + "] name");
  };
  if (req.provided.model || req.program_loop) provided("model", models);
  else plan.model = choose(EMBER_KIND_MODEL, models, "model", "name", plan.raw.peek_string("model", "name"), "");
  if (req.provided.data || req.program_loop) provided("data", datas);
  else plan.data = choose(EMBER_KIND_DATA, datas, "data", "name", plan.raw.peek_string("data", "name"), "");

  // Defaults, as Lightning's logger=True / enable_checkpointing=True.
  if (plan.loggers.empty() && req.provided.loggers.empty() && peek<bool>(plan.raw, "trainer", "logger").value_or(true))
    plan.loggers.push_back(&reg.load(defaults::kLogger));
  bool has_checkpoint = std::any_of(plan.callbacks.begin(), plan.callbacks.end(), [](auto* p) { return p->name == defaults::kCheckpointCallback; });
  if (!has_checkpoint && peek<bool>(plan.raw, "trainer", "enable_checkpointing").value_or(true))
    plan.callbacks.push_back(&reg.load(defaults::kCheckpointCallback));
  // enable_model_summary adds the model_summary callback (Lightning's default ModelSummary); a
  // model_summary named explicitly is used as configured.
  bool has_summary = std::any_of(plan.callbacks.begin(), plan.callbacks.end(), [](auto* p) { return p->name == defaults::kSummaryCallback; });
  if (!has_summary && peek<bool>(plan.raw, "trainer", "enable_model_summary").value_or(true))
    plan.callbacks.push_back(&reg.load(defaults::kSummaryCallback));

  // trainer.max_time adds the timer callback (Lightning adds its Timer). A timer named as well
  // must have the same duration (the resolved config names both), never a silently ignored one.
  const auto max_time = plan.raw.peek_string("trainer", "max_time");
  if (max_time) {
    bool has_timer = std::any_of(plan.callbacks.begin(), plan.callbacks.end(), [](auto* p) { return p->name == defaults::kTimerCallback; });
    const auto duration = plan.raw.peek_string("timer", "duration");
    if (has_timer && duration && *duration != *max_time)
      throw UsageError(set_where(plan.raw, "trainer", "max_time") + ": trainer.max_time = \"" + *max_time +
                       "\" and timer.duration = \"" + *duration + "\" (" + set_where(plan.raw, "timer", "duration") +
                       ") both set the time limit; keep one of them");
    if (!has_timer) plan.callbacks.push_back(&reg.load(defaults::kTimerCallback));
  }

  // Schemas, in the order `engine config` prints them.
  std::vector<SectionSchema> schemas;
  schemas.push_back(trainer_schema());
  auto with_base = [&](const char* name, std::vector<KeySchema> base, const PluginInfo* p) {
    SectionSchema s;
    s.name = name;
    s.keys = std::move(base);
    if (!p) {  // an object the program provides: only the engine's keys of the section apply
      s.description = std::string(name) + " object provided by the program";
      return s;
    }
    s.description = std::string(name) + " plugin '" + p->name + "'";
    // No clash with the engine's keys: the plugin's load refuses one (load_descriptor).
    for (auto& k : keys_from_descriptor(p->descriptor->config_keys, p->descriptor->num_config_keys)) s.keys.push_back(std::move(k));
    s.elsewhere = elsewhere_from_descriptor(p->descriptor->config_keys, p->descriptor->num_config_keys);
    return s;
  };
  schemas.push_back(with_base("model", model_base_keys(), plan.model));
  schemas.push_back(with_base("data", data_base_keys(), plan.data));
  schemas.push_back(optimizer_schema());
  schemas.push_back(parallelism_schema());
  schemas.push_back(metrics_schema());
  std::vector<const PluginInfo*> own_sections = {plan.strategy, plan.precision};
  own_sections.insert(own_sections.end(), plan.callbacks.begin(), plan.callbacks.end());
  own_sections.insert(own_sections.end(), plan.loggers.begin(), plan.loggers.end());
  std::vector<std::string> printed_plugins;
  for (const auto* p : own_sections) {
    SectionSchema s;
    s.name = p->name;
    s.description = std::string(kind_name(p->descriptor->kind)) + " plugin " + p->name + " " + p->descriptor->version;
    s.keys = keys_from_descriptor(p->descriptor->config_keys, p->descriptor->num_config_keys);
    s.elsewhere = elsewhere_from_descriptor(p->descriptor->config_keys, p->descriptor->num_config_keys);
    schemas.push_back(std::move(s));
    if (p->descriptor->kind == EMBER_KIND_CALLBACK || p->descriptor->kind == EMBER_KIND_LOGGER) printed_plugins.push_back(p->name);
  }
  plan.config = ResolvedConfig::resolve(plan.raw, std::move(schemas), printed_plugins);
  // The resolved config names the strategy and precision actually chosen, so that feeding it
  // back (without --plugins) runs the same plugins.
  const auto& t = plan.config.section("trainer");
  if (t.get_string("strategy") != plan.strategy->name)
    plan.config.set("trainer", "strategy", plan.strategy->name, strategies.empty() ? "auto" : "--plugins");
  if (precision_plugin_for(t.get_string("precision")) != plan.precision->name)
    plan.config.set("trainer", "precision", plan.precision->name, plan.auto_precision_note.empty() ? "--plugins" : "auto");
  if (max_time) plan.config.set("timer", "duration", *max_time, set_where(plan.raw, "trainer", "max_time"));
  // [metrics] is checked now, before anything is loaded or launched (the loop makes its own).
  (void)ConfiguredMetrics(plan.config.section("metrics"));
  return plan;
}

}  // namespace ember::engine
