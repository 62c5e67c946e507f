// Test plugin: makes one rank fail at a chosen step (SIGKILL itself, hang forever, or throw an
// error as a failing data file would), for the failure tests.
#include <ember/support/callback_base.h>
#include <ember/error.h>
#include <ember/plugin.h>

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::Int("rank", "1", "The rank that fails.").at_least(0),
    ember::key::Int("step", "2", "Global step at whose batch start it fails.").at_least(0),
    ember::key::String("action", "\"kill\"", "kill: SIGKILL itself; hang: sleep forever; stop: ask the trainer to stop (on this rank only); throw: an ember::RunError.")
        .choices("kill|hang|stop|throw"),
    ember::key::String("hook", "\"on_train_batch_start\"",
                       "When: at the start of the step's batch, when a checkpoint of that step is being saved (mid-save), or as its optimizer update begins.")
        .choices("on_train_batch_start|on_save_checkpoint|on_before_optimizer_step"),
    ember::key::Int("batch", "-1", "Also the batch index in the epoch (-1: the step's first batch that reaches the hook)."),
    ember::key::Int("attempt", "0",
                    "Fails only on this attempt of a restarted job (EMBER_RESTART_COUNT, TORCHELASTIC_RESTART_COUNT, else SLURM_RESTART_COUNT; 0 when unset), "
                    "so the restarted job gets past it.").at_least(0),
};

int64_t restart_attempt() {
  for (const char* name : {"EMBER_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"})
    if (const char* v = std::getenv(name); v && *v) return std::atoll(v);
  return 0;
}

class Chaos final : public ember::ICallback {
 public:
  explicit Chaos(const ember::IConfig& cfg)
      : rank_(cfg.get_int("rank")),
        step_(cfg.get_int("step")),
        hang_(cfg.get_string("action") == "hang"),
        stop_(cfg.get_string("action") == "stop"),
        throw_(cfg.get_string("action") == "throw"),
        when_(cfg.get_string("hook") == "on_save_checkpoint"         ? ember::Hook::on_save_checkpoint
              : cfg.get_string("hook") == "on_before_optimizer_step" ? ember::Hook::on_before_optimizer_step
                                                                      : ember::Hook::on_train_batch_start),
        batch_(cfg.get_int("batch")),
        armed_(cfg.get_int("attempt") == restart_attempt()) {}

  void on_hook(ember::Hook hook, ember::ITrainer& t) override {
    if (!armed_ || hook != when_ || t.rank() != rank_ || t.global_step() != step_ || (batch_ >= 0 && t.batch_idx() != batch_)) return;
    if (throw_) {
      armed_ = false;
      throw ember::RunError("chaos: thrown at step " + std::to_string(step_) + ", batch " + std::to_string(t.batch_idx()) + " (" +
                            ember::hook_name(hook) + ")");
    }
    if (stop_) {
      t.request_stop("chaos: asked on rank " + std::to_string(rank_) + " only");
      return;
    }
    if (!hang_) raise(SIGKILL);
    for (;;) pause();
  }

 private:
  int64_t rank_, step_;
  bool hang_, stop_, throw_;
  ember::Hook when_;
  int64_t batch_;
  bool armed_;
};

ember::ICallback* make(ember::IHost&, const ember::IConfig& cfg) { return new Chaos(cfg); }

}  // namespace

EMBER_PLUGIN(ember::ICallback, "chaos", "0.0.1", "Apache-2.0", "Test: one rank dies, hangs or throws at a given step.",
             EMBER_CONFIG_KEYS(kKeys), make)
