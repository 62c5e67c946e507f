// The process group of a multi-process strategy (ddp, sharded): how this process became a rank
// (local launcher, torchrun, mpirun, srun), its device, and the c10d backend it talks through
// (NCCL on GPUs, Open MPI on CPUs), with the metric/control collectives every strategy needs.
// One communicator per strategy object; teardown() ends the group.
#pragma once
#include <ember/config.h>
#include <ember/host.h>
#include <ember/plugin.h>
#include <ember/strategy.h>

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/nn/module.h>

#include <chrono>
#include <string>
#include <sys/types.h>
#include <vector>

#include "ember/distributed/launch.h"

namespace ember_dist {

class MpiBackend;

// For the plugins' descriptions (`engine plugins list`): which collective libraries this build has.
#ifdef EMBER_WITH_MPI
#define EMBER_DIST_BACKENDS "NCCL on GPUs, Open MPI on CPUs"
#else
#define EMBER_DIST_BACKENDS "NCCL on GPUs only: this build has no Open MPI, so no CPU ranks"
#endif

// The keys every multi-process strategy shares, for its EMBER_PLUGIN key table.
#define EMBER_DIST_CONFIG_KEYS                                                                                                   \
  ember::key::String("backend", "\"auto\"",                                                                                      \
                     "Collective library: auto (nccl on CUDA devices, mpi on CPU), mpi (Open MPI, CPU tensors) or nccl.")        \
      .choices("auto|mpi|nccl"),                                                                                                 \
      ember::key::Float("timeout", "300.0",                                                                                      \
                        "Seconds a collective or the start-up rendezvous may wait for the other ranks; then every rank stops "   \
                        "with an error naming the rank that failed.")                                                            \
          .above(0.0),                                                                                                           \
      ember::key::String("master_addr", "\"127.0.0.1\"",                                                                         \
                         "Address of rank 0's rendezvous store when no launcher set MASTER_ADDR (multi-node: an address of "     \
                         "node 0 every node can reach)."),                                                                       \
      ember::key::Int("master_port", "0",                                                                                        \
                      "Port of the rendezvous store when no launcher set MASTER_PORT; 0 picks a free port (single node only).")  \
          .at_least(0)                                                                                                           \
          .at_most(65535),                                                                                                       \
      ember::key::Int("node_rank", "-1",                                                                                         \
                      "This machine's index in a multi-node job that ember launches itself (trainer.num_nodes > 1); -1 reads "   \
                      "NODE_RANK (default 0).")                                                                                  \
          .at_least(-1)

// A process group over some of a communicator's ranks (one dimension of a device mesh): its own
// backend (none when it has one rank), this process's rank in it and its size.
struct Subgroup {
  c10::intrusive_ptr<c10d::Backend> backend;
  int rank = 0, size = 1;
};

class Communicator {
 public:
  // `name` is the strategy's ("ddp"): it prefixes every message. `cfg` holds EMBER_DIST_CONFIG_KEYS.
  Communicator(std::string name, ember::IHost& host, const ember::IConfig& cfg);
  ~Communicator();

  // IStrategy::launch: joins a launcher's rank environment, or starts trainer.devices local ranks
  // (returns false; *exit_code is the job's), or runs alone.
  bool launch(const ember::LaunchRequest& request, int* exit_code);

  const RankInfo& info() const { return info_; }
  int rank() const { return info_.rank; }
  int world() const { return info_.world; }
  const c10::Device& device() const { return device_; }
  c10d::Backend& backend() { return *backend_; }
  const c10::intrusive_ptr<c10d::Backend>& backend_ptr() const { return backend_; }

  // Names the next collective for the watchdog's error line ("gradient bucket 2").
  void label(std::string l);
  void broadcast_from_zero(const at::Tensor& t, const std::string& what);
  // Every rank takes rank 0's parameters and buffers (the start of every multi-process run).
  void broadcast_module_from_zero(torch::nn::Module& module);
  // Moves a batch to this rank's device (non-blocking from pinned memory).
  ember::Batch batch_to_device(ember::Batch batch) const;
  at::Tensor reduce(const at::Tensor& value, ember::ReduceOp op);
  // Coalesced, in place: every tensor of `tensors` (all on device()) takes rank 0's values, or the
  // reduction over the ranks (ReduceOp::mean averages), with one collective per dtype over the
  // tensors flattened into one buffer instead of one per tensor (PyTorch DDP's buckets). `what`
  // names the collective for the watchdog. Identity on one rank.
  void broadcast_coalesced(const std::vector<at::Tensor>& tensors, const std::string& what);
  void all_reduce_coalesced(const std::vector<at::Tensor>& tensors, ember::ReduceOp op, const std::string& what);
  void barrier(const char* name);
  bool broadcast_flag(bool value);
  // ember::ITensorBroadcast::broadcast: a header (dtype, shape, or why not) from src, then the
  // bytes, so any dense dtype goes through both backends and a bad tensor fails on every rank.
  at::Tensor broadcast(const at::Tensor& value, int64_t src);
  // The ranks that pass the same `color` form one group, in which this rank is `sub_rank` of
  // `sub_size` (the caller's layout; the same on every rank of the group). `name` tells the
  // groups apart in the rendezvous store. Collective over all ranks.
  Subgroup split(int color, int sub_rank, int sub_size, const std::string& name);
  // Ends the group (idempotent). `stats` is logged first when not empty.
  void teardown(const std::string& stats = "");

 private:
  bool launch_local(const ember::LaunchRequest& request, int* exit_code);
  void choose_device(const std::string& accelerator);
  void connect();
  std::string describe_failure(const std::string& what);

  std::string name_;
  ember::IHost& host_;
  std::string backend_choice_, backend_name_;
  std::chrono::milliseconds timeout_;
  std::string master_addr_;
  int master_port_;
  int node_rank_;
  std::string where_port_, where_backend_;
  RankInfo info_;
  c10::Device device_{c10::kCPU};
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  MpiBackend* mpi_ = nullptr;
  bool uses_mpi_ = false, torn_down_ = false;
  pid_t ompi_server_ = -1;
};

c10d::ReduceOp to_c10d(ember::ReduceOp op);

// PyTorch DDP's broadcast_buffers: before every forward in training mode every rank takes rank 0's
// buffers (batch-norm statistics), and once more before the first forward after one in eval mode
// (a training forward moved each rank's statistics with its own batch), so evaluation, swa's
// batch-norm pass and checkpoints see the same statistics on every rank.
// The engine's optimizer step with the precision handler's non-finite vote reduced over every rank
// of `comm`, for a strategy whose ranks hold different gradients (shards, tensor-parallel slices,
// pipeline stages): a loss scaler then skips a step on all ranks or none.
class VotingStep final : public ember::IOptimizerStep {
 public:
  VotingStep(ember::IOptimizerStep& inner, Communicator& comm) : inner_(inner), comm_(comm) {}
  at::Tensor closure() override { return inner_.closure(); }
  void before_step() override { inner_.before_step(); }
  void step() override { inner_.step(); }
  torch::optim::Optimizer& optimizer() override { return inner_.optimizer(); }
  at::Tensor found_inf_on_any_rank(const at::Tensor& found_inf) override;

 private:
  ember::IOptimizerStep& inner_;
  Communicator& comm_;
};

class BufferBroadcast {
 public:
  explicit BufferBroadcast(bool enabled) : enabled_(enabled) {}
  bool enabled() const { return enabled_; }
  void before_forward(torch::nn::Module& module, Communicator& comm);

 private:
  bool enabled_;
  bool dirty_ = false;
};

}  // namespace ember_dist
