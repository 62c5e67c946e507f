// Plugin "mlflow": the run tracked on an MLflow tracking server (Lightning's MLFlowLogger), over
// its REST API: the experiment (found or created), a run (created, or reopened when the engine
// resumes in the same run folder: its id is kept in <run folder>/mlflow_run.json), the resolved
// config as params (section.key = value), metrics in batches, tags (the SDK version, the plugins,
// the run folder, the best checkpoint's path) and the config file as an artifact (the best
// checkpoint too with log_checkpoint = true) when the server serves artifacts.
//
// Everything goes through a sender thread, so training never waits on the network: a server that
// is down or slow only delays the rows, which are retried with backoff. At the end the logger
// waits up to finalize_timeout_s for them; what could not be sent is written to
// <run folder>/mlflow_unsent.jsonl and reported in one line, and the run still succeeds. Values in
// that file are sent once the server answers again, in this session or when the run is resumed
// (MLflow keeps a value sent twice once, so a crash mid-replay sends nothing twice).
#include <ember/abi.h>
#include <ember/config.h>
#include <ember/error.h>
#include <ember/host.h>
#include <ember/logger.h>
#include <ember/plugin.h>
#include <ember/trainer.h>

#include <toml++/toml.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "mlflow_client.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ember_mlflow::HttpError;
using ember_mlflow::MlflowClient;

constexpr EmberConfigKey kKeys[] = {
    ember::key::String("tracking_uri", "\"\"", "The tracking server, http(s)://host:port; empty = $MLFLOW_TRACKING_URI."),
    ember::key::String("experiment_name", "\"\"", "Experiment the run goes to (created when missing); empty = the run's name (runs/<name>/version_N)."),
    ember::key::String("run_name", "\"\"", "Name of the MLflow run; empty = <name>/version_N."),
    ember::key::Bool("log_checkpoint", "false", "Also upload the best checkpoint file as an artifact at the end (its path is always a tag)."),
    ember::key::Float("flush_interval_s", "5.0", "Send buffered metrics at least this often (and at every 1000 values).").above(0.0),
    ember::key::Float("timeout_s", "10.0", "Time limit of one request to the server.").above(0.0),
    ember::key::Float("finalize_timeout_s", "30.0", "At the end, wait this long at most for what is still unsent.").at_least(0.0),
    ember::key::Int("max_buffered_values", "100000", "Metric values kept in memory while the server does not answer; older ones go to <run folder>/mlflow_unsent.jsonl.").at_least(1),
    ember::key::Elsewhere("log_model", "Lightning's log_model is log_checkpoint = true (the best checkpoint goes up as an artifact)"),
    ember::key::Elsewhere("save_dir", "Ember's mlflow logger talks to a tracking server (tracking_uri = \"http://host:port\"); for "
                                      "files on disk add the csv or tensorboard logger"),
};

// MLflow's request limits (runs/log-batch) and value limits.
constexpr const char* kUnsentFile = "mlflow_unsent.jsonl";
constexpr size_t kMetricsPerBatch = 1000, kParamsPerBatch = 100, kTagsPerBatch = 100, kParamValueChars = 6000;

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The resolved config as MLflow params: "section.key" = the value (strings as they are, other
// values as TOML writes them).
void flatten(const toml::table& table, const std::string& prefix, std::vector<std::pair<std::string, std::string>>& out) {
  for (auto&& [k, v] : table) {
    const std::string key = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (const auto* sub = v.as_table()) {
      flatten(*sub, key, out);
      continue;
    }
    std::string text;
    if (const auto* s = v.as_string()) {
      text = s->get();
    } else {
      std::ostringstream os;
      v.visit([&](const auto& node) { os << node; });
      text = os.str();
    }
    if (text.size() > kParamValueChars) text = text.substr(0, kParamValueChars - 3) + "...";
    out.emplace_back(key, text);
  }
}

// One thing to send besides metrics, in order.
struct Item {
  enum Kind { params, tags, artifact, end } kind;
  json entries;          // params / tags: [{key, value}]
  std::string path, name;  // artifact: the local file and its name in the run's artifacts
  std::string status;    // end: FINISHED, FAILED or KILLED
};

class MlflowLogger final : public ember::ILogger, public ember::ILoggerArtifacts {
 public:
  MlflowLogger(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host),
        experiment_(cfg.get_string("experiment_name")),
        run_name_(cfg.get_string("run_name")),
        log_checkpoint_(cfg.get_bool("log_checkpoint")),
        flush_interval_s_(cfg.get_float("flush_interval_s")),
        timeout_s_(cfg.get_float("timeout_s")),
        finalize_timeout_s_(cfg.get_float("finalize_timeout_s")),
        max_buffered_(static_cast<size_t>(cfg.get_int("max_buffered_values"))) {
    uri_ = cfg.get_string("tracking_uri");
    if (uri_.empty())
      if (const char* env = std::getenv("MLFLOW_TRACKING_URI")) uri_ = env;
    if (uri_.empty())
      throw ember::ConfigError(cfg.where("tracking_uri") + ": " + cfg.section() +
                               ".tracking_uri is not set: give the tracking server (e.g. \"http://127.0.0.1:5000\") or set MLFLOW_TRACKING_URI");
    if (uri_.rfind("http://", 0) != 0 && uri_.rfind("https://", 0) != 0)
      throw ember::ConfigError(cfg.where("tracking_uri") + ": " + cfg.section() + ".tracking_uri = \"" + uri_ +
                               "\" is not an http(s):// server: start `mlflow server` and give its address (MLflow 3 deprecates the file store)");
  }

  ~MlflowLogger() override { stop_sender(0.0); }

  void* query_interface(const char* iid) override {
    if (std::strcmp(iid, ember::kLoggerArtifactsIid) == 0) return static_cast<ember::ILoggerArtifacts*>(this);
    return nullptr;
  }

  void setup(ember::ITrainer& trainer, bool resuming, int64_t) override {
    run_dir_ = trainer.run_dir();
    const fs::path dir(run_dir_);
    if (experiment_.empty()) experiment_ = dir.parent_path().filename().string();
    if (run_name_.empty()) run_name_ = dir.parent_path().filename().string() + "/" + dir.filename().string();
    if (resuming) {
      std::ifstream in(dir / "mlflow_run.json");
      const json saved = json::parse(in, nullptr, false);
      if (saved.is_object() && saved.value("tracking_uri", "") == uri_) resume_run_id_ = saved.value("run_id", "");
    }
    // Values an earlier session of this run folder could not send go first.
    {
      std::ifstream in(dir / kUnsentFile);
      for (std::string line; std::getline(in, line);) in_file_ += line.empty() ? 0 : 1;
    }
    if (in_file_ > 0)
      host_.log(ember::LogLevel::info, "mlflow: " + std::to_string(in_file_) + " metric values an earlier session could not send (" +
                                           (dir / kUnsentFile).string() + ") are sent when the server answers");
    enqueue({Item::tags, json::array({tag("ember.sdk", std::to_string(EMBER_SDK_ABI_MAJOR) + "." + std::to_string(EMBER_SDK_ABI_MINOR)),
                                      tag("ember.run_dir", fs::absolute(dir).string())}),
             {}, {}, {}});
    sender_ = std::thread([this] { send_loop(); });
  }

  void log_hyperparams(const std::string& resolved_config_toml) override {
    std::vector<std::pair<std::string, std::string>> params;
    try {
      const toml::table config = toml::parse(resolved_config_toml);
      flatten(config, "", params);
    } catch (const std::exception& e) {
      host_.log(ember::LogLevel::warn, std::string("mlflow: the resolved config could not be read as params: ") + e.what());
    }
    json batch = json::array();
    for (const auto& [k, v] : params) {
      if (k == "plugins") enqueue({Item::tags, json::array({tag("ember.plugins", v)}), {}, {}, {}});
      batch.push_back(tag(k, v));
      if (batch.size() == kParamsPerBatch) enqueue({Item::params, std::exchange(batch, json::array()), {}, {}, {}});
    }
    if (!batch.empty()) enqueue({Item::params, batch, {}, {}, {}});
  }

  void log_metrics(const std::vector<std::pair<std::string, double>>& metrics, int64_t step) override {
    const int64_t t = now_ms();
    std::lock_guard lock(mutex_);
    for (const auto& [name, value] : metrics) {
      json entry = {{"key", name}, {"timestamp", t}, {"step", step}};
      // JSON has no NaN or infinity; MLflow's protobuf reader takes them as these strings.
      if (std::isfinite(value)) entry["value"] = value;
      else entry["value"] = std::isnan(value) ? "NaN" : value > 0 ? "Infinity" : "-Infinity";
      metrics_.push_back(std::move(entry));
    }
    // A server away for long: memory stays bounded, the oldest values wait in the file.
    if (metrics_.size() > max_buffered_) spill(metrics_.size() - max_buffered_);
    if (metrics_.size() >= kMetricsPerBatch) cv_.notify_all();
  }

  void flush() override { cv_.notify_all(); }

  void log_artifact(const std::string& path, const std::string& kind) override {
    if (kind == "config") {
      enqueue({Item::artifact, {}, path, fs::path(path).filename().string(), {}});
    } else if (kind == "best_checkpoint") {
      enqueue({Item::tags, json::array({tag("ember.best_checkpoint", fs::absolute(path).string())}), {}, {}, {}});
      if (log_checkpoint_ && fs::is_regular_file(path)) enqueue({Item::artifact, {}, path, "checkpoints/" + fs::path(path).filename().string(), {}});
    }
  }

  void finalize(const std::string& status) override {
    if (!sender_.joinable()) return;
    enqueue({Item::end, {}, {}, {}, status == "success" ? "FINISHED" : status == "interrupted" ? "KILLED" : "FAILED"});
    stop_sender(finalize_timeout_s_);
    report_unsent();
  }

 private:
  static json tag(const std::string& key, const std::string& value) { return {{"key", key}, {"value", value}}; }

  void enqueue(Item item) {
    std::lock_guard lock(mutex_);
    items_.push_back(std::move(item));
    cv_.notify_all();
  }

  // Asks the sender to finish what is queued within `timeout_s`, then to give up; joins it.
  void stop_sender(double timeout_s) {
    if (!sender_.joinable()) return;
    std::unique_lock lock(mutex_);
    stopping_ = true;
    cv_.notify_all();
    cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return done_; });
    abandon_ = true;
    cv_.notify_all();
    lock.unlock();
    sender_.join();
  }

  // The sender thread: the run first, then the queued items in order, then metrics in batches;
  // a failure the server may get over is retried after 1, 2, 4 ... 30 s; one it refused is dropped
  // and counted.
  void send_loop() {
    MlflowClient client(uri_, timeout_s_);
    double backoff = 0;
    std::unique_lock lock(mutex_);
    while (!abandon_) {
      const bool has_work = !items_.empty() || !metrics_.empty() || in_file_ > 0;
      if (!has_work && stopping_) break;
      // A full batch, an item, or the file's values (once memory is empty) go at once.
      auto ready = [&] { return !items_.empty() || metrics_.size() >= kMetricsPerBatch || (metrics_.empty() && in_file_ > 0); };
      if (backoff > 0 || (!stopping_ && !ready())) {
        const auto wait = std::chrono::duration<double>(backoff > 0 ? backoff : flush_interval_s_);
        if (backoff > 0) cv_.wait_for(lock, wait, [&] { return abandon_; });
        else cv_.wait_for(lock, wait, [&] { return abandon_ || stopping_ || ready(); });
        if (abandon_) break;
        if (backoff == 0 && items_.empty() && metrics_.empty() && in_file_ == 0) continue;
      }
      lock.unlock();
      try {
        send_one(client);
        backoff = 0;
        lock.lock();
      } catch (const HttpError& e) {
        lock.lock();
        last_error_ = std::string(e.what()).substr(0, 300);
        if (e.retry && !warned_) {  // once: the run goes on, the data waits
          warned_ = true;
          host_.log(ember::LogLevel::warn, "mlflow: " + last_error_ + "; training goes on, the data is kept and sent when the server answers");
        }
        if (e.retry) {
          backoff = std::min(30.0, std::max(1.0, backoff * 2));
        } else {
          drop_front();
          backoff = 0;
        }
      } catch (const std::exception& e) {  // an answer that is not what MLflow sends
        lock.lock();
        last_error_ = std::string("unexpected answer from ") + uri_ + ": " + e.what();
        drop_front();
      }
    }
    done_ = items_.empty() && metrics_.empty() && in_file_ == 0;
    cv_.notify_all();
  }

  // Sends the next thing; removes it from the queue once the server has it.
  void send_one(MlflowClient& client) {
    if (run_id_.empty()) open_run(client);
    Item item;
    bool has_item = false;
    json batch = json::array();
    FileBatch from_file;
    {
      std::lock_guard lock(mutex_);
      // Metrics (those in memory, then the file's) go before the run's end; params, tags and
      // artifacts as they came.
      if (!items_.empty() && (items_.front().kind != Item::end || (metrics_.empty() && in_file_ == 0))) {
        item = items_.front();
        has_item = true;
      } else if (!metrics_.empty()) {
        for (size_t i = 0; i < metrics_.size() && i < kMetricsPerBatch; ++i) batch.push_back(metrics_[i]);
      } else if (in_file_ > 0) {
        from_file = read_unsent_batch(batch);
      }
    }
    if (has_item) {
      switch (item.kind) {
        case Item::params: client.log_batch(run_id_, json::array(), item.entries, json::array()); break;
        case Item::tags:
          for (size_t i = 0; i < item.entries.size(); i += kTagsPerBatch)
            client.log_batch(run_id_, json::array(), json::array(), json(std::vector<json>(item.entries.begin() + i, item.entries.begin() + std::min(item.entries.size(), i + kTagsPerBatch))));
          break;
        case Item::artifact: client.upload_artifact(artifact_uri_, item.path, item.name); break;
        case Item::end: client.update_run(run_id_, item.status, now_ms()); break;
      }
      std::lock_guard lock(mutex_);
      items_.pop_front();
      return;
    }
    if (from_file.lines > 0) {
      if (!batch.empty()) client.log_batch(run_id_, batch, json::array(), json::array());
      std::lock_guard lock(mutex_);
      consume_unsent(from_file);
      return;
    }
    if (batch.empty()) return;
    client.log_batch(run_id_, batch, json::array(), json::array());
    std::lock_guard lock(mutex_);
    metrics_.erase(metrics_.begin(), metrics_.begin() + static_cast<std::ptrdiff_t>(batch.size()));
  }

  // The next values of mlflow_unsent.jsonl from where the replay stands (mutex held). Lines that
  // are not JSON objects (a torn last line of a crashed session) are skipped.
  struct FileBatch {
    int64_t lines = 0;        // lines read, the skipped ones included
    std::streamoff end = 0;   // where the next batch starts
  };
  FileBatch read_unsent_batch(json& batch) {
    FileBatch out;
    std::ifstream in(fs::path(run_dir_) / kUnsentFile, std::ios::binary);
    in.seekg(replay_offset_);
    std::string line;
    while (batch.size() < kMetricsPerBatch && out.lines < in_file_ && std::getline(in, line)) {
      if (line.empty()) continue;
      ++out.lines;
      json entry = json::parse(line, nullptr, false);
      if (entry.is_object() && entry.contains("key") && entry.contains("value")) batch.push_back(std::move(entry));
    }
    out.end = in ? static_cast<std::streamoff>(in.tellg()) : replay_offset_;
    if (!in) {  // the end of the file: every line it has was read
      in.clear();
      in.seekg(0, std::ios::end);
      out.end = in.tellg();
    }
    if (out.lines == 0) out.lines = in_file_;  // nothing left to read: what was counted is gone
    return out;
  }

  // A batch of the file sent (or refused): the replay moves past it; the file goes once all of it
  // is sent (mutex held, so no value is being appended).
  void consume_unsent(const FileBatch& b) {
    in_file_ = std::max<int64_t>(0, in_file_ - b.lines);
    replay_offset_ = b.end;
    if (in_file_ == 0) {
      std::error_code ec;
      fs::remove(fs::path(run_dir_) / kUnsentFile, ec);
      replay_offset_ = 0;
    }
  }

  // The run this training logs to: the one a resumed run folder names, else a new one (its id
  // then kept in the run folder, written whole and renamed).
  void open_run(MlflowClient& client) {
    if (!resume_run_id_.empty()) {
      try {
        const auto run = client.get_run(resume_run_id_);
        client.update_run(run.id, "RUNNING", 0);
        run_id_ = run.id;
        artifact_uri_ = run.artifact_uri;
        return;
      } catch (const HttpError& e) {
        if (e.retry) throw;
        host_.log(ember::LogLevel::warn, "mlflow: run " + resume_run_id_ + " of the resumed folder is gone (" + e.what() + "); logging to a new run");
        resume_run_id_.clear();
      }
    }
    const std::string experiment_id = client.experiment_id(experiment_);
    const auto run = client.create_run(experiment_id, run_name_, now_ms(), json::array({tag("mlflow.source.name", "ember")}));
    run_id_ = run.id;
    artifact_uri_ = run.artifact_uri;
    const fs::path file = fs::path(run_dir_) / "mlflow_run.json", tmp = file.string() + ".tmp";
    std::ofstream(tmp) << json{{"tracking_uri", uri_}, {"experiment_id", experiment_id}, {"run_id", run_id_}}.dump() << '\n';
    std::error_code ec;
    fs::rename(tmp, file, ec);
    host_.log(ember::LogLevel::info, "mlflow: run " + run_id_ + " in experiment '" + experiment_ + "' at " + uri_);
  }

  // The server refused the front item (or batch): it is dropped and counted.
  void drop_front() {
    if (!items_.empty() && (items_.front().kind != Item::end || (metrics_.empty() && in_file_ == 0))) {
      items_.pop_front();
    } else if (metrics_.empty() && in_file_ > 0) {
      json refused = json::array();
      const FileBatch b = read_unsent_batch(refused);
      refused_ += b.lines;
      consume_unsent(b);
      return;
    } else {
      const size_t n = std::min(metrics_.size(), kMetricsPerBatch);
      refused_ += static_cast<int64_t>(n);
      metrics_.erase(metrics_.begin(), metrics_.begin() + static_cast<std::ptrdiff_t>(n));
      return;
    }
    ++refused_;
  }

  // The oldest `n` buffered metric values appended to mlflow_unsent.jsonl (one JSON object a line,
  // MLflow's fields). Called with the mutex held.
  void spill(size_t n) {
    if (n == 0) return;
    std::ofstream out(fs::path(run_dir_) / kUnsentFile, std::ios::app);
    for (size_t i = 0; i < n; ++i) out << metrics_[i].dump() << '\n';
    metrics_.erase(metrics_.begin(), metrics_.begin() + static_cast<std::ptrdiff_t>(n));
    in_file_ += static_cast<int64_t>(n);
  }

  // At the end: the file keeps only what was not sent (the replayed head cut off, written whole
  // and renamed), so it holds exactly the values the last line counts.
  void compact_unsent() {
    if (replay_offset_ == 0) return;
    const fs::path file = fs::path(run_dir_) / kUnsentFile, tmp = file.string() + ".tmp";
    {
      std::ifstream in(file, std::ios::binary);
      in.seekg(replay_offset_);
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      out << in.rdbuf();
    }
    std::error_code ec;
    fs::rename(tmp, file, ec);
    replay_offset_ = 0;
  }

  // One line for what did not reach the server; the metric values written to mlflow_unsent.jsonl.
  void report_unsent() {
    std::lock_guard lock(mutex_);
    if (metrics_.empty() && items_.empty() && refused_ == 0 && in_file_ == 0) return;
    std::string what;
    spill(metrics_.size());
    compact_unsent();
    if (in_file_ > 0) what = std::to_string(in_file_) + " metric values (kept in " + (fs::path(run_dir_) / kUnsentFile).string() + ")";
    if (!items_.empty()) what += (what.empty() ? "" : ", ") + std::to_string(items_.size()) + " params/tags/artifacts/run-end requests";
    if (refused_ > 0) what += (what.empty() ? "" : ", ") + std::to_string(refused_) + " values or requests the server refused";
    host_.log(ember::LogLevel::warn, "mlflow: not recorded on " + uri_ + ": " + what + "; last error: " + last_error_);
  }

  ember::IHost& host_;
  std::string uri_, experiment_, run_name_;
  bool log_checkpoint_;
  double flush_interval_s_, timeout_s_, finalize_timeout_s_;
  size_t max_buffered_;
  std::string run_dir_, resume_run_id_;
  std::string run_id_, artifact_uri_;  // the sender thread's
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Item> items_;
  std::deque<json> metrics_;
  bool stopping_ = false, abandon_ = false, done_ = false, warned_ = false;
  int64_t refused_ = 0;             // values or requests the server refused
  int64_t in_file_ = 0;             // values in mlflow_unsent.jsonl not sent yet
  std::streamoff replay_offset_ = 0;  // where in that file they start
  std::string last_error_;
  std::thread sender_;
};

ember::ILogger* make(ember::IHost& host, const ember::IConfig& cfg) { return new MlflowLogger(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::ILogger, "mlflow", "0.1.0", "Apache-2.0",
             "An MLflow tracking server over its REST API: params from the config, metrics in batches, tags, the config as an "
             "artifact; sent from a thread, retried, never stopping the run.",
             EMBER_CONFIG_KEYS(kKeys), make)
