// Autocast for precision handlers. LibTorch 2.11 has autocast state functions but no C++ guard
// (Python's torch.autocast is written in Python), so this mirrors torch.autocast.__enter__ /
// __exit__: save the device type's state, enable it with the wanted dtype, count the nesting;
// on exit restore the state and drop the cast cache once the outermost region ends.
#pragma once
#include <ATen/autocast_mode.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace ember {

class AutocastRegion {
 public:
  AutocastRegion(c10::DeviceType device_type, c10::ScalarType dtype)
      : device_type_(device_type),
        was_enabled_(at::autocast::is_autocast_enabled(device_type)),
        old_dtype_(at::autocast::get_autocast_dtype(device_type)) {
    at::autocast::set_autocast_enabled(device_type_, true);
    at::autocast::set_autocast_dtype(device_type_, dtype);
    at::autocast::increment_nesting();
  }
  ~AutocastRegion() {
    // The cache holds casts of leaf tensors (weights) for this forward; once the outermost
    // region ends, the next forward must recast the updated weights.
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(device_type_, was_enabled_);
    at::autocast::set_autocast_dtype(device_type_, old_dtype_);
  }
  AutocastRegion(const AutocastRegion&) = delete;
  AutocastRegion& operator=(const AutocastRegion&) = delete;

 private:
  c10::DeviceType device_type_;
  bool was_enabled_;
  c10::ScalarType old_dtype_;
};

}  // namespace ember
