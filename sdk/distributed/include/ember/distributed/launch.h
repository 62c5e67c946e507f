// How the ranks of a multi-process strategy (ddp, sharded) come to be and find each other: the launchers' rank environments, the local
// launcher (trainer.devices = N), the TCPStore rendezvous and the joining of an MPI group.
#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <optional>
#include <string>
#include <sys/types.h>
#include <vector>

namespace ember_dist {

// Exit status of a rank that gave up because a peer failed (died, hung, or broke the link).
constexpr int kPeerFailureExit = 3;
// Exit status of a rank whose MPI join (join_mpi) did not finish within the timeout. No rank gets
// past the join before all do, so the group never formed and nothing was trained: the local
// launcher starts the ranks once more (Open MPI's rendezvous of separately started processes
// through ompi-server stalls on rare occasions).
constexpr int kJoinStalledExit = 4;

// "exited with code 1", "was killed by signal 9 (Killed)", ... for a waitpid() status.
std::string describe_status(int status);

// The strategy plugin these ranks belong to ("ddp", "sharded"): the prefix of every message.
void set_strategy_name(std::string name);
const std::string& strategy_name();

struct RankInfo {
  int rank = 0, world = 1, local_rank = 0, local_world = 1;
  std::string source;          // "torchrun", "mpirun", "srun", "pmi" or "single"
  bool mpi_wired = false;      // an MPI runtime (mpirun, srun with PMIx) wired MPI_COMM_WORLD
  std::string master_addr;     // empty: none given
  int master_port = 0;
  bool agent_store = false;    // torchrun hosts the store (TORCHELASTIC_USE_AGENT_STORE)
  bool launcher_store = false; // Ember's local launcher hosts the store (EMBER_LAUNCHER_STORE)
  std::string restart_count;   // TORCHELASTIC_RESTART_COUNT
};

// The rank environment a launcher set, if any: torchrun (RANK, WORLD_SIZE, LOCAL_RANK, ...),
// mpirun (OMPI_COMM_WORLD_*), srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID) or an MPICH-style
// PMI launcher (PMI_RANK, PMI_SIZE). Throws std::runtime_error on malformed values.
std::optional<RankInfo> rank_from_environment();

struct LocalLaunch {
  std::vector<std::string> argv;  // the engine's command line, re-executed for every rank
  int nprocs = 1, node_rank = 0, world = 1;
  std::string master_addr;
  int master_port = 0;
  bool launcher_store = false;  // the launcher hosts the store at master_port (host_launcher_store): rank 0 joins it as a client
  std::chrono::milliseconds timeout{0};
  int restart_count = 0;  // the attempt (trainer.max_restarts): the ranks see EMBER_RESTART_COUNT
};
// Starts the ranks of this node as child processes with a torchrun-style environment, forwards
// SIGINT/SIGTERM to them, and waits. When a rank fails, names it, gives the others the timeout
// to end on their own, then kills them. Returns the exit code for the launcher process;
// *interrupted (when given) says whether the launcher forwarded a signal (a stop asked by the
// user or the scheduler, not a failure to retry).
int run_local_ranks(const LocalLaunch& launch, bool* interrupted = nullptr);

// The rendezvous store of a single-node job without a fixed port, hosted by the local launcher on
// a port the system picks (getPort()), and kept open until its ranks end. A port picked free and
// bound later by rank 0 could be taken in between by any process on the machine: rank 0 would fail
// with EADDRINUSE, or the other ranks would reach someone else's store.
struct LauncherStore {
  c10::intrusive_ptr<c10d::Store> store;  // the TCPStore server; the port is held while it lives
  int port = 0;
};
LauncherStore host_launcher_store(const std::string& master_addr, std::chrono::milliseconds timeout);

// The rendezvous store: rank 0 hosts it unless torchrun's agent or Ember's local launcher does.
c10::intrusive_ptr<c10d::Store> make_store(const RankInfo& info, std::chrono::milliseconds timeout);

}  // namespace ember_dist
