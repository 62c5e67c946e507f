#include "launch.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
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

#include "mpi_backend.h"

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

void set_default_env(const char* name, const std::string& value) {
  if (!env(name)) setenv(name, value.c_str(), 1);
}

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr == "::1" || addr.rfind("127.", 0) == 0;
}

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "was killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  const int code = WEXITSTATUS(status);
  if (code == kPeerFailureExit) return "gave up waiting for another rank (exit code " + std::to_string(code) + ")";
  return "exited with code " + std::to_string(code);
}

std::atomic<int> g_forward_signal{0};
void on_launcher_signal(int sig) { g_forward_signal.store(sig); }

// Exits the process with a clear line if `done` is not set within the timeout: the MPI calls of
// the rendezvous (accept, connect) have no timeout of their own.
class Deadline {
 public:
  Deadline(std::chrono::milliseconds timeout, std::string what) : what_(std::move(what)) {
    thread_ = std::thread([this, timeout] {
      std::unique_lock lock(mutex_);
      if (!cv_.wait_for(lock, timeout, [&] { return done_; })) {
        std::fprintf(stderr, "%s did not finish within %.0f s (a rank did not start, died, or cannot reach the others)\n",
                     what_.c_str(), std::chrono::duration<double>(timeout).count());
        std::fflush(stderr);
        std::_Exit(kPeerFailureExit);
      }
    });
  }
  ~Deadline() {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::string what_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

void init_mpi() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) return;
  int provided = 0;
  // Every MPI call of a rank happens on one thread at a time (the backend's thread after setup).
  check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
  if (provided < MPI_THREAD_SERIALIZED)
    throw std::runtime_error(strategy_name() + ": this MPI library does not support MPI_THREAD_SERIALIZED (use Open MPI 4.1 from Debian's libopenmpi-dev)");
}

// Starts `ompi-server`, the runtime that lets independently started MPI processes connect, and
// returns its contact URI.
std::string start_ompi_server(pid_t* pid, std::chrono::milliseconds timeout) {
  char path[] = "/tmp/ember-ddp-ompi-server-XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) throw std::runtime_error((strategy_name() + ": cannot create a temporary file: ") + std::strerror(errno));
  close(fd);
  const pid_t parent = getpid();
  const pid_t child = fork();
  if (child < 0) throw std::runtime_error((strategy_name() + ": fork failed: ") + std::strerror(errno));
  if (child == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);  // never outlives rank 0
    if (getppid() != parent) _exit(1);
    execlp("ompi-server", "ompi-server", "--no-daemonize", "-r", path, static_cast<char*>(nullptr));
    _exit(127);
  }
  *pid = child;
  const auto until = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    std::ifstream in(path);
    std::string uri;
    if (in && std::getline(in, uri) && !in.eof() && !uri.empty()) {
      std::remove(path);
      return uri;
    }
    int status = 0;
    if (waitpid(child, &status, WNOHANG) == child) {
      std::remove(path);
      *pid = -1;
      throw std::runtime_error(WIFEXITED(status) && WEXITSTATUS(status) == 127
                                   ? strategy_name() + ": 'ompi-server' was not found on PATH; install Open MPI (Debian: openmpi-bin, see scripts/setup.sh)"
                                   : strategy_name() + ": ompi-server " + describe_status(status) + " before reporting its address");
    }
    if (std::chrono::steady_clock::now() > until) {
      std::remove(path);
      throw std::runtime_error(strategy_name() + ": ompi-server did not report its address in time");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

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

int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error((strategy_name() + ": socket: ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const std::string why = std::strerror(errno);
    close(fd);
    throw std::runtime_error(strategy_name() + ": cannot find a free port: " + why);
  }
  close(fd);
  return ntohs(addr.sin_port);
}

int run_local_ranks(const LocalLaunch& l) {
  // The children's environment: ours plus a torchrun-style rank environment.
  std::vector<std::string> base;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv(*e);
    const std::string key = kv.substr(0, kv.find('='));
    if (key == "RANK" || key == "WORLD_SIZE" || key == "LOCAL_RANK" || key == "LOCAL_WORLD_SIZE" || key == "GROUP_RANK" ||
        key == "MASTER_ADDR" || key == "MASTER_PORT")
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
  std::chrono::steady_clock::time_point kill_at{};
  bool killed = false;
  auto alive = [&] {
    int k = 0;
    for (auto& c : children) k += c.running ? 1 : 0;
    return k;
  };
  while (alive() > 0) {
    if (const int sig = g_forward_signal.exchange(0))
      for (auto& c : children)
        if (c.running) kill(c.pid, sig);
    for (auto& c : children) {
      if (!c.running) continue;
      int status = 0;
      const pid_t r = waitpid(c.pid, &status, WNOHANG);
      if (r != c.pid) continue;
      c.running = false;
      c.status = status;
      const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (ok || failure) continue;
      if (WIFEXITED(status) && WEXITSTATUS(status) == kPeerFailureExit) {
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
            if (!(WIFEXITED(s) && (WEXITSTATUS(s) == 0 || WEXITSTATUS(s) == kPeerFailureExit)) && !failure) {
              failure = "rank " + std::to_string(o.rank) + " (pid " + std::to_string(o.pid) + ") " + describe_status(s);
              exit_code = WIFSIGNALED(s) ? 128 + WTERMSIG(s) : WEXITSTATUS(s);
            }
            continue;
          }
          hung += (hung.empty() ? "" : ", ") + std::to_string(o.rank) + " (pid " + std::to_string(o.pid) + ")";
        }
        if (!failure) {
          failure = hung.empty() ? "rank " + std::to_string(c.rank) + " " + describe_status(status)
                                 : "rank(s) " + hung + " hang: rank " + std::to_string(c.rank) +
                                       " waited for them in a collective for the whole timeout";
          exit_code = kPeerFailureExit;
        }
      } else {
        failure = "rank " + std::to_string(c.rank) + " (pid " + std::to_string(c.pid) + ") " + describe_status(status);
        exit_code = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
      }
      std::fprintf(stderr, "%s launcher: %s; stopping the job\n", strategy_name().c_str(), failure->c_str());
      std::fflush(stderr);
      kill_at = std::chrono::steady_clock::now() + l.timeout + std::chrono::seconds(2);
    }
    if (failure && !killed && std::chrono::steady_clock::now() >= kill_at) {
      // Hung ranks are killed at once; the others had the timeout to end by themselves.
      killed = true;
      for (auto& c : children)
        if (c.running) kill(c.pid, SIGKILL);
    }
    if (failure && !killed && exit_code == kPeerFailureExit) kill_at = std::chrono::steady_clock::now();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
  if (failure) {
    std::fprintf(stderr, "%s launcher: the job failed: %s\n", strategy_name().c_str(), failure->c_str());
    std::fflush(stderr);
    return exit_code != 0 ? exit_code : 1;
  }
  // A clean exit of every rank, or all stopped by a forwarded signal with the same status.
  for (auto& c : children)
    if (!(WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0)) return WIFEXITED(c.status) ? WEXITSTATUS(c.status) : 1;
  return 0;
}

c10::intrusive_ptr<c10d::Store> make_store(const RankInfo& info, std::chrono::milliseconds timeout) {
  if (info.master_addr.empty() || info.master_port <= 0)
    throw std::runtime_error(strategy_name() + ": rank " + std::to_string(info.rank) + " of " + std::to_string(info.world) + " (started by " +
                             info.source + ") has no rendezvous address: set MASTER_ADDR and MASTER_PORT, or ["+ strategy_name() + "] master_addr and master_port");
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(info.master_port);
  opts.isServer = info.rank == 0 && !info.agent_store;
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

MPI_Comm join_mpi(const RankInfo& info, c10d::Store* store, std::chrono::milliseconds timeout, pid_t* server) {
  *server = -1;
  if (info.mpi_wired || info.world == 1) {
    init_mpi();
    MPI_Comm comm = MPI_COMM_NULL;
    check_mpi(MPI_Comm_dup(info.world == 1 ? MPI_COMM_SELF : MPI_COMM_WORLD, &comm), "MPI_Comm_dup");
    int rank = 0, size = 0;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    if (size != info.world || rank != info.rank)
      throw std::runtime_error(strategy_name() + ": MPI says rank " + std::to_string(rank) + " of " + std::to_string(size) + " but " + info.source +
                               " says rank " + std::to_string(info.rank) + " of " + std::to_string(info.world) +
                               " (is the engine linked against the MPI of the mpirun that started it?)");
    return comm;
  }
  if (store == nullptr) throw std::runtime_error(strategy_name() + ": joining an MPI group needs the rendezvous store");
  // Independently started processes (torchrun, the local launcher) share no MPI runtime: rank 0
  // starts an ompi-server for all of them, then they join one by one with accept/connect.
  if (is_loopback(info.master_addr)) {
    set_default_env("OMPI_MCA_btl_tcp_if_include", "lo");
    set_default_env("OMPI_MCA_oob_tcp_if_include", "lo");
  }
  // Singletons do not know whether the node is oversubscribed (mpirun does): without this, a
  // rank waiting in a collective spins and takes the core a peer needs (8x slower on 2 cores).
  set_default_env("OMPI_MCA_mpi_yield_when_idle", "1");
  Deadline deadline(timeout, strategy_name() + ": rank " + std::to_string(info.rank) + ": joining the MPI group of " + std::to_string(info.world) + " ranks");
  std::string uri;
  if (info.rank == 0) {
    uri = start_ompi_server(server, timeout);
    store->set("ompi_server", bytes(uri));
  } else {
    uri = text(store->get("ompi_server"));
  }
  setenv("OMPI_MCA_pmix_server_uri", uri.c_str(), 1);
  init_mpi();
  char port[MPI_MAX_PORT_NAME] = {0};
  if (info.rank == 0) {
    check_mpi(MPI_Open_port(MPI_INFO_NULL, port), "MPI_Open_port");
    store->set("port", bytes(port));
  }
  MPI_Comm comm = MPI_COMM_SELF;
  for (int k = 1; k < info.world; ++k) {
    MPI_Comm inter = MPI_COMM_NULL, merged = MPI_COMM_NULL;
    if (info.rank < k) {
      // Rank k connects only when it is its turn, so ranks join in order and keep their number.
      if (info.rank == 0) store->set("turn/" + std::to_string(k), bytes("1"));
      check_mpi(MPI_Comm_accept(port, MPI_INFO_NULL, 0, comm, &inter), "MPI_Comm_accept");
    } else if (info.rank == k) {
      store->wait({"turn/" + std::to_string(k)});
      const std::string name = text(store->get("port"));
      check_mpi(MPI_Comm_connect(name.c_str(), MPI_INFO_NULL, 0, MPI_COMM_SELF, &inter), "MPI_Comm_connect");
    } else {
      continue;
    }
    check_mpi(MPI_Intercomm_merge(inter, info.rank == k ? 1 : 0, &merged), "MPI_Intercomm_merge");
    MPI_Comm_free(&inter);
    if (comm != MPI_COMM_SELF) MPI_Comm_free(&comm);
    comm = merged;
  }
  if (info.rank == 0) MPI_Close_port(port);
  if (comm == MPI_COMM_SELF) check_mpi(MPI_Comm_dup(MPI_COMM_SELF, &comm), "MPI_Comm_dup");
  int rank = 0, size = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  if (rank != info.rank || size != info.world)
    throw std::runtime_error(strategy_name() + ": joined the MPI group as rank " + std::to_string(rank) + " of " + std::to_string(size) +
                             ", expected " + std::to_string(info.rank) + " of " + std::to_string(info.world));
  return comm;
}

}  // namespace ember_dist
