// Extension interface for length-grouped batching (data.group_by_length = true): a data module
// whose samples differ in length (texts of different token counts) says how long each one is, so
// that the engine can put samples of similar length into the same batch and pad less. Optional,
// found through IPluginObject::query_interface; without it data.group_by_length is a config error.
#pragma once
#include <cstdint>

#include "ember/types.h"

namespace ember {

// IDataModule::query_interface(kSampleLengthsIid). Called after setup(), from the engine's thread.
inline constexpr const char* kSampleLengthsIid = "ember.ISampleLengths/1";
class EMBER_SDK_API ISampleLengths {
 public:
  virtual ~ISampleLengths() = default;
  // The length of sample `index` (in [0, size(split))) of `split`, in the unit that sets a
  // batch's padded size (tokens for text). Only the order of lengths matters.
  virtual int64_t sample_length(Split split, int64_t index) const = 0;
};

}  // namespace ember
