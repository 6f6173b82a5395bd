#include "nixl/engine.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "common/nixl_log.h"
#include "nixl/registry.h"

namespace tether::nixl {

// A prepared transfer: its blocks grouped into runs per (local region, remote region), each run
// holding its own copies of the region handles, so a post never reads NIXL's metadata objects.
struct Request : nixlBackendReqH {
  nixl_xfer_op_t op = NIXL_WRITE;
  std::shared_ptr<Link> link;
  std::vector<Block> blocks;
  std::vector<Region> locals;         // one per run
  std::vector<RemoteRegion> remotes;  // one per run
  std::vector<BlockRun> runs;         // point into the three above (never resized after prep)
  Transfer transfer;
  bool posted = false;
  bool reported = false;              // its error was logged once
  // Posted while its link was reconnecting: it goes once the link is back, and fails once an attempt
  // begun after the post has failed or connect_timeout has passed (checkXfer drives it).
  bool waiting = false;
  uint64_t ended_at_post = 0;         // Link::ended when it was posted
  int64_t wait_until_ms = 0;
  std::string notify;                 // framed, for the post it waits to make
  Status failed;                      // why its wait for the link ended without a transfer
};

namespace {

constexpr char kNotifTag = 'N';

// A failed link's next connect starts no sooner than this after the previous one began, so callers
// posting to an agent that is gone do not start a connect each.
constexpr int64_t kRetryGapMs = 200;

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

bool usable(const Peer& p) { return p.state() && p.connected(); }

// A transfer failed because the link did (the peer is gone or silent): the link reconnects.
bool link_failed(Code c) { return c == Code::kConnectionLost || c == Code::kTimeout || c == Code::kProtocolError; }

const LocalMD* as_local(const nixlBackendMD* md) {
  auto* l = static_cast<const LocalMD*>(md);
  return l && l->magic == LocalMD::kMagic ? l : nullptr;
}
const RemoteMD* as_remote(const nixlBackendMD* md) {
  auto* r = static_cast<const RemoteMD*>(md);
  return r && r->magic == RemoteMD::kMagic ? r : nullptr;
}

// Backend parameters over TETHER_* variables over the defaults. The agent's name is the endpoint's
// name; a plugin endpoint listens on every interface unless told otherwise (NIXL agents talk across
// hosts; same-host peers still connect over loopback).
Result<Config> config_from(const nixlBackendInitParams* init) {
  Result<Config> env = Config::from_env();
  if (!env.is_ok()) return env.status();
  Config c = env.take();
  if (const char* h = std::getenv("TETHER_HOST"); !h || !*h) c.host = "0.0.0.0";
  if (init->customParams) {
    for (const auto& [key, value] : *init->customParams) {
      if (key == "name") return Status(Code::kInvalidArgument, "option name: the agent's name is the endpoint's name");
      if (value.empty()) continue;  // "" keeps the default (get_plugin_params lists some as "")
      Status s = c.set(key, value);
      if (!s.is_ok()) return s;
    }
  }
  c.name = init->localAgent;
  return c;
}

}  // namespace

nixl_status_t to_nixl(const Status& s) {
  switch (s.code()) {
    case Code::kOk: return NIXL_SUCCESS;
    case Code::kInvalidArgument:
    case Code::kOutOfRange: return NIXL_ERR_INVALID_PARAM;
    case Code::kNotFound: return NIXL_ERR_NOT_FOUND;
    case Code::kAccessDenied:
    case Code::kAuthFailed: return NIXL_ERR_NOT_ALLOWED;
    case Code::kTimeout:
    case Code::kConnectionLost: return NIXL_ERR_REMOTE_DISCONNECT;
    case Code::kCancelled: return NIXL_ERR_CANCELED;
    case Code::kTruncated: return NIXL_ERR_MISMATCH;
    case Code::kUnavailable: return NIXL_ERR_NOT_SUPPORTED;
    case Code::kResourceExhausted:  // the target's unread notifications are at their bound: NIXL has no "busy"
    case Code::kProtocolError:
    case Code::kInternal: return NIXL_ERR_BACKEND;
  }
  return NIXL_ERR_UNKNOWN;
}

TetherEngine::TetherEngine(const nixlBackendInitParams* init) : nixlBackendEngine(init) {
  Result<Config> c = config_from(init);
  if (!c.is_ok()) {
    NIXL_ERROR << "TETHER backend: " << c.status().message();
    initErr = true;
    return;
  }
  auto ep = Endpoint::create(c.value());
  if (!ep.is_ok()) {
    NIXL_ERROR << "TETHER backend: cannot create the endpoint: " << ep.status().to_string();
    initErr = true;
    return;
  }
  endpoint_ = std::shared_ptr<Endpoint>(ep.take().release());
  const std::string& me = init->localAgent;
  const uint16_t n = uint16_t(std::min<size_t>(me.size(), 0xffff));
  frame_prefix_.push_back(kNotifTag);
  frame_prefix_.append(reinterpret_cast<const char*>(&n), 2);
  frame_prefix_.append(me, 0, n);
  live_engines().add(this);
}

TetherEngine::~TetherEngine() {
  live_engines().remove(this);
  {
    std::lock_guard lock(spent_mu_);
    closing_ = true;
  }
  if (endpoint_) endpoint_->close();  // fails what is in flight: connects in progress end soon
  std::vector<std::shared_ptr<Link>> links;
  {
    std::lock_guard lock(links_mu_);
    for (auto& [name, l] : links_) links.push_back(l);
    links_.clear();
  }
  std::vector<std::shared_ptr<Attempt>> attempts;
  for (auto& l : links) {
    std::lock_guard lock(l->mu);
    l->dropped = true;
    if (l->attempt) attempts.push_back(std::move(l->attempt));
  }
  {
    std::lock_guard lock(spent_mu_);
    for (auto& [l, a] : spent_) attempts.push_back(std::move(a));
    spent_.clear();
  }
  for (auto& a : attempts)
    if (a->thread.joinable()) a->thread.join();
}

void TetherEngine::close_for_exit() {
  {
    std::lock_guard lock(spent_mu_);
    closing_ = true;
  }
  if (endpoint_) endpoint_->close();
}

// ---------------------------------------------------------------- memory

nixl_status_t TetherEngine::registerMem(const nixlBlobDesc& mem, const nixl_mem_t& nixl_mem, nixlBackendMD*& out) {
  if (nixl_mem != DRAM_SEG && nixl_mem != VRAM_SEG) return NIXL_ERR_NOT_SUPPORTED;
  const bool gpu = nixl_mem == VRAM_SEG;
  auto r = endpoint_->register_memory(reinterpret_cast<void*>(mem.addr), mem.len, gpu ? MemoryKind::kCuda : MemoryKind::kHost,
                                      gpu ? int(mem.devId) : -1);
  if (!r.is_ok()) {
    NIXL_ERROR << "TETHER registerMem: " << r.status().to_string();
    return to_nixl(r.status());
  }
  auto md = std::make_unique<LocalMD>();
  md->region = r.value();
  md->base = mem.addr;
  auto d = md->region.descriptor();
  if (!d.is_ok()) {
    (void)endpoint_->deregister(md->region);
    return to_nixl(d.status());
  }
  md->descriptor = std::move(d.value());
  out = md.release();
  return NIXL_SUCCESS;
}

nixl_status_t TetherEngine::deregisterMem(nixlBackendMD* meta) {
  const LocalMD* md = as_local(meta);
  if (!md) return NIXL_ERR_INVALID_PARAM;
  Status s = endpoint_->deregister(md->region);  // waits for transfers still using it
  delete md;
  return to_nixl(s);
}

nixl_status_t TetherEngine::getPublicData(const nixlBackendMD* meta, std::string& str) const {
  const LocalMD* md = as_local(meta);
  if (!md) return NIXL_ERR_INVALID_PARAM;
  str = md->descriptor;
  return NIXL_SUCCESS;
}

nixl_status_t TetherEngine::loadRemoteMD(const nixlBlobDesc& input, const nixl_mem_t& nixl_mem,
                                         const std::string& remote_agent, nixlBackendMD*& output) {
  if (nixl_mem != DRAM_SEG && nixl_mem != VRAM_SEG) return NIXL_ERR_NOT_SUPPORTED;
  auto r = RemoteRegion::parse(input.metaInfo);
  if (!r.is_ok()) {
    NIXL_ERROR << "TETHER loadRemoteMD from agent '" << remote_agent << "': " << r.status().message();
    return NIXL_ERR_INVALID_PARAM;
  }
  if (r.value().length < input.len || (r.value().kind == MemoryKind::kCuda) != (nixl_mem == VRAM_SEG)) {
    NIXL_ERROR << "TETHER loadRemoteMD from agent '" << remote_agent << "': the descriptor does not match the "
               << "registration it came with (" << input.len << " bytes of " << (nixl_mem == VRAM_SEG ? "VRAM" : "DRAM")
               << ")";
    return NIXL_ERR_MISMATCH;
  }
  auto md = std::make_unique<RemoteMD>();
  md->remote = std::move(r.value());
  md->base = input.addr;
  output = md.release();
  return NIXL_SUCCESS;
}

nixl_status_t TetherEngine::loadLocalMD(nixlBackendMD* input, nixlBackendMD*& output) {
  const LocalMD* l = as_local(input);
  if (!l) return NIXL_ERR_INVALID_PARAM;
  auto r = RemoteRegion::parse(l->descriptor);
  if (!r.is_ok()) return to_nixl(r.status());
  auto md = std::make_unique<RemoteMD>();
  md->remote = std::move(r.value());
  md->base = l->base;
  output = md.release();
  return NIXL_SUCCESS;
}

nixl_status_t TetherEngine::unloadMD(nixlBackendMD* input) {
  if (as_remote(input)) {
    delete static_cast<RemoteMD*>(input);
    return NIXL_SUCCESS;
  }
  return NIXL_ERR_INVALID_PARAM;
}

// ---------------------------------------------------------------- connections

nixl_status_t TetherEngine::getConnInfo(std::string& str) const {
  str = endpoint_->metadata();
  return NIXL_SUCCESS;
}

std::shared_ptr<Link> TetherEngine::find_link(const std::string& agent) const {
  std::lock_guard lock(links_mu_);
  auto it = links_.find(agent);
  return it == links_.end() ? nullptr : it->second;
}

std::shared_ptr<Link> TetherEngine::start_link(const std::string& agent, const std::string& conn_info) {
  auto link = std::make_shared<Link>();
  link->agent = agent;
  std::lock_guard lock(link->mu);
  link->conn_info = conn_info;
  begin_attempt(link, true);  // connecting starts now, so the first transfer rarely waits for it
  return link;
}

void TetherEngine::begin_attempt(const std::shared_ptr<Link>& link, bool awaited) const {
  if (link->attempt) {
    if (link->attempt->over) {
      link->attempt->thread.join();  // it only returns now
    } else {
      park(link, std::move(link->attempt));
    }
  }
  auto a = std::make_shared<Attempt>();
  link->attempt = a;
  link->connecting = true;
  link->awaited = awaited;
  link->error = Status::ok();
  link->tried_ms = now_ms();
  Attempt* self = a.get();  // kept by the link or by spent_ until joined
  a->thread = std::thread([link, self, ep = endpoint_, info = link->conn_info] {
    auto r = ep->connect(info);
    Peer stale;  // a connect nobody wants any more (the link was dropped, or its agent restarted)
    {
      std::lock_guard lock(link->mu);
      if (link->attempt.get() == self && !link->dropped) {
        link->connecting = false;
        ++link->ended;
        if (r.is_ok()) {
          link->peer = r.value();
          link->ever = true;
        } else {
          link->error = r.status();
        }
        link->cv.notify_all();
      } else if (r.is_ok()) {
        stale = r.value();
      }
      self->over = !stale.state();
    }
    if (!stale.state()) return;
    stale.close();
    std::lock_guard lock(link->mu);
    self->over = true;
  });
}

void TetherEngine::park(std::shared_ptr<Link> link, std::shared_ptr<Attempt> attempt) const {
  std::lock_guard lock(spent_mu_);
  spent_.emplace_back(std::move(link), std::move(attempt));
}

void TetherEngine::reap_spent() const {
  std::vector<std::pair<std::shared_ptr<Link>, std::shared_ptr<Attempt>>> mine, left;
  {
    std::lock_guard lock(spent_mu_);
    mine.swap(spent_);
  }
  for (auto& [link, a] : mine) {
    bool over;
    {
      std::lock_guard lock(link->mu);
      over = a->over;
    }
    if (over) {
      a->thread.join();
    } else {
      left.emplace_back(std::move(link), std::move(a));
    }
  }
  std::lock_guard lock(spent_mu_);
  for (auto& e : left) spent_.push_back(std::move(e));
}

void TetherEngine::revive(const std::shared_ptr<Link>& link) const {
  if (link->dropped || link->connecting || usable(link->peer)) return;
  if (now_ms() - link->tried_ms < kRetryGapMs) return;
  {
    std::lock_guard lock(spent_mu_);
    if (closing_) return;
  }
  if (link->peer.state())  // once per failure, not per attempt
    NIXL_WARN << "TETHER: the link to agent '" << link->agent << "' failed (" << link->peer.error().to_string()
              << "); reconnecting";
  link->peer = Peer();  // failed: its sockets, segments and threads are already let go
  begin_attempt(link, !link->ever);
}

Status TetherEngine::link_error(const Link& link) const {
  if (link.dropped) return Status(Code::kCancelled, "agent '" + link.agent + "' was removed");
  if (link.connecting) return Status(Code::kConnectionLost, "the link to agent '" + link.agent + "' is reconnecting");
  if (!link.error.is_ok()) return link.error;
  if (link.peer.state()) return link.peer.error();
  return Status(Code::kConnectionLost, "no link to agent '" + link.agent + "'");
}

void TetherEngine::drop(const std::shared_ptr<Link>& link) {
  Peer peer;
  {
    std::lock_guard lock(link->mu);
    link->dropped = true;
    peer = link->peer;  // kept on the link: requests still holding it report why
    if (link->attempt) {
      if (link->attempt->over) {
        link->attempt->thread.join();
        link->attempt.reset();
      } else {
        park(link, std::move(link->attempt));  // never block here on a connect in progress
      }
    }
    link->cv.notify_all();
  }
  if (usable(peer)) peer.close();  // its transfers end with Cancelled; its sockets and threads go now
}

nixl_status_t TetherEngine::loadRemoteConnInfo(const std::string& remote_agent, const std::string& remote_conn_info) {
  auto info = Endpoint::parse_metadata(remote_conn_info);
  if (!info.is_ok()) {
    NIXL_ERROR << "TETHER: connection info of agent '" << remote_agent << "': " << info.status().message();
    return NIXL_ERR_INVALID_PARAM;
  }
  reap_spent();
  std::shared_ptr<Link> link;
  {
    std::lock_guard lock(links_mu_);
    auto it = links_.find(remote_agent);
    if (it == links_.end()) {
      links_[remote_agent] = start_link(remote_agent, remote_conn_info);
      return NIXL_SUCCESS;
    }
    link = it->second;
  }
  Peer old;
  {
    std::lock_guard lock(link->mu);
    if (link->conn_info == remote_conn_info) {
      // The same agent: nothing to do while its link works; one that failed reconnects now, and the
      // next prepXfer waits for that connect as after a first add.
      if (link->connecting) {
        link->awaited = true;
      } else if (!usable(link->peer)) {
        link->peer = Peer();
        begin_attempt(link, true);
      }
      return NIXL_SUCCESS;
    }
    old = std::move(link->peer);  // the agent restarted under the same name: a new endpoint
    link->peer = Peer();
    link->conn_info = remote_conn_info;
    link->ever = false;
    begin_attempt(link, true);
  }
  if (usable(old)) old.close();
  return NIXL_SUCCESS;
}

nixl_status_t TetherEngine::connect(const std::string& remote_agent) {
  if (remote_agent == localAgent && !find_link(remote_agent)) {
    std::lock_guard lock(links_mu_);
    if (!links_.count(remote_agent)) links_[remote_agent] = start_link(remote_agent, endpoint_->metadata());
  }
  auto p = peer_for(remote_agent, true);
  if (!p.is_ok()) NIXL_ERROR << "TETHER connect to agent '" << remote_agent << "': " << p.status().message();
  return to_nixl(p.status());
}

nixl_status_t TetherEngine::disconnect(const std::string& remote_agent) {
  reap_spent();
  std::shared_ptr<Link> link;
  {
    std::lock_guard lock(links_mu_);
    auto it = links_.find(remote_agent);
    if (it == links_.end()) return NIXL_SUCCESS;
    link = it->second;
    links_.erase(it);
  }
  drop(link);
  return NIXL_SUCCESS;
}

Result<Peer> TetherEngine::peer_for(const std::string& agent, bool wait) const {
  std::shared_ptr<Link> link = find_link(agent);
  if (!link) return Status(Code::kNotFound, "no connection info loaded for agent '" + agent + "'");
  std::unique_lock lock(link->mu);
  if (usable(link->peer)) return link->peer;
  revive(link);
  if (link->connecting && (link->awaited || wait)) {
    // connect() itself ends by connect_timeout; the margin covers a slow handshake.
    const auto bound = std::chrono::milliseconds(endpoint_->config().connect_timeout_ms + 1000);
    if (!link->cv.wait_for(lock, bound, [&] { return !link->connecting || link->dropped; }))
      return Status(Code::kTimeout, "connecting to agent '" + agent + "' takes longer than connect_timeout");
  }
  if (usable(link->peer)) return link->peer;
  return link_error(*link);
}

// ---------------------------------------------------------------- transfers

nixl_status_t TetherEngine::prepXfer(const nixl_xfer_op_t& operation, const nixl_meta_dlist_t& local,
                                     const nixl_meta_dlist_t& remote, const std::string& remote_agent,
                                     nixlBackendReqH*& handle, const nixl_opt_b_args_t*) const {
  if (operation != NIXL_READ && operation != NIXL_WRITE) return NIXL_ERR_INVALID_PARAM;
  const int n = local.descCount();
  if (n != remote.descCount()) return NIXL_ERR_MISMATCH;
  auto p = peer_for(remote_agent);
  if (!p.is_ok()) {
    // A link that carried transfers before heals in the background: the request is prepared and its
    // posts fail until the link is back (NIXL_ERR_REMOTE_DISCONNECT), so nobody has to re-add the agent.
    std::shared_ptr<Link> link = find_link(remote_agent);
    bool heals = false;
    if (link) {
      std::lock_guard lock(link->mu);
      heals = link->ever && !link->dropped;
    }
    if (!heals) {
      NIXL_ERROR << "TETHER prepXfer to agent '" << remote_agent << "': " << p.status().message();
      return to_nixl(p.status());
    }
  }
  // Grouped by (local region, remote region), in their first-seen order and keeping the order of
  // blocks inside a group (NIXL promises no order within a request): a KV-cache request spread over
  // per-layer regions becomes one run per layer, however its descriptors interleave.
  struct Item {
    const LocalMD* l;
    const RemoteMD* r;
    int i;
  };
  std::vector<Item> items;
  items.reserve(size_t(n));
  for (int i = 0; i < n; ++i) {
    const LocalMD* l = as_local(local[i].metadataP);
    const RemoteMD* r = as_remote(remote[i].metadataP);
    if (!l || !r) return NIXL_ERR_INVALID_PARAM;
    if (local[i].len != remote[i].len || local[i].addr < l->base || remote[i].addr < r->base) return NIXL_ERR_INVALID_PARAM;
    items.push_back(Item{l, r, i});
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.l != b.l ? a.l < b.l : a.r < b.r;
  });
  auto req = std::make_unique<Request>();
  req->op = operation;
  req->link = find_link(remote_agent);
  req->blocks.reserve(size_t(n));
  for (size_t k = 0; k < items.size(); ++k) {
    const Item& it = items[k];
    req->blocks.push_back(Block{local[it.i].addr - it.l->base, remote[it.i].addr - it.r->base, local[it.i].len});
    if (k == 0 || it.l != items[k - 1].l || it.r != items[k - 1].r) {
      req->locals.push_back(it.l->region);
      req->remotes.push_back(it.r->remote);
    }
  }
  req->runs.reserve(req->locals.size());
  for (size_t k = 0, run = 0; k < items.size(); ++k) {
    if (k > 0 && (items[k].l != items[k - 1].l || items[k].r != items[k - 1].r)) ++run;
    if (run == req->runs.size()) req->runs.push_back(BlockRun{&req->locals[run], &req->remotes[run], &req->blocks[k], 0});
    ++req->runs.back().n;
  }
  handle = req.release();
  return NIXL_SUCCESS;
}

std::string TetherEngine::frame(const std::string& msg) const {
  std::string out;
  out.reserve(frame_prefix_.size() + msg.size());
  out.append(frame_prefix_);
  out.append(msg);
  return out;
}

nixl_status_t TetherEngine::postXfer(const nixl_xfer_op_t&, const nixl_meta_dlist_t&, const nixl_meta_dlist_t&,
                                     const std::string&, nixlBackendReqH*& handle,
                                     const nixl_opt_b_args_t* opt_args) const {
  auto* req = static_cast<Request*>(handle);
  if (req->posted && (req->waiting || !req->transfer.done())) return NIXL_ERR_REPOST_ACTIVE;
  req->notify = opt_args && opt_args->hasNotif ? frame(opt_args->notifMsg) : std::string();
  req->posted = true;
  req->reported = false;
  req->waiting = true;
  {
    std::lock_guard lock(req->link->mu);
    req->ended_at_post = req->link->ended;
  }
  req->wait_until_ms = now_ms() + int64_t(endpoint_->config().connect_timeout_ms);
  return checkXfer(handle);
}

// A post that waits for its link: starts the transfer once the link is usable (a failed link is asked
// to reconnect, never waited for here), or fails once a reconnect begun after the post has failed, the
// link was removed, or connect_timeout has passed. So the first transfer after a peer came back
// succeeds, and one to a peer that is gone fails as soon as a connect to it does.
nixl_status_t TetherEngine::start_waiting(Request& req) const {
  Peer peer;
  Status why;
  {
    std::lock_guard lock(req.link->mu);
    Link& link = *req.link;
    if (usable(link.peer)) {
      peer = link.peer;
    } else {
      revive(req.link);
      const bool tried = link.ended > req.ended_at_post && !link.connecting;
      if (link.dropped || tried || now_ms() >= req.wait_until_ms) why = link_error(link);
    }
  }
  if (!peer.state()) {
    if (why.is_ok()) return NIXL_IN_PROG;
    req.waiting = false;
    req.transfer = Transfer();
    req.reported = true;
    NIXL_ERROR << "TETHER transfer to agent '" << req.link->agent << "': " << why.to_string();
    req.failed = why;
    return to_nixl(why);
  }
  req.waiting = false;
  req.failed = Status::ok();
  req.transfer = req.op == NIXL_WRITE ? peer.writev(req.runs.data(), req.runs.size(), std::move(req.notify))
                                      : peer.readv(req.runs.data(), req.runs.size(), std::move(req.notify));
  return NIXL_SUCCESS;
}

nixl_status_t TetherEngine::checkXfer(nixlBackendReqH* handle) const {
  auto* req = static_cast<Request*>(handle);
  if (!req->posted) return NIXL_ERR_NOT_POSTED;
  if (req->waiting) {
    const nixl_status_t st = start_waiting(*req);
    if (st != NIXL_SUCCESS) return st;
  }
  if (!req->failed.is_ok()) return to_nixl(req->failed);
  if (!req->transfer.poll()) return NIXL_IN_PROG;
  const Status s = req->transfer.status();
  if (!s.is_ok() && !req->reported) {
    req->reported = true;
    NIXL_ERROR << "TETHER transfer to agent '" << req->link->agent << "': " << s.to_string();
    if (link_failed(s.code())) {  // the link failed under it: reconnect now, so the next post finds it back
      std::lock_guard lock(req->link->mu);
      revive(req->link);
    }
  }
  return to_nixl(s);
}

nixl_status_t TetherEngine::releaseReqH(nixlBackendReqH* handle) const {
  auto* req = static_cast<Request*>(handle);
  if (req->posted && !req->waiting && req->transfer.state()) req->transfer.cancel();  // no effect once done; never blocks
  delete req;
  return NIXL_SUCCESS;
}

// ---------------------------------------------------------------- notifications

nixl_status_t TetherEngine::getNotifs(notif_list_t& notif_list) {
  for (Notification& n : endpoint_->notifications()) {
    const std::string& d = n.data;
    uint16_t len = 0;
    if (d.size() >= 3 && d[0] == kNotifTag) std::memcpy(&len, d.data() + 1, 2);
    if (d.size() >= 3 && d[0] == kNotifTag && d.size() >= 3u + len) {
      notif_list.emplace_back(d.substr(3, len), d.substr(3 + len));
    } else {
      notif_list.emplace_back(n.peer_name, std::move(n.data));  // from a tether endpoint outside NIXL: as sent
    }
  }
  return NIXL_SUCCESS;
}

nixl_status_t TetherEngine::genNotif(const std::string& remote_agent, const std::string& msg) const {
  auto p = peer_for(remote_agent);
  if (!p.is_ok()) {
    NIXL_ERROR << "TETHER genNotif to agent '" << remote_agent << "': " << p.status().message();
    return to_nixl(p.status());
  }
  Transfer t = p.value().notify(frame(msg));
  if (t.done() && !t.status().is_ok()) {  // refused before sending (too large, peer gone)
    NIXL_ERROR << "TETHER genNotif to agent '" << remote_agent << "': " << t.status().message();
    return to_nixl(t.status());
  }
  return NIXL_SUCCESS;
}

}  // namespace tether::nixl
