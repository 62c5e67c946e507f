// ddp: multi-process data parallel on LibTorch's c10d. One rank per device; gradients are
// all-reduced in buckets while backward runs (grad_buckets.h); ranks come from the local
// launcher (trainer.devices = N), torchrun, mpirun or srun (launch.h). Collectives: NCCL on
// GPUs, Open MPI behind a c10d::Backend adapter on CPUs (mpi_backend.h, docs/decisions.md).
#include <ember/error.h>
#include <ember/grad_util.h>
#include <ember/plugin.h>
#include <ember/strategy.h>

#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "grad_buckets.h"
#include "launch.h"
#include "mpi_backend.h"

namespace ember_ddp {
// nccl.cpp: ProcessGroupNCCL, or an error when this build has no NCCL.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout, c10::Device device);
}  // namespace ember_ddp

namespace {

using namespace ember_ddp;

constexpr EmberConfigKey kKeys[] = {
    ember::key::String("backend", "\"auto\"",
                       "Collective library: auto (nccl on CUDA devices, mpi on CPU), mpi (Open MPI, CPU tensors) or nccl.")
        .choices("auto|mpi|nccl"),
    ember::key::Float("bucket_cap_mb", "25.0",
                      "Gradients are all-reduced in buckets of about this many megabytes, each starting as soon as its gradients are ready.")
        .above(0.0),
    ember::key::Float("timeout", "300.0",
                      "Seconds a collective or the start-up rendezvous may wait for the other ranks; then every rank stops with an error naming the rank that failed.")
        .above(0.0),
    ember::key::String("master_addr", "\"127.0.0.1\"",
                       "Address of rank 0's rendezvous store when no launcher set MASTER_ADDR (multi-node: an address of node 0 every node can reach)."),
    ember::key::Int("master_port", "0",
                    "Port of the rendezvous store when no launcher set MASTER_PORT; 0 picks a free port (single node only).")
        .at_least(0)
        .at_most(65535),
    ember::key::Int("node_rank", "-1",
                    "This machine's index in a multi-node job that ember launches itself (trainer.num_nodes > 1); -1 reads NODE_RANK (default 0).")
        .at_least(-1),
};


c10d::ReduceOp to_c10d(ember::ReduceOp op) {
  switch (op) {
    case ember::ReduceOp::sum: return c10d::ReduceOp::SUM;
    case ember::ReduceOp::mean: return c10d::ReduceOp::AVG;
    case ember::ReduceOp::max: return c10d::ReduceOp::MAX;
    case ember::ReduceOp::min: return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

class Ddp final : public ember::IStrategy {
 public:
  Ddp(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host),
        backend_choice_(cfg.get_string("backend")),
        bucket_cap_bytes_(static_cast<int64_t>(cfg.get_float("bucket_cap_mb") * 1024.0 * 1024.0)),
        timeout_(std::chrono::milliseconds(static_cast<int64_t>(cfg.get_float("timeout") * 1000.0))),
        master_addr_(cfg.get_string("master_addr")),
        master_port_(static_cast<int>(cfg.get_int("master_port"))),
        node_rank_(static_cast<int>(cfg.get_int("node_rank"))),
        where_port_(cfg.where("master_port")),
        where_backend_(cfg.where("backend")) {
    if (bucket_cap_bytes_ < 1) bucket_cap_bytes_ = 1;
  }

  ~Ddp() override { teardown(); }

  bool launch(const ember::LaunchRequest& request, int* exit_code) override {
    const int64_t expected = request.devices * request.num_nodes;
    std::optional<RankInfo> env;
    try {
      env = rank_from_environment();
    } catch (const std::exception& e) {
      throw ember::RunError(e.what());
    }
    if (env) {
      if (env->world != expected)
        throw ember::ConfigError("ddp: " + env->source + " started " + std::to_string(env->world) + " ranks, but trainer.devices x trainer.num_nodes = " +
                                 std::to_string(request.devices) + " x " + std::to_string(request.num_nodes) + " = " +
                                 std::to_string(expected) + "; set trainer.devices to the ranks per node and trainer.num_nodes to the nodes");
      info_ = *env;
      if (info_.master_addr.empty()) info_.master_addr = master_addr_;
      if (info_.master_port == 0) info_.master_port = master_port_;
    } else if (expected > 1) {
      return launch_local(request, exit_code);
    } else {
      info_.source = "single";
    }
    choose_device(request.accelerator);
    connect();
    host_.log(ember::LogLevel::info, "ddp: rank " + std::to_string(info_.rank) + " of " + std::to_string(info_.world) + " (" +
                                         info_.source + ", local rank " + std::to_string(info_.local_rank) + ") on " + device_.str() +
                                         " with " + backend_->getBackendName());
    return true;
  }

  c10::Device root_device() const override { return device_; }
  int64_t rank() const override { return info_.rank; }
  int64_t world_size() const override { return info_.world; }
  int64_t local_rank() const override { return info_.local_rank; }

  void setup(torch::nn::Module& module, std::shared_ptr<torch::optim::Optimizer>& /*optimizer*/) override {
    module.to(device_);
    // Every rank starts from rank 0's weights and buffers.
    {
      at::NoGradGuard no_grad;
      int i = 0;
      for (auto& t : module.parameters()) broadcast_from_zero(t, "initial parameter " + std::to_string(i++));
      i = 0;
      for (auto& t : module.buffers()) broadcast_from_zero(t, "initial buffer " + std::to_string(i++));
    }
    std::vector<at::Tensor> params;
    for (auto& p : module.parameters())
      if (p.requires_grad()) params.push_back(p);
    buckets_ = std::make_unique<GradBuckets>(params, bucket_cap_bytes_, backend_, static_cast<int>(info_.world),
                                             [this](std::string l) { label(std::move(l)); });
  }

  ember::Batch batch_to_device(ember::Batch batch) override {
    if (device_.is_cpu()) return batch;
    for (auto& t : batch.tensors)
      if (t.defined()) t = t.to(device_, /*non_blocking=*/t.is_pinned());
    return batch;
  }

  void backward(const at::Tensor& loss, ember::IPrecision& precision, bool sync_gradients) override {
    buckets_->begin(sync_gradients);
    try {
      precision.backward(loss);
    } catch (...) {
      buckets_->abandon();
      throw;
    }
    if (sync_gradients) buckets_->finish();
  }

  bool optimizer_step(ember::IOptimizerStep& step, ember::IPrecision& precision) override {
    return precision.optimizer_step(step);
  }

  // Gradients are identical on every rank after the sync, so local clipping agrees everywhere.
  void clip_gradients(torch::optim::Optimizer& optimizer, double max, ember::ClipAlgorithm algorithm) override {
    ember::clip_gradients_in_place(ember::grads_of(optimizer), max, algorithm);
  }

  at::Tensor reduce(const at::Tensor& value, ember::ReduceOp op) override {
    if (info_.world == 1) return value;
    at::Tensor t = value.detach().to(device_, /*non_blocking=*/false, /*copy=*/true).contiguous();
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions opts;
    opts.reduceOp = to_c10d(op);
    label("metric reduction");
    backend_->allreduce(v, opts)->wait();
    return t.to(value.device());
  }

  void barrier(const char* name) override {
    if (!backend_) return;
    label(std::string("barrier '") + name + "'");
    std::vector<at::Tensor> v{at::zeros({1}, at::TensorOptions().device(device_))};
    backend_->allreduce(v)->wait();
  }

  bool broadcast_flag(bool value) override {
    if (info_.world == 1) return value;
    std::vector<at::Tensor> v{at::full({1}, value ? 1 : 0, at::TensorOptions().dtype(at::kInt).device(device_))};
    c10d::BroadcastOptions opts;
    opts.rootRank = 0;
    label("flag broadcast");
    backend_->broadcast(v, opts)->wait();
    return v[0].item<int>() != 0;
  }

  void teardown() override {
    if (torn_down_ || !backend_) return;
    torn_down_ = true;
    if (buckets_) {
      const auto& s = buckets_->stats();
      host_.log(ember::LogLevel::info, "ddp: " + std::to_string(s.syncs) + " gradient syncs, " + std::to_string(s.all_reduces) +
                                           " bucket all-reduces in " + std::to_string(s.buckets) + " buckets, " +
                                           std::to_string(s.started_early) + " started while backward was still running");
    }
    backend_->shutdown();
    backend_.reset();
    if (uses_mpi_) {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized) MPI_Finalize();
    }
    if (ompi_server_ > 0) {
      kill(ompi_server_, SIGTERM);
      waitpid(ompi_server_, nullptr, 0);
      ompi_server_ = -1;
    }
  }

  // What a checkpoint records: the world size, so a resume on another number of ranks says that
  // the data order changes from there on.
  c10::IValue state_dict() const override {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert("world_size", info_.world);
    return d;
  }
  void load_state_dict(const c10::IValue& state) override {
    if (!state.isGenericDict()) return;
    auto d = state.toGenericDict();
    if (!d.contains("world_size")) return;
    saved_world_ = d.at("world_size").toInt();
    if (saved_world_ != info_.world)
      host_.log(ember::LogLevel::warn, "ddp: the checkpoint was written by " + std::to_string(saved_world_) + " ranks and is resumed on " +
                                           std::to_string(info_.world) + ": each rank's share of the data differs from here on");
  }
  int64_t saved_world_size() const { return saved_world_; }

 private:
  bool launch_local(const ember::LaunchRequest& request, int* exit_code) {
    LocalLaunch l;
    l.argv = request.argv;
    l.nprocs = static_cast<int>(request.devices);
    l.world = static_cast<int>(request.devices * request.num_nodes);
    l.timeout = timeout_;
    l.master_addr = master_addr_;
    if (node_rank_ >= 0) l.node_rank = node_rank_;
    else if (const char* n = std::getenv("NODE_RANK"); n && *n) {
      try {
        l.node_rank = std::stoi(n);
      } catch (const std::exception&) {
        throw ember::ConfigError(std::string("ddp: NODE_RANK = '") + n + "' is not a number");
      }
    }
    if (l.node_rank < 0 || l.node_rank >= request.num_nodes)
      throw ember::ConfigError("ddp: node rank " + std::to_string(l.node_rank) + " is outside 0.." + std::to_string(request.num_nodes - 1) +
                               " (trainer.num_nodes = " + std::to_string(request.num_nodes) + "); set ddp.node_rank or NODE_RANK on each node");
    if (request.num_nodes > 1 && master_port_ == 0)
      throw ember::ConfigError(where_port_ + ": ddp.master_port = 0 picks a port on this machine only; a job of trainer.num_nodes = " +
                               std::to_string(request.num_nodes) + " needs the same fixed port on every node (e.g. 29500) and ddp.master_addr = node 0's address");
    l.master_port = master_port_ != 0 ? master_port_ : free_port();
    host_.log(ember::LogLevel::info, "ddp: starting " + std::to_string(l.nprocs) + " local ranks (node " + std::to_string(l.node_rank) +
                                         " of " + std::to_string(request.num_nodes) + ", rendezvous " + l.master_addr + ":" +
                                         std::to_string(l.master_port) + ")");
    *exit_code = run_local_ranks(l);
    return false;
  }

  void choose_device(const std::string& accelerator) {
    const bool cuda = torch::cuda::is_available();
    const bool want_cuda = accelerator == "cuda" || (accelerator == "auto" && cuda && backend_choice_ != "mpi");
    if (want_cuda) {
      if (!cuda)
        throw ember::RunError("ddp: trainer.accelerator = cuda but no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES, or set trainer.accelerator = \"cpu\")");
      const auto count = static_cast<int>(torch::cuda::device_count());
      if (info_.local_rank >= count)
        throw ember::RunError("ddp: local rank " + std::to_string(info_.local_rank) + " has no GPU: " + std::to_string(count) +
                              " CUDA device(s) are visible; start at most one rank per GPU per node");
      device_ = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(info_.local_rank));
    } else {
      device_ = c10::Device(c10::kCPU);
    }
    backend_name_ = backend_choice_ == "auto" ? (device_.is_cuda() ? "nccl" : "mpi") : backend_choice_;
    if (backend_name_ == "nccl" && !device_.is_cuda())
      throw ember::ConfigError(where_backend_ + ": ddp.backend = \"nccl\" needs CUDA devices, but this rank trains on the CPU (use backend = \"mpi\" or \"auto\")");
    if (backend_name_ == "mpi" && device_.is_cuda())
      throw ember::ConfigError(where_backend_ + ": ddp.backend = \"mpi\" reduces CPU tensors only, but this rank trains on " + device_.str() +
                               " (use backend = \"nccl\", or trainer.accelerator = \"cpu\")");
  }

  void connect() {
    try {
      const bool need_store = backend_name_ == "nccl" ? info_.world > 1 : (!info_.mpi_wired && info_.world > 1);
      if (need_store) store_ = make_store(info_, timeout_);
      if (backend_name_ == "nccl") {
        if (!store_) store_ = c10::make_intrusive<c10d::HashStore>();
        backend_ = make_nccl_backend(store_, info_.rank, info_.world, timeout_, device_);
      } else {
        uses_mpi_ = true;
        MPI_Comm comm = join_mpi(info_, store_.get(), timeout_, &ompi_server_);
        auto mpi = c10::make_intrusive<MpiBackend>(comm, timeout_, [this](const std::string& what) { return describe_failure(what); });
        mpi_ = mpi.get();
        backend_ = mpi;
      }
    } catch (const ember::ConfigError&) {
      throw;
    } catch (const ember::RunError&) {
      throw;
    } catch (const std::exception& e) {
      std::string what = e.what();
      throw ember::RunError(what.substr(0, what.find('\n')));
    }
  }

  void label(std::string l) {
    if (mpi_) mpi_->set_next_label(std::move(l));
  }

  void broadcast_from_zero(at::Tensor& t, const std::string& what) {
    if (info_.world == 1) return;
    std::vector<at::Tensor> v{t.detach()};
    c10d::BroadcastOptions opts;
    opts.rootRank = 0;
    label(what);
    backend_->broadcast(v, opts)->wait();
  }

  // Called by the watchdog when a collective hangs: names the ranks that never reached it, as
  // far as the rendezvous store can tell.
  std::string describe_failure(const std::string& what) {
    const auto seconds = std::chrono::duration<double>(timeout_).count();
    std::string line = "ddp: rank " + std::to_string(info_.rank) + ": " + what + " did not complete within " +
                       std::to_string(static_cast<int64_t>(seconds)) + " s; ";
    std::string missing;
    if (store_) {
      try {
        const std::string me = "stuck/" + std::to_string(info_.rank);
        store_->set(me, std::vector<uint8_t>(what.begin(), what.end()));
        std::this_thread::sleep_for(std::min<std::chrono::milliseconds>(std::chrono::seconds(2), timeout_ / 2));
        for (int r = 0; r < info_.world; ++r)
          if (r != info_.rank && !store_->check({"stuck/" + std::to_string(r)}))
            missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      } catch (const std::exception&) {
        missing.clear();
      }
    }
    line += missing.empty() ? "another rank died or hangs" : "rank(s) " + missing + " never reached it (dead or hung)";
    return line + "; giving up";
  }

  ember::IHost& host_;
  std::string backend_choice_, backend_name_;
  int64_t bucket_cap_bytes_;
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
  std::unique_ptr<GradBuckets> buckets_;
  int64_t saved_world_ = -1;
};

ember::IStrategy* make(ember::IHost& host, const ember::IConfig& cfg) { return new Ddp(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::IStrategy, "ddp", "0.1.0", "Apache-2.0",
             "Multi-process data parallel: one rank per device, bucketed gradient all-reduce overlapping backward (NCCL on GPUs, Open MPI on CPUs).",
             EMBER_CONFIG_KEYS(kKeys), make)
