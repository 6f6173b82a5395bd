// TetherEngine: NIXL's backend contract (nixlBackendEngine) on tether's public C++ API.
//
// One tether Endpoint per NIXL agent. Connection info is the endpoint's metadata; a registration's
// public data is a tether descriptor of the whole region; a prepared request is a table of blocks
// grouped into runs per (local region, remote region), posted as one vectored tether transfer with
// the notification riding on it (delivered only after all of its data). Notifications carry the
// sending agent's name, so getNotifs() can say who sent them. docs/NIXL.md has the whole mapping.
#pragma once
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "nixl/backend_api.h"
#include "tether/endpoint.h"

namespace tether::nixl {

// NIXL's status for a tether error.
nixl_status_t to_nixl(const Status& s);

// A registered region (registerMem's output, the local side of transfers).
struct LocalMD : nixlBackendMD {
  LocalMD() : nixlBackendMD(true) {}
  uint32_t magic = kMagic;
  Region region;
  uintptr_t base = 0;      // the address NIXL registered
  std::string descriptor;  // the whole region, as getPublicData hands it out
  static constexpr uint32_t kMagic = 0x4c4d4454;
};

// A region another agent (or this one) registered: the remote side of transfers.
struct RemoteMD : nixlBackendMD {
  RemoteMD() : nixlBackendMD(false) {}
  uint32_t magic = kMagic;
  RemoteRegion remote;
  uintptr_t base = 0;      // its address in the agent that registered it
  static constexpr uint32_t kMagic = 0x524d4454;
};

// The link to one agent: connected in the background from loadRemoteConnInfo (or connect() to
// ourselves), waited for by whatever needs it first.
struct Link {
  std::string agent;
  std::string conn_info;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;       // the connect attempt ended (peer or error set)
  Peer peer;
  Status error;
  std::thread connector;
};

class TetherEngine final : public nixlBackendEngine {
 public:
  explicit TetherEngine(const nixlBackendInitParams* init);
  ~TetherEngine() override;

  bool supportsRemote() const override { return true; }
  bool supportsLocal() const override { return true; }
  bool supportsNotif() const override { return true; }
  nixl_mem_list_t getSupportedMems() const override { return {DRAM_SEG, VRAM_SEG}; }

  nixl_status_t registerMem(const nixlBlobDesc& mem, const nixl_mem_t& nixl_mem, nixlBackendMD*& out) override;
  nixl_status_t deregisterMem(nixlBackendMD* meta) override;
  nixl_status_t connect(const std::string& remote_agent) override;
  nixl_status_t disconnect(const std::string& remote_agent) override;
  nixl_status_t unloadMD(nixlBackendMD* input) override;

  nixl_status_t prepXfer(const nixl_xfer_op_t& operation, const nixl_meta_dlist_t& local,
                         const nixl_meta_dlist_t& remote, const std::string& remote_agent, nixlBackendReqH*& handle,
                         const nixl_opt_b_args_t* opt_args = nullptr) const override;
  nixl_status_t postXfer(const nixl_xfer_op_t& operation, const nixl_meta_dlist_t& local,
                         const nixl_meta_dlist_t& remote, const std::string& remote_agent, nixlBackendReqH*& handle,
                         const nixl_opt_b_args_t* opt_args = nullptr) const override;
  nixl_status_t checkXfer(nixlBackendReqH* handle) const override;
  nixl_status_t releaseReqH(nixlBackendReqH* handle) const override;

  nixl_status_t getPublicData(const nixlBackendMD* meta, std::string& str) const override;
  nixl_status_t getConnInfo(std::string& str) const override;
  nixl_status_t loadRemoteConnInfo(const std::string& remote_agent, const std::string& remote_conn_info) override;
  nixl_status_t loadRemoteMD(const nixlBlobDesc& input, const nixl_mem_t& nixl_mem, const std::string& remote_agent,
                             nixlBackendMD*& output) override;
  nixl_status_t loadLocalMD(nixlBackendMD* input, nixlBackendMD*& output) override;

  nixl_status_t getNotifs(notif_list_t& notif_list) override;
  nixl_status_t genNotif(const std::string& remote_agent, const std::string& msg) const override;

  // Process exit: closes the endpoint so no progress thread outlives the statics it uses.
  void close_for_exit();

 private:
  // The link to `agent`, connected (waits for a connect in progress, bounded by connect_timeout).
  Result<Peer> peer_for(const std::string& agent) const;
  std::shared_ptr<Link> find_link(const std::string& agent) const;
  std::shared_ptr<Link> start_link(const std::string& agent, const std::string& conn_info);
  // Wire form of a notification: 'N', the sender's name length (u16), the name, the message.
  std::string frame(const std::string& msg) const;

  std::shared_ptr<Endpoint> endpoint_;
  std::string frame_prefix_;
  mutable std::mutex links_mu_;
  std::unordered_map<std::string, std::shared_ptr<Link>> links_;
  std::vector<std::shared_ptr<Link>> retired_;  // disconnected links whose connect may still run

 public:
  TetherEngine* next_live = nullptr;  // the registry of live engines (plugin.cc)
  TetherEngine* prev_live = nullptr;
};

}  // namespace tether::nixl
