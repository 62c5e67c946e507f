// The mlflow logger plugin (docs/plugins.md, "mlflow"): against a real `mlflow server` (PyPI
// mlflow in the LibTorch venv, SQLite backend, loopback), a run is read back with MLflow's own
// client (every param of the resolved config, every metric row metrics.csv has, the config as an
// artifact, the best checkpoint's path), a resumed run continues the same MLflow run, and a
// server that dies mid-run (or is never there) does not stop training: what could not be sent is
// kept and reported in one line.
#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

#ifdef EMBER_TEST_PYTHON
namespace {

// `mlflow server` on a free loopback port, its store in `dir`; stopped (its whole process group)
// when the object dies. It runs in dir/server, where its output files go (start_process writes a
// process's output into its working folder, which the engine runs in).
class MlflowServer {
 public:
  // On `port` when given (a server started again where the last one was), else a free one.
  explicit MlflowServer(const TempDir& dir, int port = 0) : port_(port > 0 ? port : free_port()), cwd_(dir / "server") {
    fs::create_directories(cwd_);
    running_ = start_process({EMBER_TEST_PYTHON, "-m", "mlflow", "server", "--backend-store-uri", "sqlite:///" + (dir / "mlflow.db").string(),
                              "--artifacts-destination", (dir / "mlartifacts").string(), "--host", "127.0.0.1", "--port",
                              std::to_string(port_), "--workers", "1"},
                             cwd_);
  }
  ~MlflowServer() { stop(); }
  std::string uri() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int port() const { return port_; }
  // Waits until the server answers its health check (it takes seconds to start).
  bool ready(int timeout_s = 120) {
    for (int i = 0; i < timeout_s * 2; ++i) {
      auto r = run_process({EMBER_TEST_PYTHON, "-c", "import urllib.request, sys; urllib.request.urlopen(sys.argv[1] + '/health', timeout=2)", uri()},
                           cwd_, {}, 10);
      if (r.exit_code == 0) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
    return false;
  }
  void stop() {
    if (running_.pid <= 0) return;
    ::kill(-running_.pid, SIGKILL);
    wait_process(running_, 10);
    running_.pid = -1;
  }

 private:
  int port_;
  fs::path cwd_;
  Running running_;
};

nlohmann::json read_run(const TempDir& dir, const std::string& uri, const std::string& run_id) {
  auto r = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/reference/mlflow_read.py").string(), uri, run_id}, dir.path(), {}, 120);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return nlohmann::json::parse(r.out, nullptr, false);
}

std::string run_id_in(const fs::path& run_dir) {
  std::ifstream in(run_dir / "mlflow_run.json");
  const auto j = nlohmann::json::parse(in, nullptr, false);
  return j.is_object() ? j.value("run_id", "") : "";
}

}  // namespace

// Params, every metric row, the config artifact, the best checkpoint's tag, FINISHED; then a
// resume in the same folder logs the third epoch to the same MLflow run.
TEST(Mlflow, RunIsReadBackWithMlflowsClientAndResumesIntoTheSameRun) {
  TempDir dir("mlflow");
  MlflowServer server(dir);
  ASSERT_TRUE(server.ready()) << "scripts/setup.sh installs mlflow into the LibTorch venv";
  write_file(dir / "run.toml", synthetic_mlp_toml({.accelerator = "cpu", .hidden = "[8]", .num_train = 96, .num_val = 32, .batch_size = 16}) +
                                   "[optimizer]\nname = \"adam\"\nlr = 0.01\n[checkpoint]\nmonitor = \"val_loss\"\nmode = \"min\"\n");
  const std::vector<std::string> common = {"--plugins", "mlflow,csv", "--set", "mlflow.tracking_uri=\"" + server.uri() + "\"", "--set",
                                           "mlflow.flush_interval_s=0.2", "--set", "csv.flush_logs_every_n_steps=1"};
  auto args = common;
  args.insert(args.begin(), "run.toml");
  auto r = run_engine_ok(dir, args);
  const fs::path run_dir = dir / "runs/run/version_0";
  const std::string run_id = run_id_in(run_dir);
  ASSERT_FALSE(run_id.empty()) << r.err;
  EXPECT_NE(r.err.find("mlflow: run " + run_id + " in experiment 'run'"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("not recorded"), std::string::npos) << r.err;
  auto run = read_run(dir, server.uri(), run_id);
  ASSERT_TRUE(run.is_object());
  EXPECT_EQ(run["status"], "FINISHED");
  EXPECT_EQ(run["experiment"], "run");
  EXPECT_EQ(run["params"]["trainer.max_epochs"], "2");
  EXPECT_EQ(run["params"]["model.name"], "mlp");
  EXPECT_EQ(run["params"]["model.hidden"], "[ 8 ]");
  EXPECT_EQ(run["params"]["optimizer.lr"], "0.01");
  EXPECT_EQ(run["artifacts"], nlohmann::json({"config.toml"}));
  EXPECT_EQ(run["tags"]["ember.run_dir"], fs::absolute(run_dir).string());
  const std::string best = run["tags"].value("ember.best_checkpoint", "");
  EXPECT_TRUE(fs::exists(best) && best.find(fs::absolute(run_dir / "checkpoints").string()) == 0) << best;
  // Every value of metrics.csv, at its step, is in MLflow's history of that metric.
  const auto rows = read_csv(run_dir / "metrics.csv");
  size_t values = 0;
  for (const auto& row : rows)
    for (const auto& [key, text] : row) {
      if (key == "step" || key == "epoch" || text.empty()) continue;
      ++values;
      const int64_t step = std::stoll(row.at("step"));
      const double v = std::stod(text);
      bool found = false;
      for (const auto& point : run["metrics"].value(key, nlohmann::json::array()))
        found |= point[0].get<int64_t>() == step && std::abs(point[1].get<double>() - v) <= 1e-6 * std::max(1.0, std::abs(v));  // metrics.csv keeps 8 digits
      EXPECT_TRUE(found) << key << " at step " << step << " = " << text;
    }
  EXPECT_GE(values, 20u);

  // Resumed in its folder: the same MLflow run, now with the third epoch, and with
  // log_checkpoint the best checkpoint's file uploaded too.
  args = common;
  args.insert(args.begin(), {"run.toml", "--resume", "last", "--set", "trainer.max_epochs=3", "--set", "mlflow.log_checkpoint=true"});
  run_engine_ok(dir, args);
  EXPECT_EQ(run_id_in(run_dir), run_id);
  run = read_run(dir, server.uri(), run_id);
  EXPECT_EQ(run["status"], "FINISHED");
  const std::string best_now = run["tags"].value("ember.best_checkpoint", "");
  EXPECT_EQ(run["artifacts"], nlohmann::json({"checkpoints/" + fs::path(best_now).filename().string(), "config.toml"})) << best_now;
  int64_t last_epoch = -1;
  for (const auto& point : run["metrics"]["epoch"]) last_epoch = std::max<int64_t>(last_epoch, static_cast<int64_t>(point[1].get<double>()));
  EXPECT_EQ(last_epoch, 2);
}

// The server dies after the run was created: training goes on and ends with exit 0; the metric
// values that could not be sent are in mlflow_unsent.jsonl and one line says so. Resumed with the
// server back, the run sends them first, into the same MLflow run, and the file goes. With no
// server at all it is the same.
TEST(Mlflow, AServerThatStopsMidRunDoesNotStopTraining) {
  TempDir dir("mlflow");
  MlflowServer server(dir);
  ASSERT_TRUE(server.ready());
  write_file(dir / "run.toml", synthetic_mlp_toml({.accelerator = "cpu", .hidden = "[8]", .num_train = 96, .num_val = 32, .batch_size = 16}) +
                                   "[optimizer]\nname = \"adam\"\nlr = 0.01\n");
  // A run long enough to stop the server under it (a sleep in every step: the sleeper callback).
  auto engine = start_engine({"run.toml", "--plugins", "mlflow", "--plugin-path", test_plugin_dir("good").string(), "--plugins", "sleeper", "--set",
                              "mlflow.tracking_uri=\"" + server.uri() + "\"", "--set", "mlflow.flush_interval_s=0.2", "--set",
                              "mlflow.finalize_timeout_s=2", "--set", "mlflow.timeout_s=2", "--set", "trainer.max_epochs=4", "--set",
                              "sleeper.seconds=[0.5]"},
                             dir.path());
  const fs::path run_dir = dir / "runs/run/version_0";
  for (int i = 0; i < 600 && run_id_in(run_dir).empty(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_FALSE(run_id_in(run_dir).empty()) << "the run was never created";
  server.stop();
  auto r = wait_process(engine, 300);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("mlflow: not recorded on " + server.uri() + ": "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("metric values (kept in "), std::string::npos) << r.err;
  std::vector<nlohmann::json> unsent;
  {
    std::ifstream in(run_dir / "mlflow_unsent.jsonl");
    for (std::string line; std::getline(in, line);) unsent.push_back(nlohmann::json::parse(line));
  }
  ASSERT_FALSE(unsent.empty());
  EXPECT_TRUE(unsent.front().contains("step")) << unsent.front();
  EXPECT_EQ(count_in_log(r.err, R"((\d+) metric values \(kept in )"), static_cast<int64_t>(unsent.size())) << r.err;

  // The server back where it was: the resumed run sends the kept values to the same MLflow run.
  const std::string run_id = run_id_in(run_dir);
  MlflowServer again(dir, server.port());
  ASSERT_TRUE(again.ready());
  auto resumed = run_engine({"run.toml", "--plugins", "mlflow", "--resume", "last", "--set", "mlflow.tracking_uri=\"" + again.uri() + "\"",
                             "--set", "mlflow.flush_interval_s=0.2", "--set", "trainer.max_epochs=5"},
                            dir.path(), {}, 300);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_NE(resumed.err.find(std::to_string(unsent.size()) + " metric values an earlier session could not send"), std::string::npos) << resumed.err;
  EXPECT_EQ(resumed.err.find("not recorded"), std::string::npos) << resumed.err;
  EXPECT_FALSE(fs::exists(run_dir / "mlflow_unsent.jsonl"));
  EXPECT_EQ(run_id_in(run_dir), run_id);
  const auto run = read_run(dir, again.uri(), run_id);
  ASSERT_TRUE(run.is_object());
  for (const auto& v : unsent) {
    bool found = false;
    for (const auto& point : run["metrics"].value(v["key"].get<std::string>(), nlohmann::json::array()))
      found |= point[0].get<int64_t>() == v["step"].get<int64_t>() && point[1].get<double>() == v["value"].get<double>();
    EXPECT_TRUE(found) << v;
  }
  again.stop();

  // No server at all, and room for 2 values in memory: every value ends in the file, counted.
  auto none = run_engine({"run.toml", "--plugins", "mlflow", "--set", "mlflow.tracking_uri=\"http://127.0.0.1:" + std::to_string(free_port()) + "\"",
                          "--set", "mlflow.finalize_timeout_s=1", "--set", "mlflow.max_buffered_values=2"},
                         dir.path(), {}, 120);
  EXPECT_EQ(none.exit_code, 0) << none.err;
  EXPECT_NE(none.err.find("training goes on, the data is kept and sent when the server answers"), std::string::npos) << none.err;
  std::ifstream file(dir / "runs/run/version_1/mlflow_unsent.jsonl");
  int64_t lines = 0;
  for (std::string l; std::getline(file, l);) ++lines;
  EXPECT_GT(lines, 20);
  EXPECT_NE(none.err.find("mlflow: not recorded on http://127.0.0.1:"), std::string::npos) << none.err;
  EXPECT_EQ(count_in_log(none.err, R"((\d+) metric values \(kept in )"), lines) << none.err;
}
#endif

// Where the server is: unset or not http(s) is one line naming the key.
TEST(Mlflow, TrackingUriMustBeAServer) {
  TempDir dir("mlflow");
  write_file(dir / "run.toml", synthetic_mlp_toml({.accelerator = "cpu"}) + "[optimizer]\nname = \"sgd\"\nlr = 0.01\n");
  auto unset = run_engine({"run.toml", "--plugins", "mlflow"}, dir.path(), {{"MLFLOW_TRACKING_URI", ""}}, 60);
  EXPECT_EQ(unset.exit_code, 2) << unset.err;
  EXPECT_NE(unset.err.find("mlflow.tracking_uri is not set: give the tracking server"), std::string::npos) << unset.err;
  auto file = run_engine({"run.toml", "--plugins", "mlflow", "--set", "mlflow.tracking_uri=\"file:./mlruns\""}, dir.path(), {}, 60);
  EXPECT_EQ(file.exit_code, 2) << file.err;
  EXPECT_NE(file.err.find("is not an http(s):// server"), std::string::npos) << file.err;
}
