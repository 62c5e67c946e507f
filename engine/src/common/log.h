// The engine's log: spdlog behind a narrow interface. Kept apart from LibTorch because LibTorch
// ships its own fmt headers, which must never meet Debian's fmt that spdlog is built with.
#pragma once
#include <ember/library.h>

#include <string_view>

namespace ember::log {

enum class Level { debug, info, warn, error, off };

// Sets the rank shown in every line ("[rank 1]" on non-zero ranks) and the minimum level.
EMBER_API void init(int rank, Level level);  // exported: the `engine` binary calls these
EMBER_API void set_level(Level level);
// Sets the rank shown in every line, keeping the level (--quiet / --verbose survive the launch).
EMBER_API void set_rank(int rank);
EMBER_API void write(Level level, std::string_view message);

inline void debug(std::string_view m) { write(Level::debug, m); }
inline void info(std::string_view m) { write(Level::info, m); }
inline void warn(std::string_view m) { write(Level::warn, m); }
inline void error(std::string_view m) { write(Level::error, m); }

}  // namespace ember::log
