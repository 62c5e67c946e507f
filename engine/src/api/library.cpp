// libember.so's own translation unit: the rest of the library is ember_core, linked in whole.
#include <ember/library.h>

#include "common/version.h"

namespace ember {

const char* library_version() { return engine::kEmberVersion; }

}  // namespace ember
