// torchrun's elastic agent re-forms its worker group when a node joins or leaves
// (`--nnodes=MIN:MAX`) and does not count that as a restart: TORCHELASTIC_RESTART_COUNT stays
// what it was, so the new ranks cannot tell from it that their job already trained. The run
// folder remembers the job instead: rank 0 writes torchrun's job id (TORCHELASTIC_RUN_ID, its
// --rdzv-id) into it, and a group of the same job that finds that folder resumes from its last
// checkpoint by itself. A new torchrun job has another id (--standalone makes a fresh one each
// time), so it never picks up an older job's run.
#pragma once
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

namespace ember::engine {

// This process's torchrun job id; "" outside torchrun and for torchrun's default id "none",
// which every job given no --rdzv-id shares and so does not tell jobs apart.
std::string torchrun_job_id();

// The newest version_<n> under `base` (only version_<version> when given) that job `id` wrote
// into; nullopt when none did.
std::optional<int64_t> version_of_torchrun_job(const std::filesystem::path& base, std::optional<int64_t> version,
                                               const std::string& id);

// Records job `id` in run folder `dir` (rank 0, once the folder exists).
void mark_torchrun_job(const std::filesystem::path& dir, const std::string& id);

}  // namespace ember::engine
