#include "session/run_folder.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <utility>

#include "checkpoint/checkpoint_io.h"
#include "common/log.h"
#include "config/run_config.h"
#include "checkpoint/sharded_checkpoint.h"

namespace fs = std::filesystem;

namespace ember::engine {
namespace {
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


// The file `--resume last` uses: the first of the checkpoint callback's candidates (its order:
// ICheckpointCandidates, last.ckpt first) that is a whole Ember checkpoint; empty when there is
// none. Weights-only files, other programs' files and unreadable ones are skipped with a warning.
// One exception: a whole checkpoint that holds a later step than that first one and was written
// after it is a save cut short between its files (killed after the top-k file was durable and
// before last.ckpt was written or linked), so it is the newest state and is taken instead. Both
// conditions: a later step written earlier is a state a rollback (spike_guard) went back from.
fs::path resumable_last(const std::vector<std::string>& candidates) {
  // A sharded checkpoint directory is judged by its meta.ckpt (the run's state and flags).
  auto file_of = [](const fs::path& p) { return is_sharded_checkpoint(p) ? p / "meta.ckpt" : p; };
  auto written = [](const fs::path& file) {  // through a link (save_last = "link"): its file's
    std::error_code ec;
    const auto t = fs::last_write_time(file, ec);
    return ec ? fs::file_time_type::min() : t;
  };
  size_t first = 0;
  CheckpointProbe probe;
  for (; first < candidates.size(); ++first) {
    const fs::path p(candidates[first]);
    probe = probe_checkpoint_file(file_of(p));
    if (probe.ember && !probe.weights_only) break;
    log::warn("--resume last: skipping " + p.string() + ": " +
              (probe.ember ? std::string("it holds weights only (save_weights_only)") : "not an Ember checkpoint (" + probe.why + ")"));
  }
  if (first == candidates.size()) return {};
  const fs::path preferred(candidates[first]);
  if (!probe.global_step) return preferred;
  const auto preferred_written = written(file_of(preferred));
  fs::path chosen = preferred;
  int64_t chosen_step = *probe.global_step;
  for (size_t i = first + 1; i < candidates.size(); ++i) {
    const fs::path p(candidates[i]);
    if (written(file_of(p)) <= preferred_written) continue;  // cheap test first: most are older
    const auto other = probe_checkpoint_file(file_of(p));
    if (other.ember && !other.weights_only && other.global_step && *other.global_step > chosen_step) {
      chosen = p;
      chosen_step = *other.global_step;
    }
  }
  if (chosen != preferred)
    log::warn("--resume last: " + chosen.string() + " holds step " + std::to_string(chosen_step) + " and was written after " +
              preferred.string() + " (step " + std::to_string(*probe.global_step) +
              "), so the run resumes from the newer state (a save cut short before that file was updated, or the state a failed "
              "run saved: checkpoint.save_on_exception)");
  return chosen;
}
}  // namespace

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


fs::path find_checkpoint_in_runs(const fs::path& base, std::optional<int64_t> version, const std::string& alias,
                                 const std::vector<Named<ICallback>>& callbacks) {
  auto candidates = version ? std::vector<fs::path>{base / ("version_" + std::to_string(*version))} : versions_newest_first(base);
  for (const auto& dir : candidates) {
    auto found = locate_checkpoint(callbacks, alias, dir.string());
    if (!found.empty()) return found;
  }
  return {};
}

bool has_checkpoint_locator(const std::vector<Named<ICallback>>& callbacks) {
  return std::any_of(callbacks.begin(), callbacks.end(),
                     [](auto& c) { return c.object->query_interface(kCheckpointLocatorIid) != nullptr; });
}

RunFolder choose_run_folder(const fs::path& base, std::optional<int64_t> version, const std::string& resume,
                            const std::vector<Named<ICallback>>& callbacks, Runtime& runtime) {
  RunFolder out;
  fs::path& run_dir = out.dir;
  fs::path& checkpoint = out.checkpoint;
  bool& resume_in_place = out.resume_in_place;
  const int64_t rank = runtime.rank();
  const bool wants_locator = !resume.empty() && (resume == "last" || resume == "best");
  if (wants_locator && !has_checkpoint_locator(callbacks))
    throw UsageError("--resume " + resume + " needs a checkpoint callback (enable trainer.enable_checkpointing or add one), or give a checkpoint file");
  bool start_fresh = false;
  if (wants_locator) {
    auto candidates = version ? std::vector<fs::path>{base / ("version_" + std::to_string(*version))} : versions_newest_first(base);
    for (const auto& dir : candidates) {
      // `last` is what a requeued job resumes from: only a full Ember checkpoint will do.
      const std::string found = resume == "last" ? resumable_last(checkpoint_candidates(callbacks, resume, dir.string())).string()
                                                 : locate_checkpoint(callbacks, resume, dir.string());
      if (!found.empty()) {
        run_dir = dir;
        checkpoint = found;
        break;
      }
    }
    if (checkpoint.empty() && resume == "last") {
      // Lightning's ckpt_path="last": a job that is (re)started with --resume last before it
      // ever saved starts from scratch.
      log::warn("--resume last: no checkpoint to resume from under " + base.string() + "; starting from scratch");
      start_fresh = true;
    } else if (checkpoint.empty()) {
      throw UsageError("--resume " + resume + ": no '" + resume + "' checkpoint found under " + base.string() +
                       " (train first, or give the checkpoint's path)");
    } else {
      resume_in_place = true;
    }
  }
  if (!wants_locator || start_fresh) {
    if (!resume.empty() && !start_fresh) checkpoint = resume;
    run_dir = next_version_dir(base, version);
    // Every rank uses rank 0's folder: another rank could already see the folder rank 0 makes
    // below and count one more.
    if (!version && runtime.world_size() > 1) {
      const double mine = rank == 0 ? static_cast<double>(std::stoll(run_dir.filename().string().substr(8))) : 0.0;
      const auto zeros = runtime.reduce(at::scalar_tensor(mine, at::kDouble), ReduceOp::sum).item<double>();
      run_dir = base / ("version_" + std::to_string(static_cast<int64_t>(zeros)));
    }
  }
  if (rank == 0) fs::create_directories(run_dir);
  return out;
}

}  // namespace ember::engine
