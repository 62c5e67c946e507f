// libember.so, the engine as a library (find_package(Ember) -> Ember::ember): what every public
// header of the library shares. The library is built with hidden visibility; EMBER_API marks what
// it exports. Its headers live in <ember/...> next to the SDK's and never reuse an SDK header's name.
#pragma once

#define EMBER_API __attribute__((visibility("default")))

namespace ember {

// The version of libember.so the program runs with ("0.1.0"); compare with EMBER_LIBRARY_VERSION,
// the version the program was compiled against.
EMBER_API const char* library_version();

}  // namespace ember

#define EMBER_LIBRARY_VERSION "0.1.0"
