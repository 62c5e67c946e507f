// The bounded random-mutation loop of the suite's fuzz tests (tests/fuzz_test.cpp,
// tests/model_files_fuzz_test.cpp): a fixed seed and a fixed number of mutations of a seed corpus
// of tests/fuzz/corpus/. An input that finds something is written to test-tmp/fuzz-findings/ in
// the build tree for replaying (scripts/fuzz.sh replay FILE); after a crash, <name>-running.bin
// there is the input that crashed.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "../support.h"
#include "fuzz_inputs.h"

namespace ember::fuzz {

// The files of tests/fuzz/corpus/<which> (or any folder under tests/fuzz/corpus), sorted by name.
inline std::vector<std::pair<std::string, std::string>> corpus(const std::string& which) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& e : std::filesystem::directory_iterator(ember::test::source_dir() / "tests/fuzz/corpus" / which))
    out.emplace_back(e.path().filename().string(), ember::test::read_file(e.path()));
  std::sort(out.begin(), out.end());
  return out;
}

// Every seed of tests/fuzz/corpus/<which> (there are `count`) is accepted by `one`, which takes
// the input and a string for the error: the harness is not vacuous.
template <class One>
void expect_seeds_accepted(const std::string& which, size_t count, One one) {
  const auto seeds = corpus(which);
  ASSERT_EQ(seeds.size(), count) << "tests/fuzz/corpus/" << which;
  for (const auto& [name, bytes] : seeds) {
    std::string error;
    EXPECT_TRUE(one(bytes, &error)) << name << ": " << error;
  }
}

// Every input of tests/fuzz/regressions/<which> (what fuzzing and review found) is read or
// refused cleanly by `one`: no finding.
template <class One>
void replay_regressions(const std::string& which, One one) {
  const auto found = corpus("../regressions/" + which);
  ASSERT_FALSE(found.empty()) << "tests/fuzz/regressions/" << which;
  for (const auto& [name, bytes] : found) {
    try {
      std::string error;
      one(bytes, &error);
    } catch (const Finding& f) {
      ADD_FAILURE() << name << ": " << f.what();
    }
  }
}

// Runs `iterations` mutations; reports every finding (up to 5) with the file holding its input.
template <class One, class Mutator>
void fuzz(const std::string& name, const std::vector<std::pair<std::string, std::string>>& seeds, int iterations, One one,
          Mutator mutator) {
  ASSERT_FALSE(seeds.empty());
  std::mt19937_64 rng(20261122);
  int findings = 0;
  const std::filesystem::path out = std::filesystem::path(EMBER_TEST_TMP) / "fuzz-findings";
  std::filesystem::create_directories(out);
  // The input under test, kept on disk while it runs: after a crash it is the one to replay.
  const std::filesystem::path current = out / (name + "-running.bin");
  for (int i = 0; i < iterations && findings < 5; ++i) {
    const auto& seed = seeds[rng() % seeds.size()].second;
    const std::string input = mutator(seed, rng);
    std::ofstream(current, std::ios::binary | std::ios::trunc) << input;
    try {
      one(input);
    } catch (const Finding& f) {
      const std::filesystem::path file = out / (name + "-" + std::to_string(i) + ".bin");
      std::ofstream(file, std::ios::binary) << input;
      ADD_FAILURE() << name << " finding at iteration " << i << " (input in " << file.string() << "): " << f.what();
      ++findings;
    }
  }
  std::filesystem::remove(current);
}

}  // namespace ember::fuzz
