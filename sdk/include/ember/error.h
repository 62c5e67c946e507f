// Exceptions a plugin throws to report a problem the user can fix. The engine prints what() as
// one line and exits non-zero (2 for ConfigError, 1 for others).
#pragma once
#include <stdexcept>
#include <string>

#include "ember/export.h"

namespace ember {

// A bad setting: what() should name the key, where it was set (IConfig::where) and the fix.
class EMBER_SDK_API ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Something the run cannot do (missing file, unsupported device, diverged loss...).
class EMBER_SDK_API RunError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace ember
