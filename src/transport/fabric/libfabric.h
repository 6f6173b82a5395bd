// libfabric, loaded at run time. Only the library's exported functions go through dlsym;
// everything else in the libfabric API (fi_domain, fi_endpoint, fi_mr_reg, fi_writemsg, fi_cq_read,
// fi_close, ...) is a static inline wrapper in the headers that calls through the object's own ops
// table, so it works on objects this table created. The headers come from libfabric-dev at build
// time; nothing links against libfabric.so.
#pragma once
#include <rdma/fabric.h>

#include <cstdint>
#include <string>

namespace tether::transport::fabric {

struct Lib {
  uint32_t (*version)(void);
  int (*getinfo)(uint32_t, const char*, const char*, uint64_t, const struct fi_info*, struct fi_info**);
  void (*freeinfo)(struct fi_info*);
  struct fi_info* (*dupinfo)(const struct fi_info*);
  int (*fabric)(struct fi_fabric_attr*, struct fid_fabric**, void*);
  const char* (*strerror)(int);

  // `path` empty: TETHER_LIBFABRIC_SO's value comes in through Config; the default is the
  // system's libfabric.so.1. Loaded once per path and never unloaded (providers keep threads).
  // Null with *why set when the library or a symbol is missing.
  static const Lib* load(const std::string& path, std::string* why);

  std::string error(int rc) const;   // "fi_strerror text (-rc)"
  uint32_t major() const { return FI_MAJOR(version()); }
  uint32_t minor() const { return FI_MINOR(version()); }
};

// The API version we ask fi_getinfo for: what the headers we compiled against speak.
constexpr uint32_t kApiVersion = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION);

}  // namespace tether::transport::fabric
