// One fuzz input through the engine's real parsers, shared by the libFuzzer targets
// (tests/fuzz/libfuzzer_*.cpp, built with EMBER_FUZZ=ON under clang) and the bounded
// random-mutation test in the normal suite (tests/fuzz_test.cpp).
//
// A finding is a crash, a hang, an exception other than the clean error the code documents, or
// a clean error that is not one line. The functions return true for accepted input and false
// for a clean error (its message in *error when given), and throw ember::fuzz::Finding (with
// what was wrong) otherwise.
#pragma once
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace ember::fuzz {

class Finding : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// TOML text, then optionally a line "%%" followed by one `--set` assignment per line. Runs the
// file parser, the overrides, the validator against the engine's sections and every plugin's
// schema found on the plugin path (EMBER_PLUGIN_PATH or the build tree), reads every value back
// through the plugin-facing getters, and checks that the resolved config printed as TOML
// resolves to the same text again. Clean errors: UsageError / ConfigError, one line.
bool config_one(std::string_view input, std::string* error = nullptr);

// First byte: 0 = the rest is a checkpoint file's bytes; 1 = the rest is a list of archive
// records (see encode_records), which is written as an archive with a manifest that fits, so
// that mutated record contents get past the checksums into the unpickler. Runs
// load_checkpoint_bytes and touches every tensor it returns. Clean error: std::runtime_error
// naming the file, one line.
bool checkpoint_one(std::string_view input, std::string* error = nullptr);

// Record lists: per record its name, a NUL byte, a 4-byte little-endian length and the contents.
// Decoding is lenient (a length past the end takes what is there), so any bytes decode.
struct Record {
  std::string name, data;
};
std::string encode_records(const std::vector<Record>& records);
std::vector<Record> decode_records(std::string_view bytes);
// The records of a checkpoint file (the input of mode 1 for a real file).
std::vector<Record> archive_records(std::string_view file_bytes);

// Deterministic byte-level mutations for the bounded test (libFuzzer brings its own): bit flips,
// byte sets, inserts, deletes, duplicated runs, and tokens from `dictionary`.
std::string mutate(std::string input, std::mt19937_64& rng, const std::vector<std::string>& dictionary);

}  // namespace ember::fuzz
