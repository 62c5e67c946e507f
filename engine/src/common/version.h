#pragma once
namespace ember::engine {
inline constexpr const char* kEmberVersion = "0.1.0";
}
