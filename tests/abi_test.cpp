// The engine refuses plugins built against another SDK ABI or another LibTorch, with one line
// that names the file, the field, both values and the fix; a scan skips them with a warning.
#include <gtest/gtest.h>

#include <algorithm>

#include "common/sized_struct.h"
#include "registry/plugin_registry.h"
#include "support.h"

using namespace ember::engine;
using namespace ember::test;

namespace {
std::string refusal(const std::string& name) {
  auto file = test_plugin_dir("bad") / ("lib" + name + ".so");
  try {
    load_descriptor(file, name);
  } catch (const PluginError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(file.string()), std::string::npos) << msg;  // names the file
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;           // one line
    return msg;
  }
  ADD_FAILURE() << name << " was accepted";
  return "";
}
}  // namespace

TEST(Abi, GoodPluginLoads) {
  auto* d = load_descriptor(test_plugin_dir("good") / "libhook_recorder.so", "hook_recorder");
  EXPECT_EQ(d->kind, static_cast<uint32_t>(EMBER_KIND_CALLBACK));
  EXPECT_EQ(d->sdk_abi_major, static_cast<uint32_t>(EMBER_SDK_ABI_MAJOR));
}

TEST(Abi, RefusesOtherSdkMajor) {
  auto msg = refusal("bad_abi_major");
  EXPECT_NE(msg.find("SDK ABI major 99 != engine 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rebuild the plugin against Ember SDK"), std::string::npos) << msg;
}

// A plugin built against SDK 1.4's descriptor (tests/sdk1): refused in one line that names its SDK
// and the engine's, before the loader reads the fingerprint (whose layout changed in 2.0); asked for
// by name (`engine plugins info`), the engine exits 2 with that line.
TEST(Abi, RefusesAPluginBuiltAgainstSdk1InOneLine) {
  const auto file = test_plugin_dir("sdk1") / "libsdk1_callback.so";
  std::string msg;
  try {
    load_descriptor(file, "sdk1_callback");
  } catch (const PluginError& e) {
    msg = e.what();
  }
  EXPECT_EQ(msg, "plugin 'sdk1_callback' (" + file.string() + ") rejected: built against Ember SDK 1.4, this engine speaks SDK " +
                     std::to_string(EMBER_SDK_ABI_MAJOR) + "." + std::to_string(EMBER_SDK_ABI_MINOR) + " (SDK ABI major 1 != engine " +
                     std::to_string(EMBER_SDK_ABI_MAJOR) + "; rebuild the plugin against Ember SDK " + std::to_string(EMBER_SDK_ABI_MAJOR) +
                     "." + std::to_string(EMBER_SDK_ABI_MINOR) + ": docs/abi.md says what changed)");
  TempDir dir("abi");
  auto named = run_engine({"--plugin-path", test_plugin_dir("sdk1").string(), "plugins", "info", "sdk1_callback"}, dir.path());
  EXPECT_EQ(named.exit_code, 2) << named.err;
  EXPECT_NE(named.err.find("built against Ember SDK 1.4, this engine speaks SDK 2."), std::string::npos) << named.err;
  EXPECT_EQ(std::count(named.err.begin(), named.err.end(), '\n'), 1) << named.err;
}

TEST(Abi, RefusesNewerSdkMinor) {
  auto msg = refusal("bad_abi_minor");
  EXPECT_NE(msg.find("SDK ABI minor 99 > engine " + std::to_string(EMBER_SDK_ABI_MINOR)), std::string::npos) << msg;
  EXPECT_NE(msg.find("upgrade the engine"), std::string::npos) << msg;
}

// The plugin says minor 0: equal to the engine's at 2.0, older from 2.1 on (the rule is "<=").
TEST(Abi, LoadsPluginBuiltAgainstAnEarlierOrEqualSdkMinor) {
  auto* d = load_descriptor(test_plugin_dir("old") / "libold_minor.so", "old_minor");
  EXPECT_EQ(d->sdk_abi_minor, 0u);
  EXPECT_EQ(d->sdk_abi_major, static_cast<uint32_t>(EMBER_SDK_ABI_MAJOR));
}

TEST(Abi, RefusesOtherLibTorchFingerprint) {
  auto msg = refusal("bad_torch_minor");
  EXPECT_NE(msg.find("LibTorch 2.99.0 != engine 2.11.0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rebuild the plugin against this engine's LibTorch 2.11.0"), std::string::npos) << msg;
}

TEST(Abi, RefusesNameThatDoesNotMatchFile) {
  auto msg = refusal("bad_misnamed");
  EXPECT_NE(msg.find("descriptor name 'someone_else' does not match the file name"), std::string::npos) << msg;
}

// A name flagged EMBER_KEY_ELSEWHERE is advice shown for another tool's key: one without advice, or
// one that hides a real key of the plugin, is refused at load, not found by a user's typo.
TEST(Abi, RefusesAnElsewhereNameWithoutAdviceOrTakenByAKey) {
  auto empty = refusal("bad_elsewhere_empty");
  EXPECT_NE(empty.find("config name 'period' is flagged EMBER_KEY_ELSEWHERE but its help is empty"), std::string::npos) << empty;
  auto taken = refusal("bad_elsewhere_taken");
  EXPECT_NE(taken.find("config name 'path' is both a key and flagged EMBER_KEY_ELSEWHERE"), std::string::npos) << taken;
}

// [data] and [model] hold the engine's keys and the plugin's: a plugin key, or advice for a name,
// that is one of the engine's there would never be read, so the load refuses it.
TEST(Abi, RefusesADataKeyOrAdviceThatIsTheEnginesKey) {
  auto taken = refusal("bad_base_key_taken");
  EXPECT_NE(taken.find("config key 'batch_size' is already the engine's key data.batch_size (rename it in the plugin)"), std::string::npos)
      << taken;
  auto hidden = refusal("bad_base_key_hidden");
  EXPECT_NE(hidden.find("config name 'batch_size' is flagged EMBER_KEY_ELSEWHERE, but data.batch_size is the engine's key"),
            std::string::npos)
      << hidden;
}

TEST(Abi, RefusesAFileThatIsNotAPlugin) {
  TempDir dir("abi");
  write_file(dir / "libjunk.so", "not an ELF file");
  EXPECT_THROW(load_descriptor(dir / "libjunk.so", "junk"), PluginError);
}

TEST(Abi, NamedBadPluginIsAnErrorScannedOneAWarning) {
  TempDir dir("abi");
  auto bad = test_plugin_dir("bad").string();
  auto named = run_engine({"--plugin-path", bad, "plugins", "info", "bad_abi_major"}, dir.path());
  EXPECT_EQ(named.exit_code, 2) << named.err;
  EXPECT_NE(named.err.find("SDK ABI major 99 != engine 2"), std::string::npos) << named.err;

  auto listed = run_engine({"--plugin-path", bad, "plugins", "list"}, dir.path());
  EXPECT_EQ(listed.exit_code, 0) << listed.err;
  EXPECT_NE(listed.err.find("bad_torch_minor"), std::string::npos) << listed.err;
  EXPECT_NE(listed.err.find("skipped"), std::string::npos) << listed.err;
  EXPECT_EQ(listed.out.find("bad_torch_minor"), std::string::npos) << listed.out;  // not listed as usable
  EXPECT_NE(listed.out.find("single_device"), std::string::npos) << listed.out;    // the good ones still are
}

// Plain structs carry their size (SDK 2.0): a reader uses a field only when the writer's size
// covers it, and the engine refuses, in one line, a LogOptions or Batch too small for 2.0's fields.
TEST(Abi, SizedStructsSayWhichFieldsTheWriterKnew) {
  ember::LogOptions options;
  EXPECT_EQ(options.struct_size, sizeof(ember::LogOptions));
  EXPECT_TRUE(ember::has_field(options, &ember::LogOptions::batch_size));
  EXPECT_NO_THROW(require_sdk2_fields(options, &ember::LogOptions::batch_size, "LogOptions"));
  options.struct_size = 8;  // a writer that knew only the first fields
  EXPECT_TRUE(ember::has_field(options, &ember::LogOptions::on_step));
  EXPECT_FALSE(ember::has_field(options, &ember::LogOptions::batch_size));
  try {
    require_sdk2_fields(options, &ember::LogOptions::batch_size, "LogOptions");
    ADD_FAILURE() << "a too-small LogOptions was accepted";
  } catch (const ember::RunError& e) {
    EXPECT_EQ(std::string(e.what()), "LogOptions from a plugin has struct_size 8, too small for SDK 2.0's fields (build it with its "
                                     "default initializer, against this engine's SDK)");
  }
  ember::Batch batch{.tensors = {}, .size = 3};
  EXPECT_EQ(batch.struct_size, sizeof(ember::Batch));
  EXPECT_TRUE(ember::has_field(batch, &ember::Batch::size));
}

// A plugin whose libraries export a data symbol of one of libc10's names (Debian's
// libsentencepiece: FLAGS_minloglevel) has it bound to c10's object, and its constructors write
// over LibTorch's flags: with caffe2_use_fatal_for_enforce set that way, a failed allocation
// aborted the process. The engine isolates the libraries it knows to clash (RTLD_DEEPBIND) and
// refuses a plugin that changed the flags anyway. The run in its own process: the test plugin
// really writes over c10's flags.
TEST(Abi, RefusesAPluginWhoseLibrariesOverwriteLibTorchsFlags) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a sanitizer runtime refuses RTLD_DEEPBIND, so sanitizer builds neither isolate nor check (plugin_registry.cpp)";
#endif
  TempDir dir("abi");
  const auto r = run_engine({"--plugin-path", test_plugin_dir("bad").string(), "plugins", "info", "bad_clash"}, dir.path());
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("plugin 'bad_clash' (" + (test_plugin_dir("bad") / "libbad_clash.so").string() +
                       ") loaded a library whose static constructors overwrote LibTorch's own flags"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}
