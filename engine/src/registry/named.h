// A plugin object with the name and version it was loaded as (logs, checkpoints, messages).
#pragma once
#include <memory>
#include <string>

namespace ember::engine {

template <class T>
struct Named {
  std::string name;
  std::string version;
  std::shared_ptr<T> object;
};

}  // namespace ember::engine
