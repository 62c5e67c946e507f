// Peak CPU tensor memory of a piece of code: a CPU allocator that wraps LibTorch's and counts
// the bytes it hands out and gets back. Every CPU tensor LibTorch allocates while it is installed
// is counted exactly (activations, gradients, optimizer state), and nothing else: unlike the
// process's peak RSS (VmHWM), the count does not depend on glibc returning freed memory to the
// system, on other threads' stacks or on libraries loaded meanwhile, so a size that fits once
// fits again.
#pragma once
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>

namespace ember_batch_size {

class CountingCpuAllocator final : public c10::Allocator {
 public:
  // One object for the process: blocks it handed out may be freed long after it was removed.
  static CountingCpuAllocator& instance() {
    static CountingCpuAllocator* a = new CountingCpuAllocator();  // never destroyed, on purpose
    return *a;
  }

  c10::DataPtr allocate(size_t n) override {
    c10::Allocator* base = base_.load();
    c10::DataPtr inner = base->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    auto* block = new Block{std::move(inner), static_cast<int64_t>(n)};
    const int64_t now = current_.fetch_add(block->bytes) + block->bytes;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return c10::DataPtr(data, block, &CountingCpuAllocator::release, device);
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  // Installs the counter in front of the current CPU allocator; uninstall() puts that back.
  void install() {
    if (c10::GetCPUAllocator() != this) base_.store(c10::GetCPUAllocator());
    c10::SetCPUAllocator(this, kPriority);
  }
  void uninstall() { c10::SetCPUAllocator(base_.load(), kPriority); }

  int64_t current() const { return current_.load(); }
  // Starts a new peak window at the current level.
  void reset_peak() { peak_.store(current_.load()); }
  int64_t peak() const { return peak_.load(); }

 private:
  // Above any allocator a library may have set, so ours is the one used while installed.
  static constexpr uint8_t kPriority = 255;
  struct Block {
    c10::DataPtr inner;
    int64_t bytes;
  };
  static void release(void* ctx) {
    auto* block = static_cast<Block*>(ctx);
    instance().current_.fetch_sub(block->bytes);
    delete block;  // frees the memory through the wrapped allocator's own deleter
  }
  CountingCpuAllocator() : base_(c10::GetCPUAllocator()) {}

  std::atomic<c10::Allocator*> base_;
  std::atomic<int64_t> current_{0}, peak_{0};
};

// Installs the counter for a scope.
struct CountingScope {
  CountingScope() { CountingCpuAllocator::instance().install(); }
  ~CountingScope() { CountingCpuAllocator::instance().uninstall(); }
  CountingScope(const CountingScope&) = delete;
  CountingScope& operator=(const CountingScope&) = delete;
};

}  // namespace ember_batch_size
