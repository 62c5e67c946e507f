// libFuzzer entry point, built once per harness function (EMBER_FUZZ_ONE = config_one,
// checkpoint_one, model_file_one or data_file_one; tests/fuzz/CMakeLists.txt). A finding prints
// what was wrong and aborts, so libFuzzer saves the input as a crash file.
#include <ATen/Parallel.h>

#include <cstdio>
#include <cstdlib>

#include "data_file_inputs.h"
#include "fuzz_inputs.h"
#include "model_file_inputs.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  at::set_num_threads(1);  // one input at a time; no thread pool to start per input
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    ember::fuzz::EMBER_FUZZ_ONE(std::string_view(reinterpret_cast<const char*>(data), size));
  } catch (const ember::fuzz::Finding& f) {
    std::fprintf(stderr, "ember fuzz finding: %s\n", f.what());
    std::abort();
  }
  return 0;
}
