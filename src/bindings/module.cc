// Python module tether._tether: thin bindings over the C++ API. The Pythonic surface
// (keyword defaults, object registration, typed exceptions) lives in python/tether/.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/ndarray.h>

#include <unistd.h>

#include <atomic>
#include <deque>

#include "core/peer.h"
#include "core/wire.h"
#include "gpu/staging.h"
#include "sys/topology.h"
#include "tether/endpoint.h"
#include "transport/fabric/fabric_transport.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace tether;

namespace {

PyObject* g_errors[int(Code::kResourceExhausted) + 1] = {};
PyObject* g_base_error = nullptr;

[[noreturn]] void raise(const Status& s) {
  // A code from a newer (or hostile) peer that this build does not know is still a TetherError.
  const int c = int(s.code());
  PyObject* cls = c >= 0 && c <= int(Code::kResourceExhausted) && g_errors[c] ? g_errors[c] : g_base_error;
  PyErr_SetString(cls ? cls : PyExc_RuntimeError, s.message().c_str());
  throw nb::python_error();
}

void check(const Status& s) {
  if (!s.is_ok()) raise(s);
}

template <typename T>
T take(Result<T> r) {
  if (!r.is_ok()) raise(r.status());
  return r.take();
}

bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// A thread that re-takes the GIL after the interpreter began finalizing is ended by CPython with
// pthread_exit, whose forced unwind cannot pass nanobind's dispatcher (the process aborts). So at
// exit (python/tether/api.py, atexit) no call releases the GIL any more, endpoints are closed, and
// the threads still inside a released call are drained before finalization starts.
std::atomic<bool> g_exiting{false};
std::atomic<int> g_released{0};

template <typename F>
auto without_gil(F&& f) {
  if (g_exiting.load(std::memory_order_acquire)) return f();  // endpoints are closed: returns at once
  g_released.fetch_add(1);
  PyThreadState* ts = PyEval_SaveThread();
  auto r = f();
  if (finalizing())  // the drain at exit timed out on this thread: never touch Python again
    for (;;) ::pause();
  PyEval_RestoreThread(ts);
  g_released.fetch_sub(1);
  return r;
}

std::string as_string(const nb::bytes& b) { return std::string(b.c_str(), b.size()); }
nb::bytes as_bytes(const std::string& s) { return nb::bytes(s.data(), s.size()); }

// A RemoteRegion object is used in place; descriptor bytes are parsed into `parsed` (a deque: what
// it holds never moves). The pointer lives as long as `o` and `parsed`.
const RemoteRegion* remote_of(nb::handle o, std::deque<RemoteRegion>& parsed) {
  if (nb::isinstance<RemoteRegion>(o)) return nb::inst_ptr<RemoteRegion>(o);
  nb::object hex;  // a descriptor that crossed a text channel as .hex(), as write() and read() take it
  if (PyUnicode_Check(o.ptr())) {
    hex = nb::steal(PyObject_CallMethod(reinterpret_cast<PyObject*>(&PyBytes_Type), "fromhex", "O", o.ptr()));
    if (!hex.is_valid()) {
      PyErr_Clear();
      raise(Status(Code::kInvalidArgument, "a descriptor is bytes (or their .hex() text); got other text "
                                           "(base64 must be decoded first)"));
    }
    o = hex;
  }
  if (PyBytes_Check(o.ptr()))
    return &parsed.emplace_back(take(RemoteRegion::parse(std::string_view(PyBytes_AS_STRING(o.ptr()), size_t(PyBytes_GET_SIZE(o.ptr()))))));
  raise(Status(Code::kInvalidArgument, "remote must be descriptor bytes, their .hex() text or a RemoteRegion"));
}

RemoteRegion parse_remote(const nb::object& o) {
  std::deque<RemoteRegion> parsed;
  return *remote_of(o, parsed);
}

// The C++ Region inside a _tether.Region or a tether.Region (which holds one as `_r`).
const Region* region_of(nb::handle o, std::vector<nb::object>& keep) {
  if (nb::isinstance<Region>(o)) return nb::inst_ptr<Region>(o);
  PyObject* inner = PyObject_GetAttrString(o.ptr(), "_r");
  if (!inner) PyErr_Clear();
  nb::object r = nb::steal(inner);
  if (!r.is_valid() || !nb::isinstance<Region>(r)) throw nb::type_error("the local side of an entry must be a Region");
  keep.push_back(r);
  return nb::inst_ptr<Region>(r);
}

uint64_t as_u64(PyObject* o) {
  if (PyLong_CheckExact(o)) {  // the common case, without nanobind's generic conversion
    const unsigned long long v = PyLong_AsUnsignedLongLong(o);  // negative: OverflowError
    if (v == (unsigned long long)-1 && PyErr_Occurred()) throw nb::python_error();
    return v;
  }
  return nb::cast<uint64_t>(nb::handle(o));
}

// The tuples of writev/readv as runs of blocks for the core. Consecutive entries naming the same
// local and remote objects (by identity: a KV-cache list repeats one of each) share a run, so each
// object is looked at once, not once per entry, and nothing is copied per entry. Everything points
// into Python objects that `keep` holds: use it while the GIL is held.
struct Entries {
  std::vector<Block> blocks;
  std::vector<BlockRun> runs;
  std::deque<RemoteRegion> parsed;  // descriptors given as bytes, parsed once per object
  std::vector<nb::object> keep;     // every object a run points into (user code may drop the list's)
};

void parse_entries(nb::handle seq, Entries& out) {
  nb::object fast = nb::steal(PySequence_Fast(seq.ptr(), "entries must be a sequence of tuples"));
  if (!fast.is_valid()) throw nb::python_error();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast.ptr());
  out.blocks.reserve(size_t(n));  // runs point into it
  PyObject *last_local = nullptr, *last_remote = nullptr;
  const Region* local = nullptr;
  const RemoteRegion* remote = nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    // A list is read in place: user code (__index__, _r) run below could resize it.
    if (PySequence_Fast_GET_SIZE(fast.ptr()) != n) raise(Status(Code::kInvalidArgument, "entries changed while being read"));
    nb::object t = nb::borrow(PySequence_Fast_GET_ITEM(fast.ptr(), i));
    if (!PyTuple_Check(t.ptr()) || PyTuple_GET_SIZE(t.ptr()) != 5)
      raise(Status(Code::kInvalidArgument, "each entry is (local region, local offset, remote, remote offset, length)"));
    PyObject* lo = PyTuple_GET_ITEM(t.ptr(), 0);
    PyObject* ro = PyTuple_GET_ITEM(t.ptr(), 2);
    bool fresh = out.runs.empty();
    if (lo != last_local) {
      local = region_of(lo, out.keep);
      out.keep.push_back(nb::borrow(lo));  // its address stays unique while we compare against it
      last_local = lo;
      fresh = true;
    }
    if (ro != last_remote) {
      remote = remote_of(ro, out.parsed);
      out.keep.push_back(nb::borrow(ro));
      last_remote = ro;
      fresh = true;
    }
    const Block b{as_u64(PyTuple_GET_ITEM(t.ptr(), 1)), as_u64(PyTuple_GET_ITEM(t.ptr(), 3)),
                  as_u64(PyTuple_GET_ITEM(t.ptr(), 4))};
    out.blocks.push_back(b);
    if (fresh) out.runs.push_back(BlockRun{local, remote, &out.blocks.back(), 0});
    ++out.runs.back().n;
  }
}

Transfer post_entries(Peer& p, core::OpKind op, nb::handle entries, std::string notify) {
  Entries e;
  parse_entries(entries, e);
  return p.state()->post_rma(op, e.runs.data(), e.runs.size(), "entry", std::move(notify));
}

// One column of writev_blocks/readv_blocks: a 1-D C-contiguous uint64 array in host memory (api.py
// makes one of any integer sequence), read in place.
const uint64_t* column(nb::handle h, const char* name, size_t* n) {
  nb::ndarray<nb::ro> a;
  auto says = [&](const char* what) { return std::string(name) + what; };  // built only on the way out
  if (!nb::try_cast(h, a, false)) throw nb::type_error(says(" must be a uint64 array").c_str());
  if (a.device_type() != nb::device::cpu::value) throw nb::type_error(says(" must be in host memory").c_str());
  if (a.dtype() != nb::dtype<uint64_t>()) throw nb::type_error(says(" must have dtype uint64").c_str());
  if (a.ndim() != 1) throw nb::value_error(says(" must be one-dimensional").c_str());
  if (a.shape(0) > 1 && a.stride(0) != 1) throw nb::value_error(says(" must be contiguous").c_str());
  *n = a.shape(0);
  return static_cast<const uint64_t*>(a.data());
}

// writev_blocks/readv_blocks: block i is (local_offsets[i], remote_offsets[i], lengths[i]), or `lengths`
// for every block where it is an int; the columns are read in place (no table is built).
Transfer post_blocks(Peer& p, core::OpKind op, const Region& local, nb::handle remote, nb::handle local_offsets,
                     nb::handle remote_offsets, nb::handle lengths, std::string notify) {
  BlockRun run{&local, nullptr, nullptr, 0};
  size_t n_remote = 0, n_lengths = 0;
  run.local_offsets = column(local_offsets, "local_offsets", &run.n);
  run.remote_offsets = column(remote_offsets, "remote_offsets", &n_remote);
  if (n_remote != run.n)
    throw nb::value_error(("local_offsets has " + std::to_string(run.n) + " blocks but remote_offsets has " +
                           std::to_string(n_remote)).c_str());
  if (PyLong_Check(lengths.ptr())) {
    run.length = as_u64(lengths.ptr());
  } else if (run.lengths = column(lengths, "lengths", &n_lengths); n_lengths != run.n) {
    throw nb::value_error(("lengths has " + std::to_string(n_lengths) + " entries for " + std::to_string(run.n) +
                           " blocks").c_str());
  }
  std::deque<RemoteRegion> parsed;
  run.remote = remote_of(remote, parsed);
  return p.state()->post_rma(op, &run, 1, "block", std::move(notify));
}

}  // namespace

NB_MODULE(_tether, m) {
  m.doc() = "tether core (C++)";

  // Typed exceptions: every Code has its class; all derive from TetherError.
  PyObject* base = PyErr_NewException("tether.TetherError", PyExc_RuntimeError, nullptr);
  m.attr("TetherError") = nb::handle(base);
  g_base_error = base;
  struct Spec { Code code; const char* name; PyObject* also; };
  const Spec specs[] = {
      {Code::kInvalidArgument, "InvalidArgument", PyExc_ValueError},
      {Code::kNotFound, "RegionNotFound", PyExc_LookupError},
      {Code::kAccessDenied, "AccessDenied", PyExc_PermissionError},
      {Code::kOutOfRange, "OutOfRange", PyExc_IndexError},
      {Code::kTimeout, "TransferTimeout", PyExc_TimeoutError},
      {Code::kConnectionLost, "ConnectionLost", PyExc_ConnectionError},
      {Code::kProtocolError, "ProtocolError", nullptr},
      {Code::kAuthFailed, "AuthError", PyExc_PermissionError},
      {Code::kCancelled, "Cancelled", nullptr},
      {Code::kTruncated, "Truncated", nullptr},
      {Code::kUnavailable, "Unavailable", nullptr},
      {Code::kInternal, "InternalError", nullptr},
      {Code::kResourceExhausted, "ResourceExhausted", nullptr},
  };
  for (const Spec& s : specs) {
    PyObject* bases = s.also ? PyTuple_Pack(2, base, s.also) : PyTuple_Pack(1, base);
    std::string qual = std::string("tether.") + s.name;
    PyObject* cls = PyErr_NewException(qual.c_str(), bases, nullptr);
    Py_DECREF(bases);
    g_errors[int(s.code)] = cls;
    m.attr(s.name) = nb::handle(cls);
  }

  nb::class_<Config>(m, "Config")
      .def(nb::init<>())
      .def_static("from_env", [] { return take(Config::from_env()); })
      .def_static("check_process_env", [] { check(Config::check_process_env()); },
                  "InvalidArgument naming a process-wide TETHER_* variable whose value its row refuses")
      .def("set", [](Config& c, const std::string& option, const std::string& value) { check(c.set(option, value)); },
           "option"_a, "value"_a, "Sets an option from its text as a TETHER_* variable's is parsed (keyword units: "
           "seconds for timeouts); InvalidArgument names the option")
      .def("get", [](const Config& c, const std::string& option) { return c.get(option); }, "option"_a)
      .def_rw("host", &Config::host)
      .def_rw("port", &Config::port)
      .def_rw("channels", &Config::channels)
      .def_rw("chunk_bytes", &Config::chunk_bytes)
      .def_rw("ipc_gpu_chunk_bytes", &Config::ipc_gpu_chunk_bytes)
      .def_rw("ipc_one_sided_bytes", &Config::ipc_one_sided_bytes)
      .def_rw("window", &Config::window)
      .def_rw("socket_buffer", &Config::socket_buffer)
      .def_rw("connect_timeout_ms", &Config::connect_timeout_ms)
      .def_rw("peer_timeout_ms", &Config::peer_timeout_ms)
      .def_rw("heartbeat_ms", &Config::heartbeat_ms)
      .def_rw("handshake_timeout_ms", &Config::handshake_timeout_ms)
      .def_rw("busy_poll_us", &Config::busy_poll_us)
      .def_rw("auth_token", &Config::auth_token)
      .def_rw("name", &Config::name)
      .def_rw("transport", &Config::transport)
      .def_rw("net_plugin", &Config::net_plugin)
      .def_rw("net_comms", &Config::net_comms)
      .def_rw("net_bindings", &Config::net_bindings)
      .def_rw("unpack", &Config::unpack)
      .def_rw("nics", &Config::nics)
      .def_rw("control_nic", &Config::control_nic)
      .def_rw("tx_cpus", &Config::tx_cpus)
      .def_rw("rx_cpus", &Config::rx_cpus)
      .def_rw("pin_threads", &Config::pin_threads)
      .def_rw("lane_timeout_ms", &Config::lane_timeout_ms)
      .def_rw("deregister_timeout_ms", &Config::deregister_timeout_ms)
      .def_rw("disable_ipc", &Config::disable_ipc)
      .def_rw("ipc_host", &Config::ipc_host)
      .def_rw("fabric_library", &Config::fabric_library)
      .def_rw("fabric_provider", &Config::fabric_provider)
      .def_rw("fabric_domains", &Config::fabric_domains)
      .def_rw("fabric_rails", &Config::fabric_rails)
      .def_rw("fabric_delivery_complete", &Config::fabric_delivery_complete)
      .def_rw("fabric_busy_poll", &Config::fabric_busy_poll)
      .def_rw("notify_max_bytes", &Config::notify_max_bytes)
      .def_rw("notify_queue_peer_bytes", &Config::notify_queue_peer_bytes)
      .def_rw("notify_queue_bytes", &Config::notify_queue_bytes);

  nb::class_<RemoteRegion>(m, "RemoteRegion")
      .def("__init__", [](RemoteRegion* self, nb::bytes b) { new (self) RemoteRegion(take(RemoteRegion::parse(as_string(b)))); })
      .def_ro("region_id", &RemoteRegion::region_id)
      .def_ro("offset", &RemoteRegion::offset)
      .def_ro("length", &RemoteRegion::length)
      .def_prop_ro("device", [](const RemoteRegion& r) { return r.device; })
      .def_prop_ro("kind", [](const RemoteRegion& r) { return r.kind == MemoryKind::kHost ? "host" : "cuda"; })
      .def("__bytes__", [](const RemoteRegion& r) { return as_bytes(r.encode()); })
      .def("__repr__", [](const RemoteRegion& r) {
        return "RemoteRegion(region=" + std::to_string(r.region_id) + ", offset=" + std::to_string(r.offset) +
               ", length=" + std::to_string(r.length) + ")";
      });

  nb::class_<Region>(m, "Region")
      .def_prop_ro("id", &Region::id)
      .def_prop_ro("size", &Region::size)
      .def_prop_ro("ptr", [](const Region& r) { return reinterpret_cast<uintptr_t>(r.data()); })
      .def_prop_ro("readonly", &Region::readonly)
      .def_prop_ro("kind", [](const Region& r) { return r.kind() == MemoryKind::kHost ? "host" : "cuda"; })
      .def_prop_ro("device", &Region::device)
      .def("descriptor", [](const Region& r, uint64_t offset, std::optional<uint64_t> length) {
            return as_bytes(take(r.descriptor(offset, length.value_or(UINT64_MAX))));
          }, "offset"_a = 0, "length"_a = nb::none());

  nb::class_<Transfer>(m, "Transfer")
      .def("done", &Transfer::done)
      .def("cancel", &Transfer::cancel)
      .def("_wait", [](const Transfer& t, double timeout) {
            check(without_gil([&] { return t.wait(timeout < 0 ? -1 : int64_t(timeout * 1000.0)); }));
          }, "timeout"_a)
      .def_prop_ro("_code", [](const Transfer& t) { return int(t.status().code()); })
      .def_prop_ro("_message", [](const Transfer& t) { return t.status().message(); })
      .def_prop_ro("bytes", &Transfer::bytes);

  nb::class_<Peer>(m, "Peer")
      .def("write", [](Peer& p, const Region& l, uint64_t lo, nb::object r, uint64_t ro, uint64_t len, nb::bytes notify) {
            RemoteRegion rr = parse_remote(r);
            return p.write(l, lo, rr, ro, len, as_string(notify));
          })
      .def("read", [](Peer& p, const Region& l, uint64_t lo, nb::object r, uint64_t ro, uint64_t len, nb::bytes notify) {
            RemoteRegion rr = parse_remote(r);
            const Block b{lo, ro, len};
            return p.readv(l, rr, &b, 1, as_string(notify));
          })
      .def("writev", [](Peer& p, nb::handle entries, nb::bytes notify) {
            return post_entries(p, core::OpKind::kWrite, entries, as_string(notify));
          })
      .def("readv", [](Peer& p, nb::handle entries, nb::bytes notify) {
            return post_entries(p, core::OpKind::kRead, entries, as_string(notify));
          })
      .def("writev_blocks", [](Peer& p, const Region& l, nb::handle r, nb::handle lo, nb::handle ro, nb::handle len,
                               nb::bytes notify) {
            return post_blocks(p, core::OpKind::kWrite, l, r, lo, ro, len, as_string(notify));
          })
      .def("readv_blocks", [](Peer& p, const Region& l, nb::handle r, nb::handle lo, nb::handle ro, nb::handle len,
                              nb::bytes notify) {
            return post_blocks(p, core::OpKind::kRead, l, r, lo, ro, len, as_string(notify));
          })
      .def("send", &Peer::send)
      .def("recv", &Peer::recv)
      .def("notify", [](Peer& p, nb::bytes data) { return p.notify(as_string(data)); })
      .def_prop_ro("id", &Peer::id)
      .def_prop_ro("name", &Peer::name)
      .def_prop_ro("transport", &Peer::transport)
      .def_prop_ro("connected", &Peer::connected)
      .def_prop_ro("error", [](const Peer& p) { return p.error().to_string(); })
      .def("close", [](Peer& p) { without_gil([&] { p.close(); return 0; }); });  // waits for its threads to let go

  nb::class_<Endpoint>(m, "Endpoint")
      .def_static("create", [](const Config& c) { return take(Endpoint::create(c)); })
      .def_prop_ro("address", &Endpoint::address)
      .def_prop_ro("name", &Endpoint::name)
      .def("metadata", [](const Endpoint& e) { return as_bytes(e.metadata()); })
      .def("connect", [](Endpoint& e, nb::bytes target, double timeout) {
            std::string t = as_string(target);
            return take(without_gil([&] { return e.connect(t, timeout < 0 ? -1 : int64_t(timeout * 1000.0)); }));
          })
      .def("register_memory", [](Endpoint& e, uintptr_t ptr, uint64_t size, bool cuda, int device, bool readonly) {
            return take(e.register_memory(reinterpret_cast<void*>(ptr), size, cuda ? MemoryKind::kCuda : MemoryKind::kHost, device, readonly));
          })
      .def("deregister", [](Endpoint& e, const Region& r) {
            check(without_gil([&] { return e.deregister(r); }));
          })
      .def("notifications", [](Endpoint& e, double timeout) {
            std::vector<Notification> n = without_gil(
                [&] { return timeout > 0 ? e.wait_notifications(int64_t(timeout * 1000.0)) : e.notifications(); });
            nb::list out;
            for (auto& x : n) out.append(nb::make_tuple(x.peer_id, x.peer_name, as_bytes(x.data)));
            return out;
          })
      .def("peers", &Endpoint::peers)
      .def("transports", &Endpoint::transports)
      .def("stats", [](const Endpoint& e) {
            EndpointStats s = e.stats();
            nb::dict d;
            d["bytes_sent"] = s.bytes_sent;
            d["bytes_received"] = s.bytes_received;
            d["chunks_sent"] = s.chunks_sent;
            d["chunks_received"] = s.chunks_received;
            d["transfers_completed"] = s.transfers_completed;
            d["transfers_failed"] = s.transfers_failed;
            d["rejected_requests"] = s.rejected_requests;
            d["reads_pushed"] = s.reads_pushed;
            auto link = [](nb::dict& x, const LinkStats& l) {
              x["bytes_sent"] = l.bytes_sent;
              x["bytes_received"] = l.bytes_received;
              x["chunks_sent"] = l.chunks_sent;
              x["chunks_received"] = l.chunks_received;
              x["errors"] = l.errors;
              x["resends"] = l.resends;
              x["send_s"] = l.send_s;
              x["recv_s"] = l.recv_s;
              x["staging_s"] = l.staging_s;
              x["staging_slots_peak"] = l.staging_slots_peak;
            };
            nb::list nics, lanes;
            for (auto& n : s.nics) {
              nb::dict x;
              x["name"] = n.name;
              link(x, n.link);
              nics.append(x);
            }
            for (auto& l : s.lanes) {
              nb::dict x;
              x["peer_id"] = l.peer_id;
              x["peer"] = l.peer_name;
              x["lane"] = l.lane;
              x["alive"] = l.alive;
              x["local_nic"] = l.local_nic;
              x["local_addr"] = l.local_addr;
              x["remote_nic"] = l.remote_nic;
              x["remote_addr"] = l.remote_addr;
              link(x, l.link);
              lanes.append(x);
            }
            d["nics"] = nics;
            d["lanes"] = lanes;
            for (auto& [name, value] : s.transport_counters) d[name.c_str()] = value;
            return d;
          })
      .def("close", [](Endpoint& e) {
            without_gil([&] {
              e.close();
              return 0;
            });
          });

  m.attr("WIRE_VERSION") = tether::wire::kVersion;
  // GPU index of a raw pointer (-1: host memory, or no CUDA here).
  m.def("pointer_device", [](uintptr_t ptr) {
    tether::gpu::KeepContext keep;
    auto info = tether::gpu::pointer_info(reinterpret_cast<void*>(ptr));
    return info.is_ok() && info.value().is_device ? info.value().device : -1;
  });
  // (usable, why not) for GPU memory and for the unpack kernels.
  m.def("gpu_status", [] {
    tether::gpu::KeepContext keep;
    std::string why, kwhy;
    const bool cuda = tether::gpu::cuda(&why) != nullptr;
    const bool kernels = tether::gpu::kernels_available(&kwhy);
    return nb::make_tuple(cuda, why, tether::gpu::device_count(), kernels, kwhy);
  });
  // The option table (src/core/config.cc): one dict per knob. The Endpoint keywords and their
  // documentation, `tether doctor`'s effective configuration and the tests of README's table derive from it.
  m.def("options", [] {
    nb::list out;
    for (const Config::OptionInfo& o : Config::options()) {
      nb::dict d;
      d["keyword"] = o.keyword.empty() ? nb::none() : nb::cast(o.keyword);
      d["env"] = o.env;
      d["kind"] = o.kind;
      d["default"] = o.default_value;
      d["choices"] = o.choices;
      d["help"] = o.help;
      d["accepts"] = o.accepts;
      d["env_value"] = o.env_value.empty() ? nb::none() : nb::cast(o.env_value);
      out.append(d);
    }
    return out;
  });
  // What the C++ side decides for a Config on this host: NICs, their order, the control NIC, where
  // progress threads run, and (with a device's PCI path / NUMA node) the NIC ranking. The doctor shows it.
  m.def("topology", [](const Config& c, std::vector<std::tuple<std::string, int>> devices) {
        auto plan = take(sys::make_plan(c));
        auto nic_dict = [](const sys::Nic& n) {
          nb::dict x;
          x["name"] = n.name;
          nb::list addrs;
          for (auto& a : n.addrs) addrs.append(a.addr + "/" + std::to_string(a.prefix));
          x["addrs"] = addrs;
          x["up"] = n.up;
          x["loopback"] = n.loopback;
          x["speed_mbps"] = n.speed_mbps;
          x["numa_node"] = n.numa_node;
          x["pci_path"] = n.pci_path;
          x["local_cpus"] = sys::format_cpu_list(n.local_cpus);
          return x;
        };
        nb::dict d;
        nb::list all, data, threads, ranks;
        for (auto& n : plan.all) all.append(nic_dict(n));
        for (auto& n : plan.data) data.append(n.name);
        for (size_t t = 0; t < plan.threads.size(); ++t) {
          const auto& p = plan.threads[t];
          nb::dict x;
          x["thread"] = t;
          x["nic"] = p.nic >= 0 ? nb::object(nb::str(plan.data[size_t(p.nic)].name.c_str())) : nb::none();
          x["cpus"] = sys::format_cpu_list(p.cpus);
          x["why"] = p.why;
          threads.append(x);
        }
        for (auto& [path, numa] : devices) {
          nb::list order;
          for (size_t i : sys::rank_nics(plan.data, path, numa)) order.append(plan.data[i].name);
          ranks.append(order);
        }
        d["nics"] = all;
        d["data_nics"] = data;
        d["control_nic"] = plan.control >= 0 ? nb::object(nb::str(plan.all[size_t(plan.control)].name.c_str())) : nb::none();
        d["threads"] = threads;
        d["device_ranks"] = ranks;
        return d;
      }, "config"_a, "devices"_a = std::vector<std::tuple<std::string, int>>{});

  // The fabric rails a Config would use, each NIC's PCI location, and the rail order (domain names,
  // nearest first) for host memory and for each (device PCI path, NUMA node). The doctor shows it.
  m.def("fabric_rails", [](const Config& c, std::vector<std::tuple<std::string, int>> devices) {
        std::vector<std::pair<std::string, int>> devs;
        for (auto& [path, numa] : devices) devs.emplace_back(path, numa);
        transport::FabricRails r = without_gil([&] { return transport::fabric_rails(c, devs); });
        nb::dict d;
        d["why"] = r.why;
        d["provider"] = r.provider;
        nb::list rails, host, dev_orders;
        for (auto& x : r.rails) {
          nb::dict e;
          e["domain"] = x.domain;
          e["pci_path"] = x.pci_path.empty() ? nb::none() : nb::object(nb::str(x.pci_path.c_str()));
          e["numa_node"] = x.numa_node;
          rails.append(e);
        }
        auto names = [&](const std::vector<uint32_t>& order) {
          nb::list out;
          for (uint32_t i : order) out.append(r.rails[i].domain);
          return out;
        };
        d["rails"] = rails;
        d["host_numa"] = r.host_numa;
        d["host_order"] = names(r.host_order);
        for (auto& o : r.device_orders) dev_orders.append(names(o));
        d["device_orders"] = dev_orders;
        return d;
      }, "config"_a, "devices"_a = std::vector<std::tuple<std::string, int>>{});

  m.def("_begin_exit", [] { g_exiting.store(true, std::memory_order_release); });
  m.def("_threads_without_gil", [] { return g_released.load(); });
}
