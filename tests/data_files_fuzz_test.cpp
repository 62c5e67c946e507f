// Bounded random-mutation fuzzing of the readers of the data files users bring (.npy, JPEG/PNG,
// CSV/JSON Lines tables, tar shards), over the harness libFuzzer runs without a bound
// (tests/fuzz/data_file_inputs.h, scripts/fuzz.sh).
#include <gtest/gtest.h>

#include "fuzz/bounded_fuzz.h"
#include "fuzz/data_file_inputs.h"

using ember::fuzz::corpus;
using ember::fuzz::fuzz;
using namespace std::string_literals;

namespace {

// Fragments the mutations splice in: .npy header values at the edges of 64 bits, dtypes, table
// quoting, JSON values of the wrong type, tar size fields.
const std::vector<std::string> kDataFileTokens = {
    "'shape': (", "), ", "4611686018427387904", "18446744073709551615", "99999999999999999999", "0, ", "L", "'<f4'", "'|b1'",
    "'>f8'", "True", "False", "'fortran_order'", "'descr'", "\"", "\"\"", ",", "\r\n", "\n", "{", "}", "[", "]", "null", "1e400",
    "-1", "\"text\"", "\"label\"", "text,label\n", "77777777777\0"s, "\x80\0\0\0\0\0\0\0\0\0\xff\xff"s, "ustar\0"s, "00\0"s,
    "\xff\xd8\xff\xc0"s, "\x89PNG\r\n\x1a\n"s, "IHDR", "\x7f\xff\xff\xff"s, "\xff\xff"s};

}  // namespace

TEST(Fuzz, DataFileSeedsAreAccepted) {
  // Files written by numpy, Pillow and tarfile (tests/fuzz/make_data_file_seeds.py) read and
  // pass the harness's checks.
  ember::fuzz::expect_seeds_accepted("data_files", 16, ember::fuzz::data_file_one);
}

TEST(Fuzz, DataFileInputsThatFoundBugsNowPass) {
  // Crafted .npy headers that crashed, threw stoll or were read wrong: now one line each.
  ember::fuzz::replay_regressions("data_files", ember::fuzz::data_file_one);
}

TEST(Fuzz, DataFileReadersSurviveMutatedFiles) {
  fuzz("data_files", corpus("data_files"), 10000, [](std::string_view in) { return ember::fuzz::data_file_one(in); },
       [](const std::string& seed, std::mt19937_64& rng) {
         // Keep the kind byte: a mutation of a file of one kind, read as that kind.
         return seed.substr(0, 1) + ember::fuzz::mutate(seed.substr(1), rng, kDataFileTokens);
       });
}
