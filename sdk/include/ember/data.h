// ember::IDataModule: a data set with train/val/test splits (Lightning's LightningDataModule).
// Implemented by data plugins. The engine owns sampling, batching, shuffling, drop_last,
// distributed sharding and worker threads; a data module only answers "give me these samples".
#pragma once
#include <cstdint>

#include <c10/core/Device.h>

#include "ember/types.h"

namespace ember {

struct DataSetup {
  uint32_t struct_size = sizeof(DataSetup);  // ember::has_field (ember/types.h)
  uint64_t seed = 0;         // trainer.seed: use it for any random split
  int64_t rank = 0;          // this process's global rank and the world size, for data modules
  int64_t world_size = 1;    // that want to download/prepare on one rank only
};

class EMBER_SDK_API IDataModule : public IPluginObject {
 public:
  // Loads or builds the data. Called once, before any other call. Throws ember::RunError with the
  // path and the fix when files are missing.
  virtual void setup(const DataSetup& setup) = 0;
  // Number of samples in a split; 0 when the split does not exist.
  virtual int64_t size(Split split) const = 0;
  // Collates the samples at `indices` (each in [0, size(split))) into one batch on the CPU.
  // Must be safe to call from several threads at once (the engine's loader workers).
  virtual Batch get_batch(Split split, const int64_t* indices, int64_t count) const = 0;
};

// Extension interface (query_interface(kDeviceDataIid)) for a data module that can keep its
// samples on the training device, so that get_batch gathers a batch there and nothing crosses the
// bus during training (data.on_device). Augmentation a module applies in get_batch then runs on
// that device too. The engine calls move_to once, after setup() and before any get_batch.
inline constexpr const char* kDeviceDataIid = "ember.IDeviceData/1";
class EMBER_SDK_API IDeviceData {
 public:
  virtual ~IDeviceData() = default;
  // Bytes move_to would place on the device (all splits).
  virtual int64_t device_bytes() const = 0;
  // Moves the samples to `device`; get_batch then returns tensors on it.
  virtual void move_to(const c10::Device& device) = 0;
};

}  // namespace ember
