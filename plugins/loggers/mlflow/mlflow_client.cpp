#include "mlflow_client.h"

#include <curl/curl.h>

#include <cstdio>
#include <memory>
#include <mutex>

namespace ember_mlflow {

namespace {

size_t append(char* data, size_t size, size_t count, void* out) {
  static_cast<std::string*>(out)->append(data, size * count);
  return size * count;
}

std::string escape(CURL* curl, const std::string& s) {
  std::unique_ptr<char, void (*)(void*)> e(curl_easy_escape(curl, s.c_str(), static_cast<int>(s.size())), curl_free);
  return e ? std::string(e.get()) : s;
}

}  // namespace

MlflowClient::MlflowClient(std::string tracking_uri, double timeout_s) : uri_(std::move(tracking_uri)), timeout_s_(timeout_s) {
  static std::once_flag init;
  std::call_once(init, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  while (!uri_.empty() && uri_.back() == '/') uri_.pop_back();
  curl_ = curl_easy_init();
}

MlflowClient::~MlflowClient() { curl_easy_cleanup(static_cast<CURL*>(curl_)); }

nlohmann::json MlflowClient::call(const std::string& method, const std::string& endpoint, const nlohmann::json& body) {
  CURL* curl = static_cast<CURL*>(curl_);
  curl_easy_reset(curl);
  const std::string url = uri_ + "/api/2.0/mlflow/" + endpoint;
  const std::string payload = method == "GET" ? std::string() : body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::string response;
  char error[CURL_ERROR_SIZE] = {0};
  std::unique_ptr<curl_slist, void (*)(curl_slist*)> headers(curl_slist_append(nullptr, "Content-Type: application/json"), curl_slist_free_all);
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers.get());
  if (method == "POST") {
    curl_easy_setopt(curl, CURLOPT_POSTFIELDS, payload.c_str());
    curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(payload.size()));
  }
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, append);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &response);
  curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, error);
  curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, static_cast<long>(timeout_s_ * 1000));
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  const CURLcode rc = curl_easy_perform(curl);
  if (rc != CURLE_OK) throw HttpError(url + ": " + (error[0] ? error : curl_easy_strerror(rc)), true);
  long status = 0;
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &status);
  nlohmann::json reply = nlohmann::json::parse(response, nullptr, /*allow_exceptions=*/false);
  if (status >= 300) {
    std::string message = reply.is_object() && reply.contains("message") ? reply["message"].get<std::string>() : response.substr(0, 200);
    if (reply.is_object() && reply.contains("error_code")) message = reply["error_code"].get<std::string>() + ": " + message;
    throw HttpError(url + ": HTTP " + std::to_string(status) + " " + message, status >= 500 || status == 429, status);
  }
  return reply.is_discarded() ? nlohmann::json::object() : reply;
}

std::string MlflowClient::experiment_id(const std::string& name) {
  try {
    const auto r = call("GET", "experiments/get-by-name?experiment_name=" + escape(static_cast<CURL*>(curl_), name), {});
    return r.at("experiment").at("experiment_id").get<std::string>();
  } catch (const HttpError& e) {
    if (e.status != 404) throw;
  }
  try {
    return call("POST", "experiments/create", {{"name", name}}).at("experiment_id").get<std::string>();
  } catch (const HttpError& e) {
    if (e.status != 400) throw;  // RESOURCE_ALREADY_EXISTS: another process made it meanwhile
    return call("GET", "experiments/get-by-name?experiment_name=" + escape(static_cast<CURL*>(curl_), name), {})
        .at("experiment").at("experiment_id").get<std::string>();
  }
}

MlflowClient::Run MlflowClient::create_run(const std::string& experiment_id, const std::string& run_name, int64_t start_ms, const nlohmann::json& tags) {
  const auto r = call("POST", "runs/create", {{"experiment_id", experiment_id}, {"run_name", run_name}, {"start_time", start_ms}, {"tags", tags}});
  return {r.at("run").at("info").at("run_id").get<std::string>(), r.at("run").at("info").value("artifact_uri", "")};
}

MlflowClient::Run MlflowClient::get_run(const std::string& run_id) {
  const auto r = call("GET", "runs/get?run_id=" + escape(static_cast<CURL*>(curl_), run_id), {});
  return {r.at("run").at("info").at("run_id").get<std::string>(), r.at("run").at("info").value("artifact_uri", "")};
}

void MlflowClient::log_batch(const std::string& run_id, const nlohmann::json& metrics, const nlohmann::json& params, const nlohmann::json& tags) {
  call("POST", "runs/log-batch", {{"run_id", run_id}, {"metrics", metrics}, {"params", params}, {"tags", tags}});
}

void MlflowClient::update_run(const std::string& run_id, const std::string& status, int64_t end_ms) {
  nlohmann::json body = {{"run_id", run_id}, {"status", status}};
  if (end_ms > 0) body["end_time"] = end_ms;
  call("POST", "runs/update", body);
}

void MlflowClient::upload_artifact(const std::string& artifact_uri, const std::string& path, const std::string& name) {
  const std::string scheme = "mlflow-artifacts:";
  if (artifact_uri.rfind(scheme, 0) != 0)
    throw HttpError("the run's artifacts go to " + artifact_uri + ", which the tracking server does not serve (start it with --serve-artifacts)", false);
  std::string rest = artifact_uri.substr(scheme.size());
  if (rest.rfind("//", 0) == 0) rest = rest.substr(rest.find('/', 2));  // mlflow-artifacts://host:port/path
  while (!rest.empty() && rest.front() == '/') rest.erase(0, 1);
  const std::string url = uri_ + "/api/2.0/mlflow-artifacts/artifacts/" + rest + "/" + name;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"), std::fclose);
  if (!file) throw HttpError("cannot read " + path, false);
  std::fseek(file.get(), 0, SEEK_END);
  const long size = std::ftell(file.get());
  std::rewind(file.get());
  CURL* curl = static_cast<CURL*>(curl_);
  curl_easy_reset(curl);
  std::string response;
  char error[CURL_ERROR_SIZE] = {0};
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_UPLOAD, 1L);
  curl_easy_setopt(curl, CURLOPT_READDATA, file.get());
  curl_easy_setopt(curl, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(size));
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, append);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &response);
  curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, error);
  // A large checkpoint takes its time; a stalled transfer (under 1 KB/s for 30 s) fails.
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_LIMIT, 1024L);
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_TIME, 30L);
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  const CURLcode rc = curl_easy_perform(curl);
  if (rc != CURLE_OK) throw HttpError(url + ": " + (error[0] ? error : curl_easy_strerror(rc)), true);
  long status = 0;
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &status);
  if (status >= 300) throw HttpError(url + ": HTTP " + std::to_string(status) + " " + response.substr(0, 200), status >= 500 || status == 429, status);
}

}  // namespace ember_mlflow
