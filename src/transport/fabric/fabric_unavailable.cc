// Built without libfabric headers: the fabric transport exists only to say why it cannot be used.
#include "transport/fabric/fabric_transport.h"

namespace tether::transport {
namespace {

class NoFabric final : public Transport {
 public:
  const char* name() const override { return "fabric"; }
  Caps caps() const override { return {}; }
  std::string unavailable_reason() const override {
    return "built without libfabric headers (apt install libfabric-dev, then rebuild)";
  }
  uint32_t lanes_for(std::string_view) const override { return 0; }
  Status attach(const std::shared_ptr<Link>&, const std::vector<int>&, std::string_view, bool, int64_t) override {
    return Status(Code::kUnavailable, unavailable_reason());
  }
  void wake(Link*, uint64_t, int) override {}
  void stop() override {}
};

}  // namespace

std::unique_ptr<Transport> make_fabric_transport(Host*) { return std::make_unique<NoFabric>(); }

FabricRails fabric_rails(const Config&, const std::vector<std::pair<std::string, int>>&) {
  FabricRails out;
  out.why = NoFabric().unavailable_reason();
  return out;
}

}  // namespace tether::transport
