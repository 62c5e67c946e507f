// Stop signals (trainer.stop_signals: SIGINT, SIGTERM and Slurm's SIGUSR1 by default) make the
// training loop stop after the current optimizer step, with the usual epoch-end work (the
// checkpoint callback saves last.ckpt, mid-epoch position included), so `--resume last` goes on
// exactly where the run was interrupted. Handlers are process-wide, so only the `engine` command
// installs them; a program embedding Ember opts in (or keeps its own).
#pragma once
#include <string>
#include <vector>

namespace ember::engine {

class Section;

// trainer.stop_signals as signal numbers; a UsageError naming the unknown entry otherwise.
std::vector<int> parse_stop_signals(const Section& trainer);
void install_stop_signal_handlers(const std::vector<int>& signals);
// The signal received since the handlers were installed, 0 if none.
int stop_signal();
// "SIGTERM" for SIGTERM.
std::string stop_signal_name(int sig);

}  // namespace ember::engine
