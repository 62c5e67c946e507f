#include "ember/distributed/launch.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <csignal>
#include <mutex>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace ember_dist {

namespace {
std::string& name_storage() {
  static std::string name = "ddp";
  return name;
}
}  // namespace
void set_strategy_name(std::string name) { name_storage() = std::move(name); }
const std::string& strategy_name() { return name_storage(); }

namespace {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

int env_int(const char* name, const std::string& value) {
  try {
    size_t used = 0;
    const long v = std::stol(value, &used);
    if (used == value.size() && v >= 0 && v <= 1 << 30) return static_cast<int>(v);
  } catch (const std::exception&) {
  }
  throw std::runtime_error((strategy_name() + ": environment variable ") + name + " = '" + value +
                           "' is not a non-negative integer (check how the job was launched)");
}

int env_int_or(const char* name, int fallback) {
  auto v = env(name);
  return v ? env_int(name, *v) : fallback;
}

}  // namespace

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "was killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  const int code = WEXITSTATUS(status);
  if (code == kPeerFailureExit) return "gave up waiting for another rank (exit code " + std::to_string(code) + ")";
  if (code == kJoinStalledExit) return "gave up joining the MPI group (exit code " + std::to_string(code) + ")";
  return "exited with code " + std::to_string(code);
}

namespace {

std::atomic<int> g_forward_signal{0};
void on_launcher_signal(int sig) { g_forward_signal.store(sig); }

}  // namespace

std::optional<RankInfo> rank_from_environment() {
  RankInfo info;
  if (auto r = env("RANK"), w = env("WORLD_SIZE"); r && w) {
    info.source = "torchrun";
    info.rank = env_int("RANK", *r);
    info.world = env_int("WORLD_SIZE", *w);
    info.local_rank = env_int_or("LOCAL_RANK", 0);
    info.local_world = env_int_or("LOCAL_WORLD_SIZE", info.world);
    info.agent_store = env("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
    info.restart_count = env("TORCHELASTIC_RESTART_COUNT").value_or("0");
    info.launcher_store = env("EMBER_LAUNCHER_STORE").value_or("") == "1";
  } else if (auto r = env("OMPI_COMM_WORLD_RANK"), w = env("OMPI_COMM_WORLD_SIZE"); r && w) {
    info.source = "mpirun";
    info.rank = env_int("OMPI_COMM_WORLD_RANK", *r);
    info.world = env_int("OMPI_COMM_WORLD_SIZE", *w);
    info.local_rank = env_int_or("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    info.local_world = env_int_or("OMPI_COMM_WORLD_LOCAL_SIZE", info.world);
    info.mpi_wired = true;
  } else if (auto r = env("SLURM_PROCID"), w = env("SLURM_NTASKS"); r && w && env("SLURM_STEP_ID")) {
    info.source = "srun";
    info.rank = env_int("SLURM_PROCID", *r);
    info.world = env_int("SLURM_NTASKS", *w);
    info.local_rank = env_int_or("SLURM_LOCALID", 0);
    info.local_world = env_int_or("SLURM_NTASKS_PER_NODE", info.world);
    // srun --mpi=pmix wires Open MPI's MPI_COMM_WORLD; otherwise the ranks join through the store.
    info.mpi_wired = env("PMIX_RANK").has_value();
  } else if (auto r = env("PMI_RANK"), w = env("PMI_SIZE"); r && w) {
    info.source = "pmi";
    info.rank = env_int("PMI_RANK", *r);
    info.world = env_int("PMI_SIZE", *w);
    info.local_rank = env_int_or("MPI_LOCALRANKID", env_int_or("PMI_LOCAL_RANK", 0));
    info.local_world = env_int_or("MPI_LOCALNRANKS", env_int_or("PMI_LOCAL_SIZE", info.world));
  } else {
    return std::nullopt;
  }
  if (info.world < 1 || info.rank >= info.world || info.local_rank >= std::max(info.local_world, 1))
    throw std::runtime_error(strategy_name() + ": the " + info.source + " environment says rank " + std::to_string(info.rank) + " of " +
                             std::to_string(info.world) + " (local rank " + std::to_string(info.local_rank) + " of " +
                             std::to_string(info.local_world) + "), which is inconsistent");
  if (auto a = env("MASTER_ADDR")) info.master_addr = *a;
  if (auto p = env("MASTER_PORT")) info.master_port = env_int("MASTER_PORT", *p);
  return info;
}

int run_local_ranks(const LocalLaunch& l, bool* interrupted) {
  if (interrupted) *interrupted = false;
  // The children's environment: ours plus a torchrun-style rank environment.
  std::vector<std::string> base;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv(*e);
    const std::string key = kv.substr(0, kv.find('='));
    if (key == "RANK" || key == "WORLD_SIZE" || key == "LOCAL_RANK" || key == "LOCAL_WORLD_SIZE" || key == "GROUP_RANK" ||
        key == "MASTER_ADDR" || key == "MASTER_PORT" || key == "EMBER_RESTART_COUNT" || key == "EMBER_LAUNCHER_STORE")
      continue;
    base.push_back(std::move(kv));
  }
  char exe[4096];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) throw std::runtime_error(strategy_name() + ": cannot find the engine's own executable (/proc/self/exe)");
  exe[n] = '\0';

  struct Child {
    pid_t pid = -1;
    int rank = 0;
    bool running = false;
    int status = 0;
  };
  std::vector<Child> children(static_cast<size_t>(l.nprocs));
  std::signal(SIGINT, on_launcher_signal);
  std::signal(SIGTERM, on_launcher_signal);
  const pid_t parent = getpid();
  for (int i = 0; i < l.nprocs; ++i) {
    const int rank = l.node_rank * l.nprocs + i;
    std::vector<std::string> envs = base;
    envs.push_back("RANK=" + std::to_string(rank));
    envs.push_back("WORLD_SIZE=" + std::to_string(l.world));
    envs.push_back("LOCAL_RANK=" + std::to_string(i));
    envs.push_back("LOCAL_WORLD_SIZE=" + std::to_string(l.nprocs));
    envs.push_back("GROUP_RANK=" + std::to_string(l.node_rank));
    envs.push_back("MASTER_ADDR=" + l.master_addr);
    envs.push_back("MASTER_PORT=" + std::to_string(l.master_port));
    if (l.restart_count > 0) envs.push_back("EMBER_RESTART_COUNT=" + std::to_string(l.restart_count));
    if (l.launcher_store) envs.push_back("EMBER_LAUNCHER_STORE=1");
    std::vector<char*> envp, argv;
    for (auto& s : envs) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> args = l.argv;
    for (auto& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);
    const pid_t pid = fork();
    if (pid < 0) throw std::runtime_error((strategy_name() + ": fork failed: ") + std::strerror(errno));
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // ranks never outlive their launcher
      if (getppid() != parent) _exit(1);
      execve(exe, argv.data(), envp.data());
      _exit(127);
    }
    children[static_cast<size_t>(i)] = Child{pid, rank, true, 0};
  }

  // Wait. The first rank to fail is the one named; the others get the timeout (plus a little) to
  // notice and end on their own before they are killed.
  std::optional<std::string> failure;
  int exit_code = 0;
  // Whether the group never formed: some rank's join stalled, and every other rank ended by
  // itself with success or a peer's failure (1: the store died with rank 0; never a crash).
  bool join_stalled = false, other_failure = false;
  auto gave_up = [](int s) { return WIFEXITED(s) && (WEXITSTATUS(s) == kPeerFailureExit || WEXITSTATUS(s) == kJoinStalledExit); };
  auto note = [&](int s) {
    if (WIFEXITED(s) && WEXITSTATUS(s) == kJoinStalledExit) join_stalled = true;
    else if (!(WIFEXITED(s) && (WEXITSTATUS(s) <= 1 || WEXITSTATUS(s) == kPeerFailureExit))) other_failure = true;
  };
  std::chrono::steady_clock::time_point kill_at{};
  bool killed = false;
  auto alive = [&] {
    int k = 0;
    for (auto& c : children) k += c.running ? 1 : 0;
    return k;
  };
  while (alive() > 0) {
    if (const int sig = g_forward_signal.exchange(0)) {
      if (interrupted) *interrupted = true;
      for (auto& c : children)
        if (c.running) kill(c.pid, sig);
    }
    for (auto& c : children) {
      if (!c.running) continue;
      int status = 0;
      const pid_t r = waitpid(c.pid, &status, WNOHANG);
      if (r != c.pid) continue;
      c.running = false;
      c.status = status;
      if (!killed) note(status);
      const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (ok || failure) continue;
      if (gave_up(status)) {
        // This rank timed out waiting for the others: the culprits are the ranks still running
        // (hung); give them a moment to fail on their own first.
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
        std::string hung;
        for (auto& o : children) {
          if (!o.running) continue;
          int s = 0;
          if (waitpid(o.pid, &s, WNOHANG) == o.pid) {
            o.running = false;
            o.status = s;
            note(s);
            if (!(WIFEXITED(s) && (WEXITSTATUS(s) == 0 || gave_up(s))) && !failure) {
              failure = "rank " + std::to_string(o.rank) + " (pid " + std::to_string(o.pid) + ") " + describe_status(s);
              exit_code = WIFSIGNALED(s) ? 128 + WTERMSIG(s) : WEXITSTATUS(s);
            }
            continue;
          }
          hung += (hung.empty() ? "" : ", ") + std::to_string(o.rank) + " (pid " + std::to_string(o.pid) + ")";
        }
        if (!failure) {
          failure = hung.empty() ? "rank " + std::to_string(c.rank) + " " + describe_status(status)
                                 : "rank(s) " + hung + " hang: rank " + std::to_string(c.rank) + " waited for them " +
                                       (WEXITSTATUS(status) == kJoinStalledExit ? "in its MPI join" : "in a collective") +
                                       " for the whole timeout";
          exit_code = WEXITSTATUS(status);
        }
      } else {
        failure = "rank " + std::to_string(c.rank) + " (pid " + std::to_string(c.pid) + ") " + describe_status(status);
        exit_code = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
      }
      std::fprintf(stderr, "%s launcher: %s; stopping the job\n", strategy_name().c_str(), failure->c_str());
      std::fflush(stderr);
      // The others get their whole timeout to end by themselves, and then the time a rank's
      // watchdog takes to say which ranks never reached the collective (MpiBackend: up to 2 s
      // asking the store, plus its tick): killed sooner, the survivor's line naming the culprit
      // is lost (a rank that entered the collective just after this one died times out later).
      kill_at = std::chrono::steady_clock::now() + l.timeout + std::chrono::seconds(5);
    }
    if (failure && !killed && std::chrono::steady_clock::now() >= kill_at) {
      // Hung ranks are killed at once; the others had the timeout to end by themselves.
      killed = true;
      for (auto& c : children)
        if (c.running) kill(c.pid, SIGKILL);
    }
    if (failure && !killed && (exit_code == kPeerFailureExit || exit_code == kJoinStalledExit)) kill_at = std::chrono::steady_clock::now();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
  if (failure) {
    std::fprintf(stderr, "%s launcher: the job failed: %s\n", strategy_name().c_str(), failure->c_str());
    std::fflush(stderr);
    if (join_stalled && !other_failure) return kJoinStalledExit;
    return exit_code != 0 ? exit_code : 1;
  }
  // A clean exit of every rank, or all stopped by a forwarded signal with the same status.
  for (auto& c : children)
    if (!(WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0)) return WIFEXITED(c.status) ? WEXITSTATUS(c.status) : 1;
  return 0;
}

LauncherStore host_launcher_store(const std::string& master_addr, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = 0;  // the system picks a free one, and it stays ours
  opts.isServer = true;
  opts.waitWorkers = false;
  opts.multiTenant = true;
  opts.timeout = timeout;
  try {
    auto store = c10::make_intrusive<c10d::TCPStore>(master_addr, opts);
    const int port = static_cast<int>(store->getPort());
    return {std::move(store), port};
  } catch (const std::exception& e) {
    const std::string what = e.what();
    throw std::runtime_error(strategy_name() + ": the launcher cannot host the rendezvous store at " + master_addr + ": " +
                             what.substr(0, what.find('\n')) + " (set [" + strategy_name() + "] master_addr to an address of this machine)");
  }
}

c10::intrusive_ptr<c10d::Store> make_store(const RankInfo& info, std::chrono::milliseconds timeout) {
  if (info.master_addr.empty() || info.master_port <= 0)
    throw std::runtime_error(strategy_name() + ": rank " + std::to_string(info.rank) + " of " + std::to_string(info.world) + " (started by " +
                             info.source + ") has no rendezvous address: set MASTER_ADDR and MASTER_PORT, or ["+ strategy_name() + "] master_addr and master_port");
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(info.master_port);
  opts.isServer = info.rank == 0 && !info.agent_store && !info.launcher_store;
  opts.waitWorkers = false;
  opts.multiTenant = true;
  opts.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(info.master_addr, opts);
  } catch (const std::exception& e) {
    std::string what = e.what();
    throw std::runtime_error(strategy_name() + ": rank " + std::to_string(info.rank) + " cannot " +
                             (opts.isServer ? "host" : "reach") + " the rendezvous store at " + info.master_addr + ":" +
                             std::to_string(info.master_port) + ": " + what.substr(0, what.find('\n')));
  }
  if (info.agent_store) store = c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + info.restart_count, store);
  return c10::make_intrusive<c10d::PrefixStore>("ember_ddp", store);
}

}  // namespace ember_dist
