// ember::engine::Accelerator: what the engine asks of a kind of device (Lightning's Accelerator),
// so that engine code has no `if (cuda)`: how many devices there are, seeds and RNG state per
// device, memory figures, whether batches can be copied ahead on a side stream. `cpu` and `cuda`
// are implemented; another device kind is one more class in accelerator.cpp, and the interface is
// the one an accelerator plugin kind will have (docs/engine.md).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ember::engine {

class Accelerator {
 public:
  virtual ~Accelerator() = default;
  // trainer.accelerator's word for it ("cpu", "cuda"); also its key in a checkpoint's `rng` table.
  virtual const char* name() const = 0;
  virtual c10::DeviceType device_type() const = 0;
  // Whether this process can use such a device now (driver present, devices visible).
  virtual bool is_available() const = 0;
  virtual int64_t device_count() const = 0;
  // Seeds every device's default generator (the CPU's is torch::manual_seed's).
  virtual void manual_seed_all(uint64_t seed) const = 0;
  // Every device's generator state, in device order; and back (states for devices this process
  // does not see are ignored, so a checkpoint resumes on fewer devices).
  virtual std::vector<at::Tensor> rng_states() const = 0;
  virtual void set_rng_states(const std::vector<at::Tensor>& states) const = 0;
  // Memory of `device` in bytes, and the peak its allocator handed out in this process; nullopt
  // where the device kind does not say (the CPU).
  virtual std::optional<int64_t> total_memory(const c10::Device& device) const = 0;
  virtual std::optional<int64_t> peak_allocated(const c10::Device& device) const = 0;
  // Whether host batches can be pinned and copied on a side stream while the step runs.
  virtual bool copies_ahead() const = 0;
};

// The accelerator of a device type; throws RunError for a type this build has none for.
const Accelerator& accelerator_for(c10::DeviceType type);
// Every accelerator this build knows, the CPU first.
const std::vector<const Accelerator*>& all_accelerators();

}  // namespace ember::engine
