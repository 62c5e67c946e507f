// Metrics logged by models and callbacks (Lightning's self.log). Values on a device stay tensors
// there; they are read back to the host only when the engine publishes them (every
// log_every_n_steps steps, at progress refresh and at epoch end), so a step never waits on the
// device just because something was logged. Values on the CPU (and numbers) are read at once and
// accumulated as doubles: there is no device to wait for, and a tensor op per logged value costs
// more than a small model's whole step does (bench/overhead.sh). Both give the same numbers.
#pragma once
#include <ember/types.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ember::engine {

class MetricStore {
 public:
  // Records a value from a step of `stage` (fit, validate, test, sanity_check).
  void log(const std::string& name, const at::Tensor& value, const LogOptions& options, Stage stage,
           int64_t batch_size);
  void log(const std::string& name, double value, const LogOptions& options, Stage stage, int64_t batch_size);
  // What log() accepts: a tensor of one element (std::invalid_argument naming the metric otherwise).
  static void require_scalar(const std::string& name, const at::Tensor& value);

  // Latest per-step values (name or name_step), read back now. Clears the pending step values.
  std::vector<std::pair<std::string, double>> take_step_values();
  // Progress-bar values: latest step values and finished epoch values marked prog_bar.
  std::vector<std::pair<std::string, double>> progress_values();

  // Reduces the epoch accumulators of `stage` (across ranks via `reduce` for sync_dist values),
  // publishes them to callback metrics and returns them (name or name_epoch). Resets them.
  using Reducer = std::function<at::Tensor(const at::Tensor&, ReduceOp)>;
  std::vector<std::pair<std::string, double>> finish_epoch(Stage stage, const Reducer& reduce);
  void discard_epoch(Stage stage);

  void set(const std::string& name, double value) { callback_metrics_[name] = value; }
  std::optional<double> get(const std::string& name) const;
  std::vector<std::string> names() const;
  const std::map<std::string, double>& callback_metrics() const { return callback_metrics_; }

 private:
  // A logged scalar: a tensor on a device, or a number already on the host.
  struct Value {
    at::Tensor device;  // undefined for a host value
    double host = 0;
    double read() const;  // reads a device value back (waits for the device)
  };
  struct StepValue {
    Value value;
    bool prog_bar = false;
    bool logger = true;
  };
  struct Accumulator {
    // Weighted sum (mean/sum) or running extreme (max/min): a device tensor while values come
    // from a device, else the host number host_sum.
    at::Tensor sum;
    double host_sum = 0;
    double weight = 0;    // total batch size (mean)
    bool started = false;     // a value was accumulated (a rank may have none: exact evaluation)
    bool configured = false;  // the options below were taken from the first log call
    Reduce reduce = Reduce::mean;
    bool prog_bar = false;
    bool logger = true;
    bool sync_dist = false;
    std::string key;      // name or name_epoch
    std::string plain;    // the name as logged
  };
  void record(const std::string& name, const Value& value, const LogOptions& options, Stage stage, int64_t batch_size);
  static void accumulate(Accumulator& acc, const Value& value, double weight);
  std::map<std::string, StepValue> step_values_;           // key -> latest value
  std::map<std::string, bool> step_prog_bar_;              // keys shown on the progress bar
  std::map<int, std::map<std::string, Accumulator>> epoch_;  // stage -> name -> accumulator
  std::map<std::string, double> callback_metrics_;
  std::map<std::string, bool> prog_bar_epoch_;
};

}  // namespace ember::engine
