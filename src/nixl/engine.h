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

// One connect running in the background (Endpoint::connect). Dropped only once its thread is joined.
struct Attempt {
  std::thread thread;
  bool over = false;  // set under the link's mu as the thread's last act: join() returns at once
};

// The link to one agent: connected in the background from loadRemoteConnInfo (or connect() to
// ourselves), waited for by whatever needs it first. A link whose peer failed heals: whatever finds
// it failed (a transfer, a prepXfer, add_remote_agent) starts the next attempt from the stored
// connection info (docs/NIXL.md, "Links heal").
struct Link {
  std::string agent;
  std::mutex mu;  // guards everything below
  std::condition_variable cv;
  std::string conn_info;
  std::shared_ptr<Attempt> attempt;  // the latest; its thread is joined (or parked) before the next starts
  bool connecting = false;  // `attempt` still runs
  bool awaited = false;     // callers wait for it: a first connect, or one add_remote_agent asked for
  bool ever = false;        // a connect succeeded once: a failure since heals without anyone waiting
  bool dropped = false;     // disconnected: an attempt that ends now closes what it got
  int64_t tried_ms = 0;     // when the latest attempt started
  uint64_t ended = 0;       // attempts that have ended (a post waiting for the link counts them)
  Peer peer;                // the latest attempt's (empty until one succeeded)
  Status error;             // the latest attempt's failure
};

struct Request;  // a prepared transfer (engine.cc)

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
  // The link to `agent`, connected. Waits (bounded by connect_timeout) for an attempt in progress that
  // callers await, or with `wait` for any; a failed link starts its next attempt (revive).
  Result<Peer> peer_for(const std::string& agent, bool wait = false) const;
  std::shared_ptr<Link> find_link(const std::string& agent) const;
  std::shared_ptr<Link> start_link(const std::string& agent, const std::string& conn_info);
  // Starts a connect for `link` (its mu held); the previous attempt's thread is joined, or parked
  // until it ends (it may be connecting to an agent that restarted).
  void begin_attempt(const std::shared_ptr<Link>& link, bool awaited) const;
  // The link's peer failed, or its last connect did: the next attempt starts, unless one runs, the
  // link was dropped, the engine closes, or the last attempt began under kRetryGapMs ago (mu held).
  void revive(const std::shared_ptr<Link>& link) const;
  // Why the link cannot carry a transfer now (mu held).
  Status link_error(const Link& link) const;
  // A post waiting for its link to come back: starts it, keeps it waiting (NIXL_IN_PROG) or fails it.
  nixl_status_t start_waiting(Request& req) const;
  // Takes a link out of use (disconnect): closes its peer, joins or parks its attempt.
  void drop(const std::shared_ptr<Link>& link);
  void park(std::shared_ptr<Link> link, std::shared_ptr<Attempt> attempt) const;
  void reap_spent() const;  // joins parked attempts that are over
  // Wire form of a notification: 'N', the sender's name length (u16), the name, the message.
  std::string frame(const std::string& msg) const;

  std::shared_ptr<Endpoint> endpoint_;
  std::string frame_prefix_;
  mutable std::mutex links_mu_;
  std::unordered_map<std::string, std::shared_ptr<Link>> links_;
  mutable std::mutex spent_mu_;  // taken after a link's mu, never before
  mutable std::vector<std::pair<std::shared_ptr<Link>, std::shared_ptr<Attempt>>> spent_;  // parked attempts
  bool closing_ = false;         // (spent_mu_) the endpoint closes: no new attempt

 public:
  TetherEngine* next_live = nullptr;  // the registry of live engines (plugin.cc)
  TetherEngine* prev_live = nullptr;
};

}  // namespace tether::nixl
