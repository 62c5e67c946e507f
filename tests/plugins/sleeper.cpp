// Test plugin: sleeps a fixed time in a chosen hook, so the run has a known rate (throughput) and
// a known phase duration (profilers), or a phase of an elastic job that lasts until it is re-formed.
#include <ember/support/callback_base.h>
#include <ember/error.h>
#include <ember/plugin.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::StringList("hooks", "[\"on_train_batch_start\"]", "The hooks that sleep (their names)."),
    ember::key::FloatList("seconds", "[0.02]", "How long each of them sleeps.").at_least(0),
    ember::key::Int("world_size", "0", "Sleeps only in a run of this many ranks (0: in every run).").at_least(0),
};

class Sleeper final : public ember::ICallback {
 public:
  explicit Sleeper(const ember::IConfig& cfg)
      : hooks_(cfg.get_string_list("hooks")), seconds_(cfg.get_float_list("seconds")), world_size_(cfg.get_int("world_size")) {
    if (hooks_.size() != seconds_.size()) throw ember::ConfigError("sleeper: hooks and seconds differ in length");
  }
  void on_hook(ember::Hook hook, ember::ITrainer& t) override {
    if (world_size_ > 0 && t.world_size() != world_size_) return;
    for (size_t i = 0; i < hooks_.size(); ++i)
      if (hooks_[i] == ember::hook_name(hook)) std::this_thread::sleep_for(std::chrono::duration<double>(seconds_[i]));
  }

 private:
  std::vector<std::string> hooks_;
  std::vector<double> seconds_;
  int64_t world_size_;
};

ember::ICallback* make(ember::IHost&, const ember::IConfig& cfg) { return new Sleeper(cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "sleeper", "0.1.0", "Apache-2.0", "Test plugin: sleeps in one hook.",
             EMBER_CONFIG_KEYS(kKeys), make)
