#include "transport/fabric/libfabric.h"

#include <dlfcn.h>

#include <map>
#include <memory>
#include <mutex>

namespace tether::transport::fabric {

namespace {

template <typename F>
bool sym(void* h, const char* name, F* out, std::string* why) {
  *out = reinterpret_cast<F>(::dlsym(h, name));
  if (!*out) *why = std::string("symbol ") + name + " missing";
  return *out != nullptr;
}

}  // namespace

const Lib* Lib::load(const std::string& requested, std::string* why) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<Lib>> loaded;   // path -> table
  static std::map<std::string, std::string> failures;         // path -> why it failed
  const std::string path = requested.empty() ? "libfabric.so.1" : requested;
  std::lock_guard<std::mutex> lock(mu);
  auto fail = [&](const std::string& reason) -> const Lib* {
    *why = failures[path] = reason;
    return nullptr;
  };
  if (auto it = loaded.find(path); it != loaded.end()) return it->second.get();
  if (auto it = failures.find(path); it != failures.end()) return fail(it->second);
  void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = ::dlerror();
    return fail("cannot load " + path + ": " + (e ? e : "unknown error"));
  }
  auto lib = std::make_unique<Lib>();
  std::string missing;
  if (!sym(h, "fi_version", &lib->version, &missing) || !sym(h, "fi_getinfo", &lib->getinfo, &missing) ||
      !sym(h, "fi_freeinfo", &lib->freeinfo, &missing) || !sym(h, "fi_dupinfo", &lib->dupinfo, &missing) ||
      !sym(h, "fi_fabric", &lib->fabric, &missing) || !sym(h, "fi_strerror", &lib->strerror, &missing)) {
    ::dlclose(h);
    return fail(path + ": " + missing);
  }
  // An older library than our headers would misread the structs we hand it.
  if (lib->version() < FI_VERSION(1, 9))
    return fail(path + " is libfabric " + std::to_string(lib->major()) + "." + std::to_string(lib->minor()) +
                ", older than 1.9");
  return (loaded[path] = std::move(lib)).get();
}

std::string Lib::error(int rc) const {
  const int e = rc < 0 ? -rc : rc;
  return std::string(strerror(e)) + " (" + std::to_string(rc) + ")";
}

}  // namespace tether::transport::fabric
