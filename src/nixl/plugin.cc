// libplugin_TETHER.so: the entry points NIXL's plugin manager looks up, and the live-engine registry.
#include <cstdlib>

#include "common/nixl_log.h"
#include "nixl/engine.h"
#include "nixl/registry.h"

namespace tether::nixl {

void LiveEngines::add(TetherEngine* e) {
  std::lock_guard lock(mu_);
  e->next_live = head_;
  e->prev_live = nullptr;
  if (head_) head_->prev_live = e;
  head_ = e;
}

void LiveEngines::remove(TetherEngine* e) {
  std::lock_guard lock(mu_);
  if (e->prev_live) e->prev_live->next_live = e->next_live;
  if (e->next_live) e->next_live->prev_live = e->prev_live;
  if (head_ == e) head_ = e->next_live;
  e->next_live = e->prev_live = nullptr;
}

void LiveEngines::close_all() {
  std::lock_guard lock(mu_);
  for (TetherEngine* e = head_; e; e = e->next_live) e->close_for_exit();
}

LiveEngines& live_engines() {
  static LiveEngines engines;  // constant-initialized, trivially destructible
  return engines;
}

namespace {

nixlBackendEngine* create_engine(const nixlBackendInitParams* init) {
  try {
    return new TetherEngine(init);
  } catch (const std::exception& e) {
    NIXL_ERROR << "TETHER backend: " << e.what();
    return nullptr;
  }
}

void destroy_engine(nixlBackendEngine* engine) { delete engine; }
const char* plugin_name() { return "TETHER"; }
const char* plugin_version() { return TETHER_VERSION; }

// Every tether option with its value here (TETHER_* variables over the defaults), as
// get_plugin_params("TETHER") shows them; auth_token is never shown. An empty value keeps the default.
nixl_b_params_t backend_options() {
  Result<Config> env = Config::from_env();  // a bad variable: the defaults here; creating a backend says why
  Config c = env.is_ok() ? env.take() : Config();
  if (const char* h = std::getenv("TETHER_HOST"); !h || !*h) c.host = "0.0.0.0";
  nixl_b_params_t out;
  for (const std::string& name : Config::option_names())
    if (name != "name") out[name] = name == "auth_token" ? std::string() : c.get(name);
  return out;
}

nixl_mem_list_t backend_mems() { return {DRAM_SEG, VRAM_SEG}; }

nixlBackendPlugin g_plugin = {NIXL_PLUGIN_API_VERSION, create_engine, destroy_engine, plugin_name,
                              plugin_version, backend_options, backend_mems};

}  // namespace
}  // namespace tether::nixl

extern "C" {

NIXL_PLUGIN_EXPORT nixlBackendPlugin* nixl_plugin_init() {
  static const bool hooked = [] {
    std::atexit([] { tether::nixl::live_engines().close_all(); });
    return true;
  }();
  (void)hooked;
  return &tether::nixl::g_plugin;
}

NIXL_PLUGIN_EXPORT void nixl_plugin_fini() {}

}  // extern "C"
