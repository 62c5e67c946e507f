// How ranks started without an MPI runtime (the local launcher, torchrun) form one MPI group:
// rank 0 starts an ompi-server, the others accept/connect through it (join_mpi in mpi_backend.h).
// Built only when Open MPI is found (EMBER_WITH_MPI).
#include "ember/distributed/launch.h"
#include "mpi_backend.h"

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace ember_dist {

namespace {

void set_default_env(const char* name, const std::string& value) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') setenv(name, value.c_str(), 1);
}

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr == "::1" || addr.rfind("127.", 0) == 0;
}

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

// Exits the process with a clear line if `done` is not set within the timeout: the MPI calls of
// the rendezvous (accept, connect) have no timeout of their own. The line names the step the rank
// was stuck in (at()), so a hang says which side to look at.
class Deadline {
 public:
  Deadline(std::chrono::milliseconds timeout, std::string what) : what_(std::move(what)) {
    thread_ = std::thread([this, timeout] {
      std::unique_lock lock(mutex_);
      if (!cv_.wait_for(lock, timeout, [&] { return done_; })) {
        std::fprintf(stderr, "%s did not finish within %.0f s, stuck %s (a rank did not start, died, or cannot reach the others)\n",
                     what_.c_str(), std::chrono::duration<double>(timeout).count(), stage_.c_str());
        std::fflush(stderr);
        std::_Exit(kJoinStalledExit);
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
  void at(std::string stage) {
    std::lock_guard lock(mutex_);
    stage_ = std::move(stage);
  }

 private:
  std::string what_;
  std::string stage_ = "before it began";
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
  // Rank 0 starts the server, its own MPI and its port before it tells the others where the server
  // is: the others' MPI starts never race rank 0's against a server that is still coming up.
  char port[MPI_MAX_PORT_NAME] = {0};
  if (info.rank == 0) {
    deadline.at("starting ompi-server");
    const std::string uri = start_ompi_server(server, timeout);
    setenv("OMPI_MCA_pmix_server_uri", uri.c_str(), 1);
    deadline.at("in MPI_Init_thread (through ompi-server " + uri + ")");
    init_mpi();
    deadline.at("in MPI_Open_port");
    check_mpi(MPI_Open_port(MPI_INFO_NULL, port), "MPI_Open_port");
    store->set("port", bytes(port));
    store->set("ompi_server", bytes(uri));
  } else {
    // Fault injection for the tests (tests/ddp_test.cpp): rank 1 stalls in its join when it is the
    // first to create the file this names, as a stalled Open MPI rendezvous would.
    if (const char* marker = std::getenv("EMBER_TEST_STALL_MPI_JOIN_ONCE"); marker && *marker && info.rank == 1) {
      const int fd = ::open(marker, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
      if (fd >= 0) {
        ::close(fd);
        deadline.at("stalled on purpose (EMBER_TEST_STALL_MPI_JOIN_ONCE)");
        for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
      }
    }
    deadline.at("waiting for rank 0 to start ompi-server and publish its address");
    const std::string uri = text(store->get("ompi_server"));
    setenv("OMPI_MCA_pmix_server_uri", uri.c_str(), 1);
    deadline.at("in MPI_Init_thread (through ompi-server " + uri + ")");
    init_mpi();
  }
  MPI_Comm comm = MPI_COMM_SELF;
  for (int k = 1; k < info.world; ++k) {
    MPI_Comm inter = MPI_COMM_NULL, merged = MPI_COMM_NULL;
    if (info.rank < k) {
      // Rank k connects only when it is its turn, so ranks join in order and keep their number.
      if (info.rank == 0) store->set("turn/" + std::to_string(k), bytes("1"));
      deadline.at("in MPI_Comm_accept for rank " + std::to_string(k));
      check_mpi(MPI_Comm_accept(port, MPI_INFO_NULL, 0, comm, &inter), "MPI_Comm_accept");
    } else if (info.rank == k) {
      deadline.at("waiting for its turn to connect (the ranks before it joined and rank 0 said so)");
      store->wait({"turn/" + std::to_string(k)});
      const std::string name = text(store->get("port"));
      deadline.at("in MPI_Comm_connect to rank 0's port");
      check_mpi(MPI_Comm_connect(name.c_str(), MPI_INFO_NULL, 0, MPI_COMM_SELF, &inter), "MPI_Comm_connect");
    } else {
      continue;
    }
    deadline.at("in MPI_Intercomm_merge with rank " + std::to_string(k));
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
