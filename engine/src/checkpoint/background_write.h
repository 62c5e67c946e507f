// Checkpoints written in the background (the checkpoint plugin's `async`, ITrainerAsyncCheckpoints):
// the state is copied to the host on the training thread (host_snapshot), then a BackgroundWrite
// serialises and writes it on its own thread while training goes on. The commit protocol (who
// waits, how ranks agree) is the Runtime's; this file knows only one thread and one copy.
#pragma once
#include <ATen/core/ivalue.h>

#include <atomic>
#include <functional>
#include <string>
#include <thread>

namespace ember::engine {

// A deep copy of `value` that shares no tensor storage with it: every tensor cloned onto the host
// (GPU tensors into pinned memory, so the copy out runs at full speed), containers rebuilt with
// their element types, immutable values (numbers, strings) shared. What the training thread may
// change in place after the call (parameters, optimizer moments, an EMA's shadow) is never seen
// by the writer.
c10::IValue host_snapshot(const c10::IValue& value);
c10::Dict<std::string, at::Tensor> host_snapshot(const c10::Dict<std::string, at::Tensor>& tensors);

// host_snapshot of a value the caller hands over (a strategy's sharded_state, which already copies
// its shards to the host): a host tensor that nothing but `value` references, in dictionaries only
// `value` references, storage and all, is taken as it is instead of copied again, since nothing
// else can change it. Adds the bytes taken to *taken_bytes.
c10::IValue take_host_snapshot(c10::IValue&& value, int64_t* taken_bytes);

// One write at a time on a thread of its own.
class BackgroundWrite {
 public:
  BackgroundWrite() = default;
  ~BackgroundWrite();  // waits for a write still running (never abandons a half-written file)
  BackgroundWrite(const BackgroundWrite&) = delete;
  BackgroundWrite& operator=(const BackgroundWrite&) = delete;

  // Requires !busy(). Runs `write` on a new thread; an exception it throws becomes error().
  void start(std::function<void()> write);
  // A write was started and not yet collected by wait().
  bool busy() const { return thread_.joinable(); }
  // Whether the write has ended (well or not); never blocks.
  bool done() const { return done_.load(std::memory_order_acquire); }
  // Blocks until the write has ended; returns "" or what failed, and makes busy() false.
  std::string wait();

 private:
  std::thread thread_;
  std::atomic<bool> done_{false};
  std::string error_;  // written by the thread before done_, read after join
};

}  // namespace ember::engine
