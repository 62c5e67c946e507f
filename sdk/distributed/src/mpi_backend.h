// A c10d::Backend over Open MPI, for CPU tensors. The PyPI LibTorch wheel ships neither Gloo's
// headers nor ProcessGroupMPI's implementation, so this thin adapter maps the c10d collectives
// Ember's strategies need onto MPI calls (docs/decisions.md says why MPI and not a collective library of our
// own). All MPI calls run, in submission order, on one communication thread, so collectives
// overlap with the caller (gradient buckets all-reduce while backward goes on). A watchdog
// turns a collective that does not finish within the timeout into a clear error and an exit.
#pragma once
#include <mpi.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "ember/distributed/launch.h"

namespace ember_dist {

class MpiWork final : public c10d::Work {
 public:
  MpiWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
      : c10d::Work(rank, type), outputs_(std::move(outputs)) {}
  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  // Empty once finished: the tensors are the caller's (see finish()).
  std::vector<at::Tensor> result() override { return outputs_; }
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void finish(std::exception_ptr error);

 private:
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  std::vector<at::Tensor> outputs_;
};

class MpiBackend final : public c10d::Backend {
 public:
  // Takes `comm` (an intra-communicator this process owns from now on); MPI must be initialized.
  // `describe_failure` is called by the watchdog with the stuck operation's description; it
  // returns the line to print (it may name the missing ranks), after which the process exits.
  MpiBackend(MPI_Comm comm, std::chrono::milliseconds timeout,
             std::function<std::string(const std::string&)> describe_failure);
  ~MpiBackend() override;

  const std::string getBackendName() const override { return "ember_mpi"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts = {}) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = {}) override;
  // Point to point (pipeline stages), one tensor each. A send is posted (MPI_Isend) and its Work
  // completes at once: the backend keeps the tensor until MPI is done with it, so a send never
  // waits for its receiver and no order of sends and receives between two ranks can deadlock
  // (any schedule whose receives are all eventually sent completes). A receive waits for its
  // message (MPI_Recv, under the watchdog). `tag` tells messages between the same ranks apart.
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  // Waits until every send posted so far has been delivered (the end of a pipeline window).
  c10::intrusive_ptr<c10d::Work> complete_sends();

  // A backend over the ranks of this one that pass the same `color` (ordered by `key`): a device
  // mesh's dimension. It shares this backend's communication thread and watchdog, so MPI is
  // still called from one thread at a time (MPI_THREAD_SERIALIZED). Collective over this
  // backend's ranks. Shut the result down before this one.
  c10::intrusive_ptr<MpiBackend> split(int color, int key);
  // What split() builds: a backend over `comm` that runs its calls on `executor`'s thread.
  struct Child {};
  MpiBackend(Child, MPI_Comm comm, int rank, int size, MpiBackend& executor);

  // A label for the next collective this thread submits ("gradient bucket 2"), for error lines.
  void set_next_label(std::string label) { next_label_ = std::move(label); }
  // Stops the communication thread after the queued work; MPI_Finalize is the caller's job.
  void shutdown() override;

 private:
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, std::vector<at::Tensor> outputs, std::string what,
                                         std::function<void()> fn);
  void run();
  void watch();
  // On the communication thread: frees the sends MPI has finished (all of them when `all`).
  void reap_sends(bool all);

  struct Item {
    c10::intrusive_ptr<MpiWork> work;
    std::string what;
    std::function<void()> fn;
  };
  MPI_Comm comm_;
  MpiBackend* executor_ = this;  // whose thread runs this backend's MPI calls
  c10::intrusive_ptr<MpiBackend> executor_ref_;  // keeps a parent alive for a split backend
  std::chrono::milliseconds timeout_;
  std::function<std::string(const std::string&)> describe_failure_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stopping_ = false;
  uint64_t seq_ = 0;
  // What the communication thread runs now and since when (guarded by mutex_).
  std::string running_;
  std::chrono::steady_clock::time_point running_since_;
  bool busy_ = false;
  std::string next_label_;
  // Posted sends and the tensors they read (the executor's, touched on its thread only).
  std::vector<MPI_Request> send_requests_;
  std::vector<at::Tensor> send_buffers_;
  std::thread thread_, watchdog_;
};

// "MPI_Allreduce: <MPI's own error text>" for a failed MPI call; throws std::runtime_error.
void check_mpi(int code, const char* call);

// Initializes MPI and returns this job's communicator, with ranks as in `info`: MPI_COMM_WORLD
// when a runtime wired it, otherwise the ranks join one by one through MPI_Comm_accept/connect,
// with an ompi-server (started by rank 0) as the runtime they share and the port name passed
// through `store`. `*server` gets the ompi-server's pid on rank 0 (else -1).
MPI_Comm join_mpi(const RankInfo& info, c10d::Store* store, std::chrono::milliseconds timeout, pid_t* server);

}  // namespace ember_dist
