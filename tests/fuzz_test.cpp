// Bounded random-mutation fuzzing in the normal suite (libFuzzer runs the same harness without a
// bound: tests/fuzz/, scripts/fuzz.sh): mutations of the seed corpus in tests/fuzz/corpus/ through
// the TOML/--set parser and validator, and through the checkpoint reader, a few seconds each
// (the loop and where findings go: tests/fuzz/bounded_fuzz.h).
#include <gtest/gtest.h>

#include "fuzz/bounded_fuzz.h"
#include "fuzz/fuzz_inputs.h"
#include "support.h"

using namespace ember::test;
using ember::fuzz::corpus;
using ember::fuzz::fuzz;
using namespace std::string_literals;

namespace {

const std::vector<std::string> kTomlTokens = {
    "[trainer]", "[model]", "[data]", "[optimizer]", "[checkpoint]", "[[trainer]]", "max_epochs", "precision",
    "val_check_interval", "limit_train_batches", "\"16-mixed\"", " = ", "=", ".", "\n", "\r\n", "\n%%\n",
    "trainer.precision=", "optimizer.lr=", "checkpoint.every_n_train_steps=", "model.hidden=", "1e309", "-1e309",
    "1e300", "nan", "inf", "-inf", "-0.0", "1e-320", "9223372036854775807", "-9223372036854775808",
    "9223372036854775808", "0x7FFFFFFFFFFFFFFF", "0o777", "0b101", "1_000", "true", "false", "[1, 2, 3]", "[]",
    "[[], []]", "{ a = 1 }", "'''", "\"\"\"", "\"\\u0000\"", "\"\\U0010FFFF\"", "\"\\x\"", "#", "plugins = [",
    "\"checkpoint\"", "1979-05-27T07:32:00Z", "07:32:00", "\"\xff\xfe\"", "\"\xc3\xa9\""};

// Pickle opcodes and fragments (with NUL bytes: std::string literals), and type annotations.
const std::vector<std::string> kPickleTokens = {
    "\x80\x02"s, "}"s, "]"s, "("s, ")"s, "t"s, "e"s, "s"s, "u"s, "q\x00"s, "h\x00"s, "X\x05\x00\x00\x00state"s,
    "K\x00"s, "K\xff"s, "J\xff\xff\xff\x7f"s, "J\x00\x00\x00\x80"s, "M\xff\xff"s,
    "\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7f"s, "N"s, "\x88"s, "\x89"s, "G\x7f\xf8\x00\x00\x00\x00\x00\x00"s, "R"s,
    "b"s, "c"s, "ctorch._utils\n_rebuild_tensor_v2\n"s, "ctorch\nFloatStorage\n"s, "ccollections\nOrderedDict\n"s,
    "Q"s, "."s, "0"s, "1"s, "2"s, "\x85"s, "\x86"s, "\x87"s, "\x94"s, "\x95"s, "B"s, "C"s, "T"s, "U"s, "V"s,
    "Dict[str, Tensor]\n"s, "List[int]\n"s, "List[Tensor]\n"s, "Dict[str, Any]\n"s, "Tuple[int, int]\n"s,
    "Optional[int]\n"s, "List[List[List[int]]]\n"s};

}  // namespace

TEST(Fuzz, SeedCorporaAreAccepted) {
  // The harness is not vacuous: every seed parses, validates and round-trips / loads.
  std::string error;
  for (const auto& [name, text] : corpus("config")) EXPECT_TRUE(ember::fuzz::config_one(text, &error)) << name << ": " << error;
  for (const auto& [name, bytes] : corpus("checkpoint"))
    EXPECT_TRUE(ember::fuzz::checkpoint_one(bytes, &error)) << name << ": " << error;
}

TEST(Fuzz, InputsThatFoundBugsNowGiveCleanErrors) {
  // What the fuzzers found (tests/fuzz/regressions/, docs/build.md "Fuzzing"): each one crashed,
  // threw something other than a one-line error, or printed a config that read back differently.
  for (const auto& [name, text] : corpus("../regressions/config")) {
    try {
      ember::fuzz::config_one(text);  // accepted or a clean error, both fine
    } catch (const ember::fuzz::Finding& f) {
      ADD_FAILURE() << name << ": " << f.what();
    }
  }
  for (const auto& [name, bytes] : corpus("../regressions/checkpoint")) {
    try {
      EXPECT_FALSE(ember::fuzz::checkpoint_one(bytes)) << name << " loads: it should be a clean error";
    } catch (const ember::fuzz::Finding& f) {
      ADD_FAILURE() << name << ": " << f.what();
    }
  }
}

TEST(Fuzz, ConfigParserAndValidatorSurviveMutatedInput) {
  fuzz("config", corpus("config"), 1200, [](std::string_view in) { return ember::fuzz::config_one(in); },
       [](const std::string& seed, std::mt19937_64& rng) { return ember::fuzz::mutate(seed, rng, kTomlTokens); });
}

TEST(Fuzz, CheckpointReaderSurvivesMutatedFiles) {
  fuzz("checkpoint", corpus("checkpoint"), 800, [](std::string_view in) { return ember::fuzz::checkpoint_one(in); },
       [](const std::string& seed, std::mt19937_64& rng) {
         if (seed.empty() || (seed[0] & 1) == 0) return ember::fuzz::mutate(seed, rng, kPickleTokens);
         // A record list: mutate one record's contents, so most inputs reach the unpickler.
         auto records = ember::fuzz::decode_records(std::string_view(seed).substr(1));
         if (!records.empty()) {
           auto& r = records[rng() % records.size()];
           r.data = ember::fuzz::mutate(r.data, rng, kPickleTokens);
         }
         return std::string(1, '\x01') + ember::fuzz::encode_records(records);
       });
}
