// `engine plot RUN_DIR... --output FILE.png`: learning curves of one or several runs, drawn from
// their metrics.csv with cairo.
#pragma once
#include <iosfwd>
#include <string>
#include <vector>

namespace ember::engine {

// Draws the runs' loss, accuracy and learning-rate curves (x = step; train solid, val dashed, one
// colour per run) into `output` (PNG). Throws UsageError for unreadable runs or no curves.
int plot_runs(const std::vector<std::string>& run_dirs, const std::string& output, std::ostream& out);

}  // namespace ember::engine
