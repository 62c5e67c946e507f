// Slurm's automatic requeue (Lightning's SLURMEnvironment(auto_requeue=True)): a batch job stopped
// by SIGUSR1 (`sbatch --signal=USR1@120`: the warning before the time limit or a preemption) has
// saved last.ckpt; rank 0 then asks Slurm to queue the job again (`scontrol requeue <job>`), and
// the next start resumes from that checkpoint (`--resume last`, or by itself: SLURM_RESTART_COUNT).
#pragma once
#include <string>

namespace ember::engine {

// The job to requeue from this process's environment: SLURM_ARRAY_JOB_ID_SLURM_ARRAY_TASK_ID for
// an array task, else SLURM_JOB_ID; "" outside a batch job (no job id, or an interactive one:
// SLURM_JOB_NAME "bash" or "interactive", as Lightning decides).
std::string slurm_job_to_requeue();

// Runs `scontrol requeue <job>` (found on PATH; at most 60 s) and logs what came of it: a line
// saying the job was requeued, or a warning with the reason (the run's exit code stays 128+signal
// either way, so a job script can still requeue by itself).
void requeue_slurm_job(const std::string& job);

}  // namespace ember::engine
