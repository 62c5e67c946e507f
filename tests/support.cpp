#include "support.h"

#include <atomic>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <random>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace fs = std::filesystem;

namespace ember::test {

int free_port() {
  // Below the kernel's ephemeral range (32768-60999 by default), so no port the system hands out
  // (a connect's local port, a bind to port 0: the engine's own rendezvous stores) can take it
  // between this check and the rank that binds it; only another test's pick could, one in 12,000.
  static std::mt19937 pick(std::random_device{}());
  std::uniform_int_distribution<int> ports(20000, 31999);
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int port = ports(pick);
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    close(fd);
    if (free) return port;
  }
  throw std::runtime_error("no free TCP port in 20000-31999 on the loopback");
}

Running start_process(const std::vector<std::string>& argv, const fs::path& cwd,
                      const std::map<std::string, std::string>& env) {
  static std::atomic<int> started{0};
  const std::string n = std::to_string(started++);
  const fs::path out_file = cwd / (".stdout." + n + ".txt"), err_file = cwd / (".stderr." + n + ".txt");
  pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    setpgid(0, 0);  // own process group, so a timeout kills everything it started
    if (chdir(cwd.c_str()) != 0) _exit(127);
    int o = open(out_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int e = open(err_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(o, 1);
    dup2(e, 2);
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  setpgid(pid, pid);
  return Running{pid, cwd, out_file, err_file};
}

ProcessResult wait_process(const Running& running, int timeout_s) {
  const pid_t pid = running.pid;
  ProcessResult r;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  int status = 0;
  while (true) {
    pid_t w = waitpid(pid, &status, WNOHANG);
    if (w == pid) break;
    if (std::chrono::steady_clock::now() > deadline) {
      kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
      r.timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  r.exit_code = (!r.timed_out && WIFEXITED(status)) ? WEXITSTATUS(status) : -1;
  r.out = read_file(running.out_file);
  r.err = read_file(running.err_file);
  fs::remove(running.out_file);
  fs::remove(running.err_file);
  return r;
}

ProcessResult run_process(const std::vector<std::string>& argv, const fs::path& cwd,
                          const std::map<std::string, std::string>& env, int timeout_s) {
  return wait_process(start_process(argv, cwd, env), timeout_s);
}

fs::path engine_path() { return EMBER_TEST_ENGINE; }
fs::path test_plugin_dir(const std::string& which) { return fs::path(EMBER_TEST_PLUGIN_ROOT) / which; }
fs::path source_dir() { return EMBER_TEST_SOURCE_DIR; }

Running start_engine(const std::vector<std::string>& args, const fs::path& cwd) {
  std::vector<std::string> argv = {engine_path().string()};
  argv.insert(argv.end(), args.begin(), args.end());
  return start_process(argv, cwd, {{"OMP_NUM_THREADS", "1"}});
}

ProcessResult run_engine(const std::vector<std::string>& args, const fs::path& cwd,
                         const std::map<std::string, std::string>& env, int timeout_s) {
  std::vector<std::string> argv = {engine_path().string()};
  argv.insert(argv.end(), args.begin(), args.end());
  auto e = env;
  e.emplace("OMP_NUM_THREADS", "1");  // tests run in parallel on a 2-core machine
  return run_process(argv, cwd, e, timeout_s);
}

// LibTorch 2.11's wheel exports its own std::filesystem symbols, and its remove_all crashes with
// this libstdc++: remove trees by hand.
static void remove_tree(const fs::path& p) {
  std::error_code ec;
  if (fs::is_directory(p, ec) && !fs::is_symlink(p, ec)) {
    std::vector<fs::path> children;
    for (const auto& e : fs::directory_iterator(p, ec)) children.push_back(e.path());
    for (const auto& c : children) remove_tree(c);
  }
  fs::remove(p, ec);
}

TempDir::TempDir(const std::string& name) {
  std::random_device rd;
  path_ = fs::path(EMBER_TEST_TMP) / (name + "-" + std::to_string(getpid()) + "-" + std::to_string(rd() % 100000));
  remove_tree(path_);
  fs::create_directories(path_);
}

TempDir::~TempDir() {
  std::error_code ec;
  (void)ec;
  if (!std::getenv("EMBER_KEEP_TEST_DIRS")) remove_tree(path_);
}

void write_file(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<LabelCounts> read_label_counts(const fs::path& csv) {
  std::vector<LabelCounts> out;
  for (auto& row : read_csv(csv)) {
    for (const char* column : {"label", "tn", "fp", "fn", "tp"})
      if (!row.count(column)) throw std::runtime_error(csv.string() + ": no column " + column);
    if (std::stoll(row["label"]) != static_cast<int64_t>(out.size())) throw std::runtime_error(csv.string() + ": labels out of order");
    out.push_back({std::stoll(row["tn"]), std::stoll(row["fp"]), std::stoll(row["fn"]), std::stoll(row["tp"])});
  }
  return out;
}

std::vector<std::map<std::string, std::string>> read_csv(const fs::path& p) {
  std::vector<std::map<std::string, std::string>> rows;
  std::ifstream in(p);
  std::string line;
  std::vector<std::string> header;
  auto split = [](const std::string& l) {
    std::vector<std::string> cells;
    std::stringstream ss(l);
    std::string c;
    while (std::getline(ss, c, ',')) cells.push_back(c);
    if (!l.empty() && l.back() == ',') cells.emplace_back();
    return cells;
  };
  if (!std::getline(in, line)) return rows;
  header = split(line);
  while (std::getline(in, line)) {
    auto cells = split(line);
    std::map<std::string, std::string> row;
    for (size_t i = 0; i < header.size(); ++i) row[header[i]] = i < cells.size() ? cells[i] : "";
    rows.push_back(row);
  }
  return rows;
}

ProcessResult run_engine_ok(const TempDir& dir, const std::vector<std::string>& args, int timeout_s) {
  auto r = run_engine(args, dir.path(), {}, timeout_s);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return r;
}

int64_t count_in_log(const std::string& text, const std::string& pattern) {
  std::smatch m;
  if (!std::regex_search(text, m, std::regex(pattern))) return -1;
  return std::stoll(m[1].str());
}

std::string synthetic_mlp_toml(const SyntheticMlpRun& run) {
  std::ostringstream t;
  t << "[trainer]\n";
  if (!run.accelerator.empty()) t << "accelerator = \"" << run.accelerator << "\"\n";
  t << "max_epochs = 2\nnum_sanity_val_steps = 0\nenable_progress_bar = false\nenable_model_summary = false\n"
       "log_every_n_steps = 1\n"
       "[model]\nname = \"mlp\"\ninput_size = 32\nhidden = "
    << run.hidden << "\nnum_classes = 4\n"
    << "[data]\nname = \"synthetic\"\nshape = [32]\nnum_classes = 4\nnum_train = " << run.num_train
    << "\nnum_val = " << run.num_val << "\nnum_test = 0\nbatch_size = " << run.batch_size << "\nshuffle = true\n";
  return t.str();
}

std::string tiny_mlp_toml(int max_epochs, const std::string& data) {
  return "[trainer]\nmax_epochs = " + std::to_string(max_epochs) +
         "\nenable_progress_bar = false\nenable_model_summary = false\n"
         "[model]\nname = \"mlp\"\ninput_size = 8\nhidden = [4]\n[data]\nname = \"synthetic\"\nshape = [8]\n" + data;
}

std::string small_cnn_toml(int hidden, int batch_size) {
  return "[model]\nname = \"cnn\"\nconv1_channels = 4\nconv2_channels = 8\nhidden = " + std::to_string(hidden) +
         "\n[data]\nname = \"synthetic\"\nshape = [1, 28, 28]\nnum_train = 192\nnum_val = 32\nnum_test = 32\nbatch_size = " +
         std::to_string(batch_size) + "\nshuffle = true\n[optimizer]\nname = \"adam\"\nlr = 0.003\n";
}

}  // namespace ember::test
