// A plugin built against SDK 1.4 (tests/sdk1/ember_abi_1_4.h, the released 1.x descriptor): what a
// user's plugin from before Ember 2.0 looks like to the loader. The engine must refuse it in one
// line naming both versions, before it reads anything past the four fixed fields.
#include "../sdk1/ember_abi_1_4.h"

namespace {
int create(void*, const void*, void**, char*, size_t) { return 1; }
void destroy(void*) {}
}  // namespace

extern "C" __attribute__((visibility("default"))) const EmberPluginDescriptor* ember_plugin_descriptor(void) {
  static const EmberPluginDescriptor descriptor = {
      sizeof(EmberPluginDescriptor), EMBER_PLUGIN_MAGIC, EMBER_SDK_ABI_MAJOR, EMBER_SDK_ABI_MINOR,
      // LibTorch 2.11.0, the C++11 ABI, a CPU build, GCC 14's libstdc++: as 1.4 laid it out.
      EmberBuildFingerprint{2, 11, 0, 1, 0, 14}, "sdk1_callback", "1.0.0", "Apache-2.0", EMBER_KIND_CALLBACK,
      "A callback built against Ember SDK 1.4.", nullptr, 0, sizeof(EmberConfigKey), &create, &destroy, {}};
  static_assert(EMBER_SDK_ABI_MAJOR == 1, "this test plugin stands for SDK 1.x");
  return &descriptor;
}
