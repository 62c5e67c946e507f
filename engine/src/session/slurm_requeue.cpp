#include "session/slurm_requeue.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "common/log.h"

extern char** environ;

namespace ember::engine {
namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

}  // namespace

std::string slurm_job_to_requeue() {
  const std::string name = env("SLURM_JOB_NAME");
  if (name == "bash" || name == "interactive") return "";
  const std::string array = env("SLURM_ARRAY_JOB_ID"), task = env("SLURM_ARRAY_TASK_ID");
  if (!array.empty() && !task.empty()) return array + "_" + task;
  return env("SLURM_JOB_ID");
}

void requeue_slurm_job(const std::string& job) {
  const std::string what = "Slurm: scontrol requeue " + job;
  std::vector<std::string> args = {"scontrol", "requeue", job};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (const int err = posix_spawnp(&pid, "scontrol", nullptr, nullptr, argv.data(), environ); err != 0) {
    log::warn(what + " could not start (" + std::string(strerror(err)) + "): the job is not requeued; requeue it from the job script");
    return;
  }
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      log::warn(what + " did not answer within 60 s: the job may not be requeued");
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
    log::info(what + ": the job is queued again and resumes from its last checkpoint when it starts");
  } else {
    log::warn(what + " failed (" + (WIFEXITED(status) ? "exit code " + std::to_string(WEXITSTATUS(status)) : std::string("killed by a signal")) +
              "): the job is not requeued; requeue it from the job script");
  }
}

}  // namespace ember::engine
