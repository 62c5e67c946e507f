#include "session/stop_signals.h"

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstring>
#include <utility>

#include "config/run_config.h"

namespace ember::engine {
namespace {
// Set by the handlers; the training loop reads it after every training batch.
std::atomic<int> g_stop_signal{0};

void on_stop_signal(int sig) {
  g_stop_signal.store(sig);
  // A second signal ends the process at once.
  std::signal(sig, SIG_DFL);
}
}  // namespace

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

void install_stop_signal_handlers(const std::vector<int>& signals) {
  for (int sig : signals) std::signal(sig, on_stop_signal);
}

int stop_signal() { return g_stop_signal.load(); }

std::string stop_signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

}  // namespace ember::engine
