// Writes one TensorBoard event file. The protobuf messages stay inside event_writer.cpp, which is
// compiled without LibTorch's include folder (LibTorch ships protobuf 3.13 headers there, which
// would shadow Debian's): this header uses standard types only.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace ember_tb {

// A hyperparameter value as the HParams plugin shows it.
using HParam = std::variant<double, bool, std::string>;

struct Histogram {
  double min = 0, max = 0, num = 0, sum = 0, sum_squares = 0;
  std::vector<double> bucket_limit;  // right edge of each bucket (the last one is +max)
  std::vector<double> bucket;        // counts
};

// "events.out.tfevents.<unix seconds>.<host>.<pid>.<n>": TensorBoard reads any file whose name
// holds "tfevents", in name order (so a resumed run's newer file comes after the older one).
std::string event_file_name(double wall_time);

class EventWriter {
 public:
  // Creates `path` and writes the "brain.Event:2" version record. Throws std::runtime_error.
  EventWriter(const std::string& path, double wall_time);
  ~EventWriter();
  EventWriter(const EventWriter&) = delete;
  EventWriter& operator=(const EventWriter&) = delete;

  // One event holding every value (Summary.Value.simple_value, float32 like TensorBoard's).
  void scalars(const std::vector<std::pair<std::string, double>>& values, int64_t step, double wall_time);
  void histogram(const std::string& tag, const Histogram& h, int64_t step, double wall_time);
  // An image (Summary.Value.image: the "images" tab), `png` the encoded file, RGBA.
  void image(const std::string& tag, const std::string& png, int width, int height, int64_t step, double wall_time);
  // A text summary (the "text" plugin renders it as Markdown).
  void text(const std::string& tag, const std::string& markdown, int64_t step, double wall_time);
  // The HParams tab: _hparams_/session_start_info with these values.
  void hparams_start(const std::vector<std::pair<std::string, HParam>>& hparams, double wall_time);
  // _hparams_/session_end_info; status: 1 success, 2 failure, 0 unknown.
  void hparams_end(int status, double wall_time);
  // SessionLog START at `step`: TensorBoard drops the events at and after `step` that earlier
  // files hold (how a restarted TensorFlow job replaces the steps it logs again).
  void session_start(int64_t step, double wall_time);

  void flush();
  const std::string& path() const { return path_; }

 private:
  void write(const std::string& serialized_event);
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace ember_tb
