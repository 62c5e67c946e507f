// Test plugin: makes one rank fail at a chosen step (SIGKILL itself, or hang forever), for the
// ddp failure tests.
#include <ember/callback_base.h>
#include <ember/plugin.h>

#include <signal.h>
#include <unistd.h>

#include <string>

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::Int("rank", "1", "The rank that fails.").at_least(0),
    ember::key::Int("step", "2", "Global step at whose batch start it fails.").at_least(0),
    ember::key::String("action", "\"kill\"", "kill: SIGKILL itself; hang: sleep forever.").choices("kill|hang"),
};

class Chaos final : public ember::ICallback {
 public:
  explicit Chaos(const ember::IConfig& cfg)
      : rank_(cfg.get_int("rank")), step_(cfg.get_int("step")), hang_(cfg.get_string("action") == "hang") {}

  void on_hook(ember::Hook hook, ember::ITrainer& t) override {
    if (hook != ember::Hook::on_train_batch_start || t.rank() != rank_ || t.global_step() != step_) return;
    if (!hang_) raise(SIGKILL);
    for (;;) pause();
  }

 private:
  int64_t rank_, step_;
  bool hang_;
};

ember::ICallback* make(ember::IHost&, const ember::IConfig& cfg) { return new Chaos(cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "chaos", "0.0.1", "Apache-2.0", "Test: one rank dies or hangs at a given step.",
             EMBER_CONFIG_KEYS(kKeys), make)
