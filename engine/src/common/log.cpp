#include "common/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <memory>
#include <string>

namespace ember::log {
namespace {

std::shared_ptr<spdlog::logger>& logger() {
  static std::shared_ptr<spdlog::logger> instance = [] {
    auto l = spdlog::stderr_color_mt("ember");
    l->set_pattern("[%H:%M:%S] %^%l%$ %v");
    return l;
  }();
  return instance;
}

spdlog::level::level_enum to_spd(Level level) {
  switch (level) {
    case Level::debug: return spdlog::level::debug;
    case Level::info: return spdlog::level::info;
    case Level::warn: return spdlog::level::warn;
    case Level::error: return spdlog::level::err;
    case Level::off: return spdlog::level::off;
  }
  return spdlog::level::info;
}

}  // namespace

void set_rank(int rank) {
  logger()->set_pattern(rank == 0 ? std::string("[%H:%M:%S] %^%l%$ %v")
                                  : "[%H:%M:%S] [rank " + std::to_string(rank) + "] %^%l%$ %v");
}

void init(int rank, Level level) {
  set_rank(rank);
  logger()->set_level(to_spd(level));
}

void set_level(Level level) { logger()->set_level(to_spd(level)); }

void write(Level level, std::string_view message) {
  logger()->log(to_spd(level), "{}", message);
}

}  // namespace ember::log
