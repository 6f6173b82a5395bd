// The plugin's live engines, so process exit can close their endpoints (a NIXL agent nobody
// destroyed would otherwise leave progress threads running while the process's statics are torn
// down). Trivially destructible: usable from exit handlers in any order.
#pragma once
#include <mutex>

namespace tether::nixl {

class TetherEngine;

class LiveEngines {
 public:
  void add(TetherEngine* e);
  void remove(TetherEngine* e);
  void close_all();  // exit: closes every live engine's endpoint, once

 private:
  std::mutex mu_;
  TetherEngine* head_ = nullptr;
};

LiveEngines& live_engines();

}  // namespace tether::nixl
