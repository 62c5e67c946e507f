#include "mpi_backend.h"

#include <ATen/ATen.h>

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <stdexcept>

namespace ember_dist {

void check_mpi(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  throw std::runtime_error(std::string(call) + " failed: " + std::string(text, static_cast<size_t>(len)) +
                           " (a peer rank probably died or lost its connection)");
}

namespace {

MPI_Datatype mpi_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kLong: return MPI_INT64_T;
    case at::kInt: return MPI_INT32_T;
    case at::kShort: return MPI_INT16_T;
    case at::kChar: return MPI_INT8_T;
    case at::kByte: return MPI_UINT8_T;
    case at::kBool: return MPI_C_BOOL;
    default: return MPI_DATATYPE_NULL;
  }
}

MPI_Op mpi_op(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::AVG: return MPI_SUM;
    case c10d::ReduceOp::PRODUCT: return MPI_PROD;
    case c10d::ReduceOp::MIN: return MPI_MIN;
    case c10d::ReduceOp::MAX: return MPI_MAX;
    case c10d::ReduceOp::BAND: return MPI_BAND;
    case c10d::ReduceOp::BOR: return MPI_BOR;
    case c10d::ReduceOp::BXOR: return MPI_BXOR;
    default: break;
  }
  throw std::invalid_argument("ember_mpi: unsupported reduce op");
}

void require_cpu(const std::vector<at::Tensor>& tensors, const char* what) {
  for (const auto& t : tensors)
    TORCH_CHECK(t.defined() && t.device().is_cpu(), "ember_mpi ", what,
                ": only CPU tensors are supported (use backend = \"nccl\" for CUDA tensors)");
}

// Runs `fn` on a contiguous tensor of an MPI type (a staging copy when `t` is not one) and
// writes the result back into `t`.
template <class F>
void with_mpi_buffer(at::Tensor& t, F&& fn) {
  const bool native = mpi_type(t.scalar_type()) != MPI_DATATYPE_NULL;
  if (native && t.is_contiguous()) {
    fn(t);
    return;
  }
  // Half and bfloat16 have no MPI type: reduce them in float32.
  at::Tensor staged = native ? t.contiguous() : t.to(at::kFloat).contiguous();
  fn(staged);
  t.copy_(staged);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
bool MpiWork::isCompleted() {
  std::lock_guard lock(mutex_);
  return done_;
}
bool MpiWork::isSuccess() const {
  std::lock_guard lock(mutex_);
  return done_ && !error_;
}
std::exception_ptr MpiWork::exception() const {
  std::lock_guard lock(mutex_);
  return error_;
}
bool MpiWork::wait(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  // The backend's watchdog bounds every collective; a caller's own timeout is honoured too.
  if (timeout == kNoTimeout) {
    cv_.wait(lock, [&] { return done_; });
  } else if (!cv_.wait_for(lock, timeout, [&] { return done_; })) {
    throw std::runtime_error("ember_mpi: wait timed out after " + std::to_string(timeout.count()) + " ms");
  }
  if (error_) std::rethrow_exception(error_);
  return true;
}
void MpiWork::finish(std::exception_ptr error) {
  // The communication thread lets go of the tensors while the caller still waits (and so holds
  // its own references): it never drops the last one of a tensor the caller has moved on from,
  // which is a free on this thread racing with the caller's use as ThreadSanitizer sees it.
  std::vector<at::Tensor> outputs;
  {
    std::lock_guard lock(mutex_);
    outputs.swap(outputs_);
  }
  outputs.clear();
  {
    std::lock_guard lock(mutex_);
    done_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

// ---------------------------------------------------------------------------------------------
MpiBackend::MpiBackend(MPI_Comm comm, std::chrono::milliseconds timeout,
                       std::function<std::string(const std::string&)> describe_failure)
    : c10d::Backend([&] { int r = 0; MPI_Comm_rank(comm, &r); return r; }(),
                    [&] { int s = 0; MPI_Comm_size(comm, &s); return s; }()),
      comm_(comm),
      timeout_(timeout),
      describe_failure_(std::move(describe_failure)) {
  // Errors come back as codes (and then exceptions naming the call) instead of aborting.
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  thread_ = std::thread([this] { run(); });
  watchdog_ = std::thread([this] { watch(); });
}

MpiBackend::MpiBackend(Child, MPI_Comm comm, int rank, int size, MpiBackend& executor)
    : c10d::Backend(rank, size),
      comm_(comm),
      executor_(&executor),
      executor_ref_(c10::intrusive_ptr<MpiBackend>::reclaim_copy(&executor)),
      timeout_(executor.timeout_) {}

c10::intrusive_ptr<MpiBackend> MpiBackend::split(int color, int key) {
  MPI_Comm out = MPI_COMM_NULL;
  int rank = 0, size = 0;
  enqueue(c10d::OpType::UNKNOWN, {}, " (device mesh split)", [&] {
    check_mpi(MPI_Comm_split(comm_, color, key, &out), "MPI_Comm_split");
    MPI_Comm_set_errhandler(out, MPI_ERRORS_RETURN);
    MPI_Comm_rank(out, &rank);
    MPI_Comm_size(out, &size);
  })->wait();
  return c10::make_intrusive<MpiBackend>(Child{}, out, rank, size, *executor_);
}

MpiBackend::~MpiBackend() { shutdown(); }

void MpiBackend::shutdown() {
  if (executor_ != this) {
    // A split backend: its communicator is freed on the shared thread, unless that has stopped
    // (MPI_Finalize then frees it).
    if (comm_ == MPI_COMM_NULL) return;
    MPI_Comm comm = comm_;
    comm_ = MPI_COMM_NULL;
    bool running = false;
    {
      std::lock_guard lock(executor_->mutex_);
      running = !executor_->stopping_;
    }
    if (running) {
      try {
        executor_->enqueue(c10d::OpType::UNKNOWN, {}, " (free a device mesh group)", [comm]() mutable { MPI_Comm_free(&comm); })->wait();
      } catch (const std::exception&) {
      }
    }
    executor_ref_.reset();
    return;
  }
  {
    std::lock_guard lock(mutex_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (watchdog_.joinable()) watchdog_.join();
  if (comm_ != MPI_COMM_NULL && comm_ != MPI_COMM_WORLD && comm_ != MPI_COMM_SELF) MPI_Comm_free(&comm_);
  comm_ = MPI_COMM_NULL;
}

c10::intrusive_ptr<c10d::Work> MpiBackend::enqueue(c10d::OpType type, std::vector<at::Tensor> outputs, std::string what,
                                                   std::function<void()> fn) {
  if (!next_label_.empty()) {
    what += " (" + next_label_ + ")";
    next_label_.clear();
  }
  if (executor_ != this) return executor_->enqueue(type, std::move(outputs), std::move(what), std::move(fn));
  auto work = c10::make_intrusive<MpiWork>(rank_, type, std::move(outputs));
  {
    std::lock_guard lock(mutex_);
    TORCH_CHECK(!stopping_, "ember_mpi: collective '", what, "' submitted after shutdown");
    what = c10d::opTypeToString(type) + " #" + std::to_string(++seq_) + what;
    queue_.push_back(Item{work, std::move(what), std::move(fn)});
  }
  cv_.notify_all();
  return work;
}

void MpiBackend::run() {
  for (;;) {
    Item item;
    {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      item = std::move(queue_.front());
      queue_.pop_front();
      running_ = item.what;
      running_since_ = std::chrono::steady_clock::now();
      busy_ = true;
    }
    std::exception_ptr error;
    try {
      item.fn();
    } catch (...) {
      error = std::current_exception();
    }
    item.fn = nullptr;  // the tensors it captured, released before the caller is woken (finish)
    {
      std::lock_guard lock(mutex_);
      busy_ = false;
    }
    item.work->finish(error);
  }
}

void MpiBackend::watch() {
  const auto tick = std::clamp(timeout_ / 20, std::chrono::milliseconds(10), std::chrono::milliseconds(200));
  std::unique_lock lock(mutex_);
  while (!stopping_ || busy_ || !queue_.empty()) {
    cv_.wait_for(lock, tick);
    if (busy_ && std::chrono::steady_clock::now() - running_since_ > timeout_) {
      const std::string what = running_;
      lock.unlock();
      std::string line = describe_failure_ ? describe_failure_(what) : "collective " + what + " timed out";
      std::fprintf(stderr, "%s\n", line.c_str());
      std::fflush(stderr);
      // The communication thread is stuck inside MPI: no clean shutdown is possible.
      std::_Exit(kPeerFailureExit);
    }
    if (stopping_ && !busy_ && queue_.empty()) break;
  }
}

c10::intrusive_ptr<c10d::Work> MpiBackend::broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) {
  require_cpu(tensors, "broadcast");
  const int root = static_cast<int>(opts.rootRank);
  return enqueue(c10d::OpType::BROADCAST, tensors, "", [this, tensors, root]() mutable {
    for (auto& t : tensors)
      with_mpi_buffer(t, [&](at::Tensor& b) {
        // Bytes: any dtype, no conversion.
        check_mpi(MPI_Bcast(b.data_ptr(), static_cast<int>(b.nbytes()), MPI_BYTE, root, comm_), "MPI_Bcast");
      });
  });
}

c10::intrusive_ptr<c10d::Work> MpiBackend::allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  require_cpu(tensors, "allreduce");
  const MPI_Op op = mpi_op(opts.reduceOp);
  const bool average = opts.reduceOp == c10d::ReduceOp::AVG;
  return enqueue(c10d::OpType::ALLREDUCE, tensors, "", [this, tensors, op, average]() mutable {
    for (auto& t : tensors) {
      with_mpi_buffer(t, [&](at::Tensor& b) {
        check_mpi(MPI_Allreduce(MPI_IN_PLACE, b.data_ptr(), static_cast<int>(b.numel()), mpi_type(b.scalar_type()), op, comm_),
                  "MPI_Allreduce");
      });
      if (average) t.div_(size_);
    }
  });
}

c10::intrusive_ptr<c10d::Work> MpiBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& /*opts*/) {
  require_cpu(inputs, "allgather");
  TORCH_CHECK(inputs.size() == 1 && outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_,
              "ember_mpi allgather: expects one input and world_size outputs");
  std::vector<at::Tensor> outs = outputs[0];
  require_cpu(outs, "allgather");
  at::Tensor in = inputs[0];
  return enqueue(c10d::OpType::ALLGATHER, outs, "", [this, in, outs]() mutable {
    at::Tensor src = in.contiguous();
    at::Tensor flat = at::empty({static_cast<int64_t>(size_) * src.numel()}, src.options());
    const int bytes = static_cast<int>(src.nbytes());
    check_mpi(MPI_Allgather(src.data_ptr(), bytes, MPI_BYTE, flat.data_ptr(), bytes, MPI_BYTE, comm_), "MPI_Allgather");
    for (int r = 0; r < size_; ++r) outs[static_cast<size_t>(r)].copy_(flat.narrow(0, r * src.numel(), src.numel()).view(src.sizes()));
  });
}

// all_gather_into_tensor: `output` holds world_size * input.numel() elements, rank r's input at
// offset r * input.numel(). Bytes are gathered, so any dtype works.
c10::intrusive_ptr<c10d::Work> MpiBackend::_allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& /*opts*/) {
  require_cpu({output, input}, "_allgather_base");
  TORCH_CHECK(output.numel() == input.numel() * size_ && output.scalar_type() == input.scalar_type() && output.is_contiguous(),
              "ember_mpi _allgather_base: the output must be a contiguous tensor of world_size x the input's elements and dtype");
  at::Tensor out = output, in = input;
  return enqueue(c10d::OpType::_ALLGATHER_BASE, {out}, "", [this, in, out]() mutable {
    at::Tensor src = in.contiguous();
    const int bytes = static_cast<int>(src.nbytes());
    check_mpi(MPI_Allgather(src.data_ptr(), bytes, MPI_BYTE, out.data_ptr(), bytes, MPI_BYTE, comm_), "MPI_Allgather");
  });
}

// reduce_scatter_tensor: rank r receives the reduction of every rank's input slice
// [r * output.numel(), (r + 1) * output.numel()). Half and bfloat16 reduce in float32.
c10::intrusive_ptr<c10d::Work> MpiBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                const c10d::ReduceScatterOptions& opts) {
  require_cpu({output, input}, "_reduce_scatter_base");
  TORCH_CHECK(input.numel() == output.numel() * size_ && output.scalar_type() == input.scalar_type(),
              "ember_mpi _reduce_scatter_base: the input must hold world_size x the output's elements, of the same dtype");
  const MPI_Op op = mpi_op(opts.reduceOp);
  const bool average = opts.reduceOp == c10d::ReduceOp::AVG;
  at::Tensor out = output, in = input;
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, {out}, "", [this, in, out, op, average]() mutable {
    const bool native = mpi_type(in.scalar_type()) != MPI_DATATYPE_NULL;
    at::Tensor src = native ? in.contiguous() : in.to(at::kFloat).contiguous();
    at::Tensor dst = native && out.is_contiguous() ? out : at::empty({out.numel()}, src.options());
    check_mpi(MPI_Reduce_scatter_block(src.data_ptr(), dst.data_ptr(), static_cast<int>(out.numel()), mpi_type(src.scalar_type()), op, comm_),
              "MPI_Reduce_scatter_block");
    if (!dst.is_same(out)) out.copy_(dst.view(out.sizes()));
    if (average) out.div_(size_);
  });
}

c10::intrusive_ptr<c10d::Work> MpiBackend::barrier(const c10d::BarrierOptions& /*opts*/) {
  return enqueue(c10d::OpType::BARRIER, {}, "", [this] { check_mpi(MPI_Barrier(comm_), "MPI_Barrier"); });
}

c10::intrusive_ptr<c10d::Work> MpiBackend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  require_cpu(tensors, "send");
  TORCH_CHECK(tensors.size() == 1, "ember_mpi send: one tensor at a time");
  at::Tensor t = tensors[0].contiguous();
  TORCH_CHECK(t.nbytes() <= static_cast<size_t>(std::numeric_limits<int>::max()), "ember_mpi send: a message over 2 GiB");
  return enqueue(c10d::OpType::SEND, {}, " to rank " + std::to_string(dst), [this, t, dst, tag] {
    MPI_Request request;
    check_mpi(MPI_Isend(t.data_ptr(), static_cast<int>(t.nbytes()), MPI_BYTE, dst, tag, comm_, &request), "MPI_Isend");
    executor_->send_requests_.push_back(request);
    executor_->send_buffers_.push_back(t);
    executor_->reap_sends(false);
  });
}

c10::intrusive_ptr<c10d::Work> MpiBackend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  require_cpu(tensors, "recv");
  TORCH_CHECK(tensors.size() == 1 && tensors[0].is_contiguous(), "ember_mpi recv: one contiguous tensor at a time");
  at::Tensor t = tensors[0];
  TORCH_CHECK(t.nbytes() <= static_cast<size_t>(std::numeric_limits<int>::max()), "ember_mpi recv: a message over 2 GiB");
  return enqueue(c10d::OpType::RECV, tensors, " from rank " + std::to_string(src), [this, t, src, tag]() mutable {
    MPI_Status status;
    check_mpi(MPI_Recv(t.data_ptr(), static_cast<int>(t.nbytes()), MPI_BYTE, src, tag, comm_, &status), "MPI_Recv");
    int got = 0;
    MPI_Get_count(&status, MPI_BYTE, &got);
    if (static_cast<size_t>(got) != t.nbytes())
      throw std::runtime_error("MPI_Recv: got " + std::to_string(got) + " bytes from rank " + std::to_string(src) + ", expected " +
                               std::to_string(t.nbytes()) + " (the ranks disagree on a pipeline message)");
    executor_->reap_sends(false);
  });
}

c10::intrusive_ptr<c10d::Work> MpiBackend::complete_sends() {
  return enqueue(c10d::OpType::UNKNOWN, {}, " (complete the posted sends)", [this] { executor_->reap_sends(true); });
}

void MpiBackend::reap_sends(bool all) {
  if (send_requests_.empty()) return;
  if (all) {
    check_mpi(MPI_Waitall(static_cast<int>(send_requests_.size()), send_requests_.data(), MPI_STATUSES_IGNORE), "MPI_Waitall");
    send_requests_.clear();
    send_buffers_.clear();
    return;
  }
  size_t kept = 0;
  for (size_t i = 0; i < send_requests_.size(); ++i) {
    int done = 0;
    check_mpi(MPI_Test(&send_requests_[i], &done, MPI_STATUS_IGNORE), "MPI_Test");
    if (done) continue;
    send_requests_[kept] = send_requests_[i];
    send_buffers_[kept] = std::move(send_buffers_[i]);
    ++kept;
  }
  send_requests_.resize(kept);
  send_buffers_.resize(kept);
}

}  // namespace ember_dist
