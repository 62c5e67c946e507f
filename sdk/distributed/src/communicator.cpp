#include "ember/distributed/communicator.h"

#include <ember/error.h>

#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <thread>

#include "flattened.h"

#ifdef EMBER_WITH_MPI
#include "mpi_backend.h"
#endif

namespace ember_dist {

// nccl.cpp: ProcessGroupNCCL, or an error when this build has no NCCL.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout, c10::Device device);

c10d::ReduceOp to_c10d(ember::ReduceOp op) {
  switch (op) {
    case ember::ReduceOp::sum: return c10d::ReduceOp::SUM;
    case ember::ReduceOp::mean: return c10d::ReduceOp::AVG;
    case ember::ReduceOp::max: return c10d::ReduceOp::MAX;
    case ember::ReduceOp::min: return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

Communicator::Communicator(std::string name, ember::IHost& host, const ember::IConfig& cfg)
    : name_(std::move(name)),
      host_(host),
      backend_choice_(cfg.get_string("backend")),
      timeout_(std::chrono::milliseconds(static_cast<int64_t>(cfg.get_float("timeout") * 1000.0))),
      master_addr_(cfg.get_string("master_addr")),
      master_port_(static_cast<int>(cfg.get_int("master_port"))),
      node_rank_(static_cast<int>(cfg.get_int("node_rank"))),
      where_port_(cfg.where("master_port")),
      where_backend_(cfg.where("backend")) {
  set_strategy_name(name_);
}

Communicator::~Communicator() { teardown(); }

bool Communicator::launch(const ember::LaunchRequest& request, int* exit_code) {
  const int64_t expected = request.devices * request.num_nodes;
  std::optional<RankInfo> env;
  try {
    env = rank_from_environment();
  } catch (const std::exception& e) {
    throw ember::RunError(e.what());
  }
  if (request.num_nodes == 0) {
    // trainer.num_nodes = 0: an elastic job; the launcher that started this rank says how many
    // there are (and may say another number after a restart). Only the ranks per node are fixed.
    if (!env)
      throw ember::ConfigError(name_ + ": trainer.num_nodes = 0 takes the number of nodes from the launcher that started the ranks "
                               "(torchrun --nnodes=MIN:MAX, mpirun, SLURM), and none did; start it with one, or set trainer.num_nodes");
    if (env->local_world != request.devices)
      throw ember::ConfigError(name_ + ": " + env->source + " started " + std::to_string(env->local_world) +
                               " ranks on this node, but trainer.devices = " + std::to_string(request.devices) +
                               "; set trainer.devices to the ranks per node (--nproc-per-node)");
  } else if (env && env->world != expected) {
    throw ember::ConfigError(name_ + ": " + env->source + " started " + std::to_string(env->world) +
                             " ranks, but trainer.devices x trainer.num_nodes = " + std::to_string(request.devices) + " x " +
                             std::to_string(request.num_nodes) + " = " + std::to_string(expected) +
                             "; set trainer.devices to the ranks per node and trainer.num_nodes to the nodes (or 0 for an elastic job)");
  }
  if (env) {
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
  host_.log(ember::LogLevel::info, name_ + ": rank " + std::to_string(info_.rank) + " of " + std::to_string(info_.world) + " (" +
                                       info_.source + ", local rank " + std::to_string(info_.local_rank) + ") on " + device_.str() +
                                       " with " + (backend_ ? backend_->getBackendName() : std::string("no collectives (one rank)")));
  return true;
}

bool Communicator::launch_local(const ember::LaunchRequest& request, int* exit_code) {
  LocalLaunch l;
  l.argv = request.argv;
  l.nprocs = static_cast<int>(request.devices);
  l.world = static_cast<int>(request.devices * request.num_nodes);
  l.timeout = timeout_;
  l.master_addr = master_addr_;
  if (node_rank_ >= 0) {
    l.node_rank = node_rank_;
  } else if (const char* n = std::getenv("NODE_RANK"); n && *n) {
    try {
      l.node_rank = std::stoi(n);
    } catch (const std::exception&) {
      throw ember::ConfigError(name_ + ": NODE_RANK = '" + n + "' is not a number");
    }
  }
  if (l.node_rank < 0 || l.node_rank >= request.num_nodes)
    throw ember::ConfigError(name_ + ": node rank " + std::to_string(l.node_rank) + " is outside 0.." + std::to_string(request.num_nodes - 1) +
                             " (trainer.num_nodes = " + std::to_string(request.num_nodes) + "); set " + name_ +
                             ".node_rank or NODE_RANK on each node");
  if (request.num_nodes > 1 && master_port_ == 0)
    throw ember::ConfigError(where_port_ + ": " + name_ + ".master_port = 0 picks a port on this machine only; a job of trainer.num_nodes = " +
                             std::to_string(request.num_nodes) + " needs the same fixed port on every node (e.g. 29500) and " + name_ +
                             ".master_addr = node 0's address");
  const int64_t restarts = ember::has_field(request, &ember::LaunchRequest::max_restarts) ? request.max_restarts : 0;
  if (restarts > 0 && request.num_nodes > 1)
    throw ember::ConfigError("trainer.max_restarts = " + std::to_string(restarts) + " restarts the ranks of one node; a job of trainer.num_nodes = " +
                             std::to_string(request.num_nodes) +
                             " restarts as a whole under torchrun --max-restarts or a SLURM requeue (both resume by themselves): set "
                             "max_restarts = 0 here");
  bool joined_again = false;
  for (int attempt = 0;; ++attempt) {
    l.restart_count = attempt;
    // A fixed port: rank 0 hosts the store. Otherwise this launcher does, a fresh one for every
    // attempt, on a port held from the moment it is picked until the ranks end.
    ember_dist::LauncherStore store;
    if (master_port_ == 0) store = ember_dist::host_launcher_store(l.master_addr, timeout_);
    l.launcher_store = static_cast<bool>(store.store);
    l.master_port = l.launcher_store ? store.port : master_port_;
    host_.log(ember::LogLevel::info, name_ + ": starting " + std::to_string(l.nprocs) + " local ranks (node " + std::to_string(l.node_rank) +
                                         " of " + std::to_string(request.num_nodes) + ", rendezvous " + l.master_addr + ":" +
                                         std::to_string(l.master_port) + ")" +
                                         (attempt > 0 ? ", restart " + std::to_string(attempt) + " of " + std::to_string(restarts) : ""));
    bool interrupted = false;
    *exit_code = run_local_ranks(l, &interrupted);
    if (*exit_code == ember_dist::kJoinStalledExit && !interrupted && !joined_again) {
      // Nothing was trained: the same attempt once more, not counted against max_restarts.
      joined_again = true;
      host_.log(ember::LogLevel::warn, name_ + " launcher: the ranks did not form their MPI group within the timeout (nothing was "
                                           "trained; Open MPI's rendezvous through ompi-server stalls on rare occasions): starting them again, once");
      --attempt;
      continue;
    }
    // A configuration error (exit 2) fails the same way every time; a signal is a stop, not a failure.
    if (*exit_code == 0 || *exit_code == 2 || interrupted || attempt >= restarts) break;
    host_.log(ember::LogLevel::warn, name_ + " launcher: restarting the job (" + std::to_string(attempt + 1) + " of trainer.max_restarts = " +
                                         std::to_string(restarts) + "); its ranks resume from the last checkpoint");
  }
  return false;
}

void Communicator::choose_device(const std::string& accelerator) {
  const bool cuda = torch::cuda::is_available();
  const bool want_cuda = accelerator == "cuda" || (accelerator == "auto" && cuda && backend_choice_ != "mpi");
  if (want_cuda) {
    if (!cuda)
      throw ember::RunError(name_ + ": trainer.accelerator = cuda but no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES, or set trainer.accelerator = \"cpu\")");
    const auto count = static_cast<int>(torch::cuda::device_count());
    if (info_.local_rank >= count)
      throw ember::RunError(name_ + ": local rank " + std::to_string(info_.local_rank) + " has no GPU: " + std::to_string(count) +
                            " CUDA device(s) are visible; start at most one rank per GPU per node");
    device_ = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(info_.local_rank));
  } else {
    device_ = c10::Device(c10::kCPU);
  }
  backend_name_ = backend_choice_ == "auto" ? (device_.is_cuda() ? "nccl" : "mpi") : backend_choice_;
  if (backend_name_ == "nccl" && !device_.is_cuda())
    throw ember::ConfigError(where_backend_ + ": " + name_ + ".backend = \"nccl\" needs CUDA devices, but this rank trains on the CPU (use backend = \"mpi\" or \"auto\")");
#ifndef EMBER_WITH_MPI
  // One CPU rank needs no collective library: it runs alone (offload on one host, say).
  if (backend_name_ == "mpi" && info_.world == 1) {
    backend_name_ = "none";
    return;
  }
  if (backend_name_ == "mpi") {
    const std::string why = name_ + ": this build has no Open MPI, so ranks on the CPU cannot communicate (install libopenmpi-dev and openmpi-bin, "
                                    "then rebuild; or train on CUDA devices, which use NCCL)";
    if (backend_choice_ == "mpi") throw ember::ConfigError(where_backend_ + ": " + why);
    throw ember::RunError(why);
  }
#endif
  if (backend_name_ == "mpi" && device_.is_cuda())
    throw ember::ConfigError(where_backend_ + ": " + name_ + ".backend = \"mpi\" reduces CPU tensors only, but this rank trains on " +
                             device_.str() + " (use backend = \"nccl\", or trainer.accelerator = \"cpu\")");
}

void Communicator::connect() {
  try {
    const bool need_store = backend_name_ == "nccl" ? info_.world > 1 : (!info_.mpi_wired && info_.world > 1);
    if (need_store) store_ = make_store(info_, timeout_);
    if (backend_name_ == "none") return;  // a single rank without a collective library
    if (backend_name_ == "nccl") {
      if (!store_) store_ = c10::make_intrusive<c10d::HashStore>();
      backend_ = make_nccl_backend(store_, info_.rank, info_.world, timeout_, device_);
    } else {
#ifdef EMBER_WITH_MPI
      uses_mpi_ = true;
      MPI_Comm comm = join_mpi(info_, store_.get(), timeout_, &ompi_server_);
      auto mpi = c10::make_intrusive<MpiBackend>(comm, timeout_, [this](const std::string& what) { return describe_failure(what); });
      mpi_ = mpi.get();
      backend_ = mpi;
#endif
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

void Communicator::label(std::string l) {
#ifdef EMBER_WITH_MPI
  if (mpi_) mpi_->set_next_label(std::move(l));
#else
  (void)l;
#endif
}

void Communicator::broadcast_from_zero(const at::Tensor& t, const std::string& what) {
  if (info_.world == 1) return;
  std::vector<at::Tensor> v{t.detach()};
  c10d::BroadcastOptions opts;
  opts.rootRank = 0;
  label(what);
  backend_->broadcast(v, opts)->wait();
}

void Communicator::broadcast_module_from_zero(torch::nn::Module& module) {
  at::NoGradGuard no_grad;
  int i = 0;
  for (auto& t : module.parameters()) broadcast_from_zero(t, "initial parameter " + std::to_string(i++));
  i = 0;
  for (auto& t : module.buffers()) broadcast_from_zero(t, "initial buffer " + std::to_string(i++));
}

ember::Batch Communicator::batch_to_device(ember::Batch batch) const {
  if (device_.is_cpu()) return batch;
  for (auto& t : batch.tensors)
    if (t.defined()) t = t.to(device_, /*non_blocking=*/t.is_pinned());
  return batch;
}

at::Tensor Communicator::reduce(const at::Tensor& value, ember::ReduceOp op) {
  if (info_.world == 1) return value;
  at::Tensor t = value.detach().to(device_, /*non_blocking=*/false, /*copy=*/true).contiguous();
  std::vector<at::Tensor> v{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op);
  label("metric reduction");
  backend_->allreduce(v, opts)->wait();
  return t.to(value.device());
}


void Communicator::broadcast_coalesced(const std::vector<at::Tensor>& tensors, const std::string& what) {
  if (info_.world == 1 || tensors.empty()) return;
  for_each_dtype_flattened(tensors, [&](at::Tensor& flat, at::ScalarType dtype) {
    broadcast_from_zero(flat, what + " (" + c10::toString(dtype) + ")");
  });
}

void Communicator::all_reduce_coalesced(const std::vector<at::Tensor>& tensors, ember::ReduceOp op, const std::string& what) {
  if (info_.world == 1 || tensors.empty()) return;
  for_each_dtype_flattened(tensors, [&](at::Tensor& flat, at::ScalarType dtype) {
    std::vector<at::Tensor> v{flat};
    c10d::AllreduceOptions opts;
    opts.reduceOp = to_c10d(op);
    label(what + " (" + c10::toString(dtype) + ")");
    backend_->allreduce(v, opts)->wait();
  });
}

void Communicator::barrier(const char* name) {
  if (!backend_) return;
  label(std::string("barrier '") + name + "'");
  std::vector<at::Tensor> v{at::zeros({1}, at::TensorOptions().device(device_))};
  backend_->allreduce(v)->wait();
}

bool Communicator::broadcast_flag(bool value) {
  if (info_.world == 1) return value;
  std::vector<at::Tensor> v{at::full({1}, value ? 1 : 0, at::TensorOptions().dtype(at::kInt).device(device_))};
  c10d::BroadcastOptions opts;
  opts.rootRank = 0;
  label("flag broadcast");
  backend_->broadcast(v, opts)->wait();
  return v[0].item<int>() != 0;
}

at::Tensor Communicator::broadcast(const at::Tensor& value, int64_t src) {
  if (src < 0 || src >= info_.world)
    throw ember::RunError(name_ + ": broadcast from rank " + std::to_string(src) + ": there are ranks 0.." + std::to_string(info_.world - 1));
  const c10::Device out = value.defined() ? value.device() : device_;
  if (info_.world == 1) return value;
  // Header: [problem, dtype, ndim, sizes...]. Every rank reads the problem, so none waits for
  // bytes src will not send.
  constexpr int64_t kMaxDims = 16;
  enum Problem : int64_t { kNone = 0, kUndefined, kNotDense, kTooManyDims };
  at::Tensor header = at::zeros({3 + kMaxDims}, at::kLong);
  if (info_.rank == src) {
    auto* h = header.data_ptr<int64_t>();
    if (!value.defined()) h[0] = kUndefined;
    else if (value.layout() != at::kStrided || value.is_quantized()) h[0] = kNotDense;
    else if (value.dim() > kMaxDims) h[0] = kTooManyDims;
    else {
      h[1] = static_cast<int64_t>(value.scalar_type());
      h[2] = value.dim();
      for (int64_t d = 0; d < value.dim(); ++d) h[3 + d] = value.size(d);
    }
  }
  std::vector<at::Tensor> v{header.to(device_)};
  c10d::BroadcastOptions opts;
  opts.rootRank = src;
  label("tensor broadcast header");
  backend_->broadcast(v, opts)->wait();
  header = v.front().cpu();
  const auto* h = header.data_ptr<int64_t>();
  const std::string from = name_ + ": broadcast from rank " + std::to_string(src) + ": ";
  if (h[0] == kUndefined) throw ember::RunError(from + "its tensor is undefined");
  if (h[0] == kNotDense)
    throw ember::RunError(from + "its tensor is sparse or quantized; only dense tensors can be broadcast (call .to_dense() first)");
  if (h[0] == kTooManyDims) throw ember::RunError(from + "its tensor has more than 16 dimensions (reshape it first)");
  const auto dtype = static_cast<at::ScalarType>(h[1]);
  std::vector<int64_t> sizes(h + 3, h + 3 + h[2]);
  at::Tensor data = info_.rank == src ? value.detach().to(device_, /*non_blocking=*/false, /*copy=*/true).contiguous()
                                      : at::empty(sizes, at::TensorOptions().dtype(dtype).device(device_));
  if (data.numel() > 0) {
    // As bytes: every dtype (bool, bf16, complex, ...) travels through NCCL and Open MPI alike.
    std::vector<at::Tensor> bytes{data.reshape({-1}).view(at::kByte)};
    label("tensor broadcast");
    backend_->broadcast(bytes, opts)->wait();
  }
  return data.to(out);
}

Subgroup Communicator::split(int color, int sub_rank, int sub_size, const std::string& name) {
  Subgroup group;
  group.rank = sub_rank;
  group.size = sub_size;
  if (info_.world == 1) return group;
#ifdef EMBER_WITH_MPI
  // MPI_Comm_split is collective over every rank, also those whose group has one rank.
  if (mpi_) {
    auto child = mpi_->split(color, sub_rank);
    if (child->getSize() != sub_size || child->getRank() != sub_rank)
      throw ember::RunError(name_ + ": device mesh group '" + name + "' has " + std::to_string(child->getSize()) + " ranks, expected " +
                            std::to_string(sub_size) + " (an Ember bug)");
    if (sub_size > 1) group.backend = child;
    else child->shutdown();
    return group;
  }
#endif
  if (sub_size == 1) return group;
  auto store = c10::make_intrusive<c10d::PrefixStore>("mesh/" + name + "/" + std::to_string(color), store_);
  group.backend = make_nccl_backend(store, sub_rank, sub_size, timeout_, device_);
  return group;
}

void Communicator::teardown(const std::string& stats) {
  if (torn_down_ || !backend_) return;
  torn_down_ = true;
  if (!stats.empty()) host_.log(ember::LogLevel::info, stats);
  backend_->shutdown();
  backend_.reset();
  mpi_ = nullptr;
#ifdef EMBER_WITH_MPI
  if (uses_mpi_) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
#endif
  if (ompi_server_ > 0) {
    kill(ompi_server_, SIGTERM);
    waitpid(ompi_server_, nullptr, 0);
    ompi_server_ = -1;
  }
}

at::Tensor VotingStep::found_inf_on_any_rank(const at::Tensor& found_inf) {
  if (comm_.world() == 1) return inner_.found_inf_on_any_rank(found_inf);
  comm_.label("non-finite gradient vote");
  std::vector<at::Tensor> v{found_inf.to(comm_.device(), at::kFloat).reshape({1}).clone()};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::MAX;
  comm_.backend().allreduce(v, opts)->wait();
  return inner_.found_inf_on_any_rank(v.front().reshape({}).to(found_inf.device(), found_inf.scalar_type()));
}

void BufferBroadcast::before_forward(torch::nn::Module& module, Communicator& comm) {
  if (!enabled_ || comm.world() == 1) return;
  const bool training = module.is_training();
  if (training || dirty_) {
    // One broadcast per dtype, not one per buffer: a network with batch norm has three buffers
    // per norm layer.
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> buffers;
    for (auto& b : module.buffers())
      if (b.defined() && b.numel() > 0) buffers.push_back(b);
    comm.broadcast_coalesced(buffers, "buffers");
  }
  dirty_ = training;
}

// Called by the watchdog when a collective hangs: names the ranks that never reached it, as far
// as the rendezvous store can tell.
std::string Communicator::describe_failure(const std::string& what) {
  const auto seconds = std::chrono::duration<double>(timeout_).count();
  std::string line = name_ + ": rank " + std::to_string(info_.rank) + ": " + what + " did not complete within " +
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

}  // namespace ember_dist
