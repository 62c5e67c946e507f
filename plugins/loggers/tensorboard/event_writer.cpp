#include "event_writer.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "record_io.h"
#include "tensorboard.pb.h"

namespace tb = ::ember::tb;

namespace ember_tb {

namespace {
std::runtime_error io_error(const std::string& what, const std::string& path) {
  return std::runtime_error(what + " " + path + ": " + std::strerror(errno));
}
}  // namespace

std::string event_file_name(double wall_time) {
  static std::atomic<int> counter{0};
  char host[256] = "localhost";
  ::gethostname(host, sizeof(host) - 1);
  host[sizeof(host) - 1] = '\0';
  return "events.out.tfevents." + std::to_string(static_cast<long long>(std::floor(wall_time))) + "." + host + "." +
         std::to_string(::getpid()) + "." + std::to_string(counter++);
}

EventWriter::EventWriter(const std::string& path, double wall_time) : path_(path) {
  file_ = std::fopen(path.c_str(), "wb");
  if (!file_) throw io_error("cannot create", path);
  tb::Event e;
  e.set_wall_time(wall_time);
  e.set_file_version("brain.Event:2");
  write(e.SerializeAsString());
  flush();
}

EventWriter::~EventWriter() {
  if (file_) std::fclose(file_);
}

void EventWriter::write(const std::string& serialized) {
  const std::string rec = frame_record(serialized);
  if (std::fwrite(rec.data(), 1, rec.size(), file_) != rec.size()) throw io_error("cannot write", path_);
}

void EventWriter::flush() {
  if (std::fflush(file_) != 0) throw io_error("cannot write", path_);
}

void EventWriter::scalars(const std::vector<std::pair<std::string, double>>& values, int64_t step, double wall_time) {
  tb::Event e;
  e.set_wall_time(wall_time);
  e.set_step(step);
  auto* s = e.mutable_summary();
  for (const auto& [tag, v] : values) {
    auto* val = s->add_value();
    val->set_tag(tag);
    val->set_simple_value(static_cast<float>(v));
  }
  write(e.SerializeAsString());
}

void EventWriter::histogram(const std::string& tag, const Histogram& h, int64_t step, double wall_time) {
  tb::Event e;
  e.set_wall_time(wall_time);
  e.set_step(step);
  auto* val = e.mutable_summary()->add_value();
  val->set_tag(tag);
  auto* p = val->mutable_histo();
  p->set_min(h.min);
  p->set_max(h.max);
  p->set_num(h.num);
  p->set_sum(h.sum);
  p->set_sum_squares(h.sum_squares);
  for (double x : h.bucket_limit) p->add_bucket_limit(x);
  for (double x : h.bucket) p->add_bucket(x);
  write(e.SerializeAsString());
}

void EventWriter::image(const std::string& tag, const std::string& png, int width, int height, int64_t step, double wall_time) {
  tb::Event e;
  e.set_wall_time(wall_time);
  e.set_step(step);
  auto* val = e.mutable_summary()->add_value();
  val->set_tag(tag);
  auto* img = val->mutable_image();
  img->set_height(height);
  img->set_width(width);
  img->set_colorspace(4);
  img->set_encoded_image_string(png);
  write(e.SerializeAsString());
}

void EventWriter::text(const std::string& tag, const std::string& markdown, int64_t step, double wall_time) {
  tb::Event e;
  e.set_wall_time(wall_time);
  e.set_step(step);
  auto* val = e.mutable_summary()->add_value();
  val->set_tag(tag);
  val->mutable_metadata()->mutable_plugin_data()->set_plugin_name("text");
  auto* t = val->mutable_tensor();
  t->set_dtype(7);  // DT_STRING
  t->mutable_tensor_shape();
  t->add_string_val(markdown);
  write(e.SerializeAsString());
}

namespace {
tb::Event hparams_summary(const char* tag, const tb::HParamsPluginData& data, double wall_time) {
  tb::Event e;
  e.set_wall_time(wall_time);
  auto* val = e.mutable_summary()->add_value();
  val->set_tag(tag);
  auto* pd = val->mutable_metadata()->mutable_plugin_data();
  pd->set_plugin_name("hparams");
  pd->set_content(data.SerializeAsString());
  return e;
}
}  // namespace

void EventWriter::hparams_start(const std::vector<std::pair<std::string, HParam>>& hparams, double wall_time) {
  tb::HParamsPluginData data;
  data.set_version(0);
  auto* info = data.mutable_session_start_info();
  info->set_start_time_secs(wall_time);
  for (const auto& [name, v] : hparams) {
    tb::ProtoValue pv;
    if (const auto* d = std::get_if<double>(&v)) pv.set_number_value(*d);
    else if (const auto* b = std::get_if<bool>(&v)) pv.set_bool_value(*b);
    else pv.set_string_value(std::get<std::string>(v));
    (*info->mutable_hparams())[name] = pv;
  }
  write(hparams_summary("_hparams_/session_start_info", data, wall_time).SerializeAsString());
}

void EventWriter::hparams_end(int status, double wall_time) {
  tb::HParamsPluginData data;
  data.set_version(0);
  auto* info = data.mutable_session_end_info();
  info->set_status(status);
  info->set_end_time_secs(wall_time);
  write(hparams_summary("_hparams_/session_end_info", data, wall_time).SerializeAsString());
}

void EventWriter::session_start(int64_t step, double wall_time) {
  tb::Event e;
  e.set_wall_time(wall_time);
  e.set_step(step);
  e.mutable_session_log()->set_status(tb::SessionLog::START);
  write(e.SerializeAsString());
}

}  // namespace ember_tb
