// Helpers shared by the tests: running the real `engine` binary with a hard time limit, temp
// folders, and reading the files a run leaves behind.
#pragma once
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

// What this build has (cmake/EmberOptionalDeps.cmake): a test of a part that the build left out
// skips and says why, instead of failing. `have` is one of the EMBER_TEST_WITH_* definitions.
#define EMBER_SKIP_UNLESS_BUILT_WITH(have, what) \
  if (!(have)) GTEST_SKIP() << "this build has no " what " (see cmake/EmberOptionalDeps.cmake)"
#define EMBER_SKIP_WITHOUT_MPI() EMBER_SKIP_UNLESS_BUILT_WITH(EMBER_TEST_WITH_MPI, "Open MPI, so no CPU ranks for ddp/sharded")

namespace ember::test {

struct ProcessResult {
  int exit_code = -1;   // -1 when killed by the time limit or a signal
  std::string out, err;
  bool timed_out = false;
};

// Runs `argv` (argv[0] is the program) in `cwd` with extra environment variables; kills the
// whole process group after `timeout_s` seconds.
ProcessResult run_process(const std::vector<std::string>& argv, const std::filesystem::path& cwd,
                          const std::map<std::string, std::string>& env = {}, int timeout_s = 300);

// The same in two halves, for tests that act on a running process.
struct Running {
  int pid = -1;
  std::filesystem::path cwd;
  // The process's own output files: processes started in one folder (the ranks of a job) never
  // write into each other's.
  std::filesystem::path out_file, err_file;
};
Running start_process(const std::vector<std::string>& argv, const std::filesystem::path& cwd,
                      const std::map<std::string, std::string>& env = {});
Running start_engine(const std::vector<std::string>& args, const std::filesystem::path& cwd);
ProcessResult wait_process(const Running& running, int timeout_s);

// `engine` from this build, with the build's plugin folder.
ProcessResult run_engine(const std::vector<std::string>& args, const std::filesystem::path& cwd,
                         const std::map<std::string, std::string>& env = {}, int timeout_s = 300);

std::filesystem::path engine_path();
// A TCP port on the loopback that was free a moment ago, outside the range the system hands out
// (for a rendezvous the test sets up, as torchrun would).
int free_port();
std::filesystem::path test_plugin_dir(const std::string& which);  // "good" or "bad"
std::filesystem::path source_dir();

// A fresh, empty folder under the build tree, removed when the object dies.
class TempDir {
 public:
  explicit TempDir(const std::string& name);
  ~TempDir();
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& p) const { return path_ / p; }

 private:
  std::filesystem::path path_;
};

void write_file(const std::filesystem::path& p, const std::string& text);
std::string read_file(const std::filesystem::path& p);
std::vector<std::map<std::string, std::string>> read_csv(const std::filesystem::path& p);
// A multilabel <split>_confusion_matrix.csv (label,tn,fp,fn,tp): each label's counts, in label
// order; throws std::runtime_error when the columns or the order are not those.
struct LabelCounts {
  int64_t tn = 0, fp = 0, fn = 0, tp = 0;
};
std::vector<LabelCounts> read_label_counts(const std::filesystem::path& csv);

// run_engine in `dir` that must succeed (a test failure with the engine's stderr otherwise).
ProcessResult run_engine_ok(const TempDir& dir, const std::vector<std::string>& args, int timeout_s = 240);

// The number that the first match of `pattern` captures in its group 1 (e.g. R"((\d+) gradient
// syncs)" in an engine's stderr), -1 without a match.
int64_t count_in_log(const std::string& text, const std::string& pattern);

// The [trainer], [model] and [data] sections of the small run the strategy tests compare with
// single_device: the mlp on synthetic data (32 features, 4 classes, shuffled, no test split), two
// epochs, every step logged, no sanity check, progress bar or summary. The test adds the
// [optimizer] section.
struct SyntheticMlpRun {
  // "cpu" keeps CPU ranks (Open MPI) and single_device on the same device also where a GPU is
  // present; empty leaves the accelerator to the engine.
  std::string accelerator;
  std::string hidden = "[23, 17]";
  int num_train = 72, num_val = 24, batch_size = 24;
};
std::string synthetic_mlp_toml(const SyntheticMlpRun& run);

// The smallest run: an mlp (8 inputs, one hidden layer of 4) on synthetic data of 8 features,
// `max_epochs` epochs, without progress bar or model summary. `data` continues the
// [data] table (num_train, num_val, batch_size, ...) and may open further tables; keys outside
// any table (plugins = [...]) go before the result.
std::string tiny_mlp_toml(int max_epochs, const std::string& data);

// The [model], [data] and [optimizer] sections of the small CNN the resume and checkpoint tests
// train: 192 shuffled synthetic 1x28x28 images (32 validation, 32 test), Adam at 0.003. `hidden`
// sets the size of the state (the kill tests want writes that take a while), `batch_size` the
// batch per rank. The test adds [trainer] and [checkpoint].
std::string small_cnn_toml(int hidden = 16, int batch_size = 32);

}  // namespace ember::test
