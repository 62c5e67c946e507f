// MLflow's REST API (/api/2.0/mlflow/...), the calls a training run needs: find or create the
// experiment, create or reopen a run, log batches of metrics / params / tags, upload an artifact
// to a server that serves them (mlflow-artifacts:), end the run. One libcurl handle, reused, on
// the logger's sender thread.
#pragma once
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

namespace ember_mlflow {

// A request that failed. `retry`: the server could not be reached or failed on its side (connection
// refused, a timeout, HTTP 5xx, 429): the same request may work later. Otherwise the server
// refused it (HTTP 4xx) and sending it again would not help.
struct HttpError : std::runtime_error {
  HttpError(const std::string& what, bool retry, long status = 0) : std::runtime_error(what), retry(retry), status(status) {}
  bool retry;
  long status;
};

class MlflowClient {
 public:
  MlflowClient(std::string tracking_uri, double timeout_s);
  ~MlflowClient();
  MlflowClient(const MlflowClient&) = delete;
  MlflowClient& operator=(const MlflowClient&) = delete;

  // The experiment's id, created when there is none of that name.
  std::string experiment_id(const std::string& name);
  struct Run {
    std::string id, artifact_uri;
  };
  Run create_run(const std::string& experiment_id, const std::string& run_name, int64_t start_ms, const nlohmann::json& tags);
  Run get_run(const std::string& run_id);
  // runs/log-batch; the caller keeps within MLflow's limits (1000 metrics, 100 params, 100 tags).
  void log_batch(const std::string& run_id, const nlohmann::json& metrics, const nlohmann::json& params, const nlohmann::json& tags);
  // status: RUNNING, FINISHED, FAILED or KILLED.
  void update_run(const std::string& run_id, const std::string& status, int64_t end_ms);
  // The file at `path` as <artifact root>/<name>. Throws HttpError(retry = false) when the run's
  // artifacts are not served by the server (an artifact_uri other than mlflow-artifacts:/...).
  void upload_artifact(const std::string& artifact_uri, const std::string& path, const std::string& name);

 private:
  nlohmann::json call(const std::string& method, const std::string& endpoint, const nlohmann::json& body);
  std::string uri_;
  double timeout_s_;
  void* curl_;
};

}  // namespace ember_mlflow
