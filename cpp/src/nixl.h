// NIXL in the core (docs/protocol.md, "Pull and push over NIXL" and "NIXL leases";
// docs/security.md, "The NIXL path").
//
// NIXL is never a build dependency: its C API (libnixl_capi.so, the nixl-cu12 wheel's library
// behind NIXL's Rust bindings) is loaded at run time with dlopen from the path the embedder
// hands over (the Python package finds the wheel; Load). Every function of it we call is in
// one table (nixl_capi.h, Api), loaded only from the releases it was written against
// (kMinVersion, kEndVersion: Load checks the wheel's version first). The code: nixl_load.cc
// (loading, the version, the environment UCX runs in), nixl_cuda.cc (memory kinds),
// nixl_agent.cc (Agent), nixl_owner.cc (Owner), nixl_read.cc (ReadPath).
//
// The owner side (Owner): whether this process serves NIXL at all (consent, Refusal: the option,
// remote-accessible caches and the whole-process allowance: docs/security.md, "The NIXL path"), its agent
// (created at the first NIXL request, with every servable cache registered, later ones as they
// come, Registry hooks), NIXL grants (leases between NIXL_GRANT and RELEASE, kept by the
// connection: server.cc) and whole-cache NIXL leases, revoked on the reader's reverse channel
// (NIXL_REVOKE) before their memory goes, within kRevokeWait s or the reader's control
// connection is shut down. The agent is driven by a pump thread of ours that sleeps while no
// lease is open and beats fast while a connection's first NIXL read is under way (PumpFast),
// slowly otherwise: never a Python thread, never the GIL.
//
// Memory kinds (MemoryKind): a device-placed cache (CacheOptions::device) whose memory the CUDA
// runtime, loaded at run time, puts on a GPU is registered as NIXL VRAM with its device id, and
// grants, leases and the reader's own descriptor lists carry that kind; everything else is DRAM.
//
// Thread-safety: every method may be called from any thread. Lock order: the registry's hook
// mutex (its hooks run under it, not under its state mutex), then Owner's, then Agent's;
// nothing here calls the registry holding Owner's or Agent's.
#ifndef DATADIST_CPP_NIXL_H_
#define DATADIST_CPP_NIXL_H_

#include <sys/uio.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "net.h"
#include "registry.h"
#include "wire.h"

namespace datadist {
namespace nixl {

/// Seconds an owner waits for a reader to give a NIXL lease back (NIXL_REVOKE answered by OK).
constexpr double kRevokeWait = 5.0;
/// Seconds between two progress calls of the owner's pump: fast while a lease of a connection without a completed NIXL
/// read is open.
constexpr double kPumpFast = 50e-6;
constexpr double kPumpSlow = 2e-3;
/// NIXL cache leases one reader connection may hold (MAX_NIXL_LEASES_PER_PEER).
constexpr size_t kMaxLeasesPerPeer = 1024;

/// The NIXL releases whose C API the core is written against (nixl_capi.h): from
/// kMinVersion up to, not including, kEndVersion. NIXL's C API is the header of its Rust
/// bindings, not a stable ABI (between releases an enum was renumbered and arguments were
/// added), so a release outside this range is refused at Load rather than called. Widening it
/// means reading that release's src/bindings/rust/wrapper.h against nixl_capi.h and running
/// cpp/tests/nixl_test.cc and tests/core/test_nixl_path.py with it (docs/transports.md).
constexpr const char *kMinVersion = "1.5.0";
constexpr const char *kEndVersion = "1.6.0";
/// Names the version of a NIXL that is not installed from a wheel (no dist-info beside its
/// library): checked against the range as the wheel's would be.
constexpr const char *kVersionEnv = "DATADIST_NIXL_VERSION";

/// The version of the wheel that installed `library` (a path to libnixl_capi.so): the
/// `Version:` of the `<module>-<version>.dist-info/METADATA` in the site-packages folder above
/// the wheel's library folder (`.nixl_cu12.mesonpy.libs`, `nixl_cu12.libs`, or the package
/// folder itself). "" when there is none. Reads the file system only; never throws.
std::string WheelVersion(const std::string &library);
/// Why the core will not call NIXL `version` ("" when it is in [kMinVersion, kEndVersion)).
/// An empty or unparsable version is refused too. Pure.
std::string VersionRefusal(const std::string &version);

/// Loads NIXL's C API from `path` (libnixl_capi.so) once per process; later calls return
/// what the first one found. False with `why` when it cannot be loaded, is a release outside
/// [kMinVersion, kEndVersion) or of no version we can read (WheelVersion, else kVersionEnv),
/// or lacks a function. Blocks while the library loads.
bool Load(const std::string &path, std::string *why);
/// The version of the NIXL Load loaded ("" before a successful Load).
std::string LoadedVersion();
/// Was NIXL loaded (Load succeeded)?
bool Loaded();

/// Why UCX may carry NIXL here over a transport whose memory keys nothing checks ("" where it
/// cannot: UCX_TLS names only key-checked transports and the host has an RDMA device), as
/// core/nixl_wheel.py's unchecked_transports (`datadist info` prints it). Reads the environment; never throws.
std::string UncheckedTransports();
/// How a NIXL peer could reach memory never registered: UncheckedTransports, else UCX's
/// software RMA emulation. Never empty.
std::string WholeProcessReach();

/// The environment variable naming the CUDA runtime library the core asks (a path or a
/// soname); unset: libcudart.so, libcudart.so.12, libcudart.so.13, the first that loads.
constexpr const char *kCudartEnv = "DATADIST_CUDART_LIBRARY";

/// The NIXL memory kind (wire::kMemDram / kMemVram) and device id of some memory.
struct MemKind {
  uint8_t mem = wire::kMemDram;
  uint32_t device = 0;
  bool operator==(const MemKind &o) const { return mem == o.mem && device == o.device; }
  bool operator!=(const MemKind &o) const { return !(*this == o); }
};

/// The CUDA device `addr` lies on (cudaPointerGetAttributes says device or managed memory),
/// false for host memory or where no CUDA runtime loads (kCudartEnv). The runtime is loaded
/// with dlopen at the first call (per library named): CUDA is never a build dependency.
/// Never throws; may block while CUDA initialises.
bool CudaDevice(uint64_t addr, uint32_t *device);
/// What NIXL registers `addrs` as: DRAM unless
/// `device_placed`, then VRAM on the device CUDA names where every tensor is on that one
/// device, DRAM where none is on a device. LLM_FEATURE_NOT_ENABLED when they disagree (one
/// registration has one memory kind). Asks CUDA only for device-placed caches.
MemKind MemoryKind(const std::vector<uint64_t> &addrs, bool device_placed);

/// One NIXL agent (UCX backend, no progress or listener thread of NIXL's, strict thread sync).
class Agent {
 public:
  /// LLM_FEATURE_NOT_ENABLED when NIXL is not loaded or refuses to make the agent.
  explicit Agent(const std::string &name);
  ~Agent();
  Agent(const Agent &) = delete;
  Agent &operator=(const Agent &) = delete;
  const std::string &name() const { return name_; }
  /// Bumped on every registration and deregistration (NIXL_MD's generation).
  uint64_t generation();
  /// Registers `addrs` (`nbytes` each, memory of `kind`: DRAM, or VRAM on its device) under
  /// `key` (a cache entry); a key registered already: no-op. `is_private`: memory no peer may
  /// reach; while one is registered, Metadata refuses. LLM_FEATURE_NOT_ENABLED if NIXL refuses.
  void Register(const void *key, const std::vector<uint64_t> &addrs, uint64_t nbytes, bool is_private,
                MemKind kind = {});
  /// Deregisters what Register registered under `key`; unknown keys: no-op.
  void Deregister(const void *key);
  /// Is `key` registered (and so servable)? `kind` (if given): as what.
  bool Registered(const void *key, MemKind *kind = nullptr);
  /// One registered tensor: [start, end) and its memory kind.
  struct Span {
    uint64_t start, end;
    MemKind kind;
  };
  /// Every registered tensor, by address (tests, `_core.testing.nixl_regions`).
  std::vector<Span> Spans();
  /// NIXL_MD for a reader; LLM_FEATURE_NOT_ENABLED while private memory is registered.
  wire::NixlMd Metadata();
  /// One progress call (what the pump does each beat): for a caller that drives the agent
  /// while no lease is open (tests). Never blocks beyond NIXL's call.
  void Progress();
  /// A lease opened (closed): the pump beats while any is open; `fresh`: its connection has not
  /// completed a NIXL read yet.
  void PumpAcquire(bool fresh);
  void PumpRelease(bool fresh);
  /// Reader side: loads a peer's metadata; returns the agent name NIXL says it holds.
  /// LLM_LINK_FAILED when NIXL refuses it. Counted per name (DropRemote).
  std::string LoadRemote(const std::string &metadata);
  void DropRemote(const std::string &name);
  /// Do `local`'s spans all lie in memory registered here (NIXL moves only between those), all
  /// of one memory kind (set in `kind`)?
  bool Covers(const std::vector<iovec> &local, MemKind *kind);
  /// A prepared transfer: `op` 0 READ (from the peer into `local`), 1 WRITE, between `local`
  /// (registered here as `local_kind`) and the peer's `remote` spans (same total), of memory
  /// kind `remote_kind` (the owner's grant or lease says). LLM_LINK_FAILED if NIXL cannot
  /// prepare it. Released with Release.
  void *Prepare(int op, const std::string &remote_agent, const std::vector<iovec> &local, MemKind local_kind,
                const std::vector<iovec> &remote, MemKind remote_kind);
  /// Posts a prepared transfer and drives it until done: LLM_TIMEOUT past `deadline`,
  /// LLM_LINK_FAILED when NIXL reports an error or `peer_gone()` turns true (looked at every
  /// few polls); the handle is released then (the caller must not reuse it). Blocks.
  void Run(void *xfer, Deadline deadline, const std::function<bool()> &peer_gone);
  /// Transfers prepared so far (tests: identical pulls reuse theirs).
  uint64_t prepared() const { return prepared_; }
  /// Releases a prepared transfer; one NIXL cannot release yet is retried when the agent goes.
  void Release(void *xfer);
  /// Leases keeping the pump beating now, and of them those of connections without a
  /// completed NIXL read (the fast beat). Tests.
  size_t pump_users();
  size_t pump_fresh();

 private:
  void Pump();
  struct Region;
  std::string name_;
  void *agent_ = nullptr;    // nixl_capi_agent_t
  void *backend_ = nullptr;  // nixl_capi_backend_t
  void *opts_ = nullptr;     // nixl_capi_opt_args_t naming the backend
  void *notifs_ = nullptr;   // the pump's nixl_capi_notif_map_t
  std::mutex mu_;            // guards the fields below
  std::map<const void *, std::unique_ptr<Region>> regions_;
  std::multimap<uint64_t, std::pair<uint64_t, MemKind>> starts_;  // every registered tensor: address -> end, kind
  std::map<std::string, size_t> remotes_;                         // loaded peers' metadata, by the links using them
  std::vector<void *> stuck_;                                     // transfers NIXL could not release yet
  std::atomic<uint64_t> prepared_{0};
  size_t private_ = 0;
  uint64_t generation_ = 1;
  std::condition_variable pump_cv_;
  size_t users_ = 0, fresh_ = 0;
  bool closed_ = false;
  std::thread pump_;
};

/// What the owner side serves with (Python's EngineConfig: nixl_serve, nixl_whole_process).
struct ServeOptions {
  bool serve = false;          // datadist.NixlServe / DATADIST_NIXL_SERVE
  bool whole_process = false;  // datadist.NixlAllowWholeProcessAccess
  bool read = false;           // transport "nixl": our links read (and push) by NIXL
};

/// The owner side of NIXL for one engine (see the file's comment). Hooked into the engine's
/// registry (Registry::SetHooks) at construction.
class Owner {
 public:
  /// Sends NIXL_REVOKE for `lease_id` on the reverse channel of `cluster` whose link token is
  /// `token`, and waits for its OK by `deadline`; throws when it cannot (no such channel, no
  /// answer, another answer). The engine's (Engine::Open).
  using Revoker = std::function<void(uint64_t cluster, const std::string &token, uint64_t lease_id, Deadline deadline)>;
  /// Is the reverse channel of `cluster` up, and did it echo `token` (the asking connection's)?
  using ReverseUp = std::function<bool(uint64_t cluster, const std::string &token)>;

  Owner(Registry *registry, uint64_t cluster_id);
  ~Owner();
  Owner(const Owner &) = delete;
  Owner &operator=(const Owner &) = delete;
  /// Before serving (Engine::Open): the options, and how to reach readers' reverse channels.
  /// Whether peers may write our caches is the registry's (Registry::remote_writes).
  void Configure(const ServeOptions &options, Revoker revoke, ReverseUp reverse_up);
  /// The options alone (tests: serving turned off under a live agent is asked anew).
  void SetOptions(const ServeOptions &options);
  /// Why this process serves no NIXL reader ("": it does; datadist.testing.engine.nixl_refusal asks), asked
  /// on every NIXL request. Never blocks.
  std::string Refusal();
  /// The agent for a NIXL request, created (every servable cache registered) at the first;
  /// LLM_FEATURE_NOT_ENABLED with the refusal, or when NIXL is not there.
  std::shared_ptr<Agent> Serving();
  /// The agent if made already (null: none yet). For tests and the revocation path.
  std::shared_ptr<Agent> agent();
  /// The agent for a reader forced to NIXL (Engine::Open), made if need be with every cache
  /// registered (private ones marked so where we serve no NIXL: its metadata then goes to no
  /// one). LLM_PARAM_INVALID naming what to install when NIXL is not loaded.
  std::shared_ptr<Agent> Reading();
  /// Why a reader of ours may not link by NIXL here ("": it may): the whole-process
  /// allowance, where UCX may use transports that check no memory key (the reader's UCX
  /// serves the owner's too). Never blocks.
  std::string ReaderRefusal();

  /// NIXL_LEASE from a connection (`conn_key` identifies it, `conn` is shut down when a
  /// revoke is not answered in time, `cluster` / `token`: who asked): the lease, or an Error
  /// for the ERROR answer (docs/protocol.md, "NIXL leases"). Counted as serve_lease.
  wire::NixlLeased OpenLease(const void *conn_key, Conn *conn, uint64_t cluster, const std::string &token,
                             const wire::NixlLease &q);
  /// The connection `conn_key` ends: its NIXL leases end (no revoke: the reader's go with it).
  void DropConnection(const void *conn_key);
  /// Revokes every NIXL lease, waiting up to kRevokeWait for the readers (finalize, while the
  /// reverse channels are still up). Blocks.
  void RevokeAll();
  /// NIXL leases open now (tests).
  size_t leases();
  /// How long a reader has to answer a revoke (kRevokeWait; tests shorten it).
  void SetRevokeWait(double seconds);

 private:
  struct Held;
  std::shared_ptr<Agent> Make(const std::function<std::string()> &refusal);
  bool Registers(const Entry &e, bool *is_private);
  /// Registers `e` with `a` as its memory kind (MemoryKind), if it is to be (Registers);
  /// a refusal is logged, the cache then not served by NIXL.
  void Register(Agent &a, const Entry &e);
  void Added(const Entry &e);
  // Revokes the leases on `e` (null: every lease, not waited for); for one cache, blocks until
  // each reader gave its lease back or was cut off (at most the revoke wait + 1 s).
  void Going(const Entry *e);
  void Gone(const Entry &e);
  /// Ends the leases `ids` after revoking them on their readers' reverse channels (each
  /// reader within its kRevokeWait); run on a thread of its own.
  void RevokeReader(std::vector<uint64_t> ids, const std::shared_ptr<std::atomic<bool>> &done);
  void End(uint64_t id);
  void StartRevoking(std::vector<std::shared_ptr<Held>> doomed);

  Registry *registry_;
  const uint64_t cluster_id_;
  std::mutex create_mu_;  // one agent creation at a time (never held with mu_)
  std::mutex mu_;         // guards everything below
  ServeOptions options_;
  Revoker revoke_;
  ReverseUp reverse_up_;
  std::shared_ptr<Agent> agent_;
  std::map<uint64_t, std::shared_ptr<Held>> held_;  // NIXL cache leases by id
  uint64_t next_lease_ = 1;
  uint64_t epoch_ = 0;  // bumped by every Going: a lease opened across one is refused
  double revoke_wait_ = kRevokeWait;
  struct RevokeThread {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::vector<RevokeThread> revokers_;  // finished ones are joined when the next start
  std::condition_variable revoked_;     // a revoker finished, or a lease ended
  size_t revoking_ = 0;
  bool closed_ = false;
};

/// The reader side of one connection of a link forced to NIXL (docs/protocol.md, "Pull and
/// push over NIXL", "NIXL leases"). A pull by cache id or blocks key reads under a lease on the whole remote cache
/// (NIXL_LEASE, asked once per cache after a NIXL read completed on the connection): no request per pull, the bounds
/// checked here against the lease's geometry (CheckRequestAt, the owner's own checks), one NIXL READ. Other pulls (by
/// request key, with a checksum, the first, or where the owner grants no lease): NIXL_READ -> NIXL_GRANT, one NIXL
/// READ, RELEASE. Pushes: NIXL_WRITE -> NIXL_GRANT, one NIXL WRITE, RELEASE. The owner's metadata is reloaded when a
/// grant or lease names another agent or a newer generation. Prepared transfers for identical requests are kept
/// (kHandles). Used under its link's busy flag, except Revoke (the reverse channel's serving thread).
class ReadPath {
 public:
  static constexpr size_t kHandles = 32;       // HANDLE_CACHE
  static constexpr size_t kEarlyRevokes = 16;  // MAX_EARLY_REVOKES
  /// The link's control channel, as the path uses it.
  struct Channel {
    /// Sends a frame with a fresh request id and returns the answer (an ERROR is thrown with
    /// its code; a broken stream closes the connection).
    std::function<wire::Header(uint8_t type, const std::function<std::vector<uint8_t>(uint32_t rid)> &frame,
                               std::vector<uint8_t> &payload, Deadline deadline)>
        call;
    /// The next frame answering the last call (a CHECKSUM after a NIXL_GRANT).
    std::function<wire::Header(std::vector<uint8_t> &payload, Deadline deadline)> answer;
    /// Sends a frame that gets no answer (RELEASE), with the last call's request id.
    std::function<void(const std::function<std::vector<uint8_t>(uint32_t rid)> &frame, Deadline deadline)> send;
    std::function<bool()> peer_gone;  // the owner closed the connection (never blocks)
    std::function<bool()> closed;
    std::function<void()> close;
  };
  explicit ReadPath(std::shared_ptr<Agent> agent) : agent_(std::move(agent)) {}
  ~ReadPath() { Close(); }
  ReadPath(const ReadPath &) = delete;
  ReadPath &operator=(const ReadPath &) = delete;
  /// NIXL_MD_REQUEST and the metadata loaded: link time, and when a grant shows it changed.
  /// The owner's refusal is thrown with its code (LLM_FEATURE_NOT_ENABLED: it serves none).
  void Connect(Channel &ch, Deadline deadline);
  void Read(Channel &ch, const wire::Request &req, const std::vector<iovec> &local, Deadline deadline);
  void Write(Channel &ch, const wire::Request &req, const std::vector<iovec> &local, Deadline deadline);
  /// The owner revokes `lease_id` (NIXL_REVOKE on our reverse channel): no read under it
  /// starts any more. False if one is still in flight after `wait` s. Blocks up to `wait`.
  bool Revoke(uint64_t lease_id, double wait);
  /// Kept transfers released, the peer's metadata dropped, no lease read starts. Idempotent.
  void Close();
  const std::string &remote() const { return remote_; }
  size_t leases();  // tests

 private:
  struct Held;
  using LeaseKey = std::pair<uint8_t, uint64_t>;
  std::shared_ptr<Held> LeaseFor(Channel &ch, const wire::Request &req, Deadline deadline);
  void ReadLeased(Channel &ch, Held &held, const wire::Request &req, const std::vector<iovec> &local,
                  Deadline deadline);
  void ReadGranted(Channel &ch, const wire::Request &req, const std::vector<iovec> &local, Deadline deadline);
  void Refresh(Channel &ch, const std::string &agent, uint64_t generation, Deadline deadline);
  void Transfer(int op, Channel &ch, const std::vector<iovec> &local, const std::vector<iovec> &remote,
                MemKind remote_kind, Deadline deadline);
  void Forget();  // the kept transfers
  /// LLM_PARAM_INVALID unless `local` lies in memory our agent registered, of one kind (a
  /// device cache NIXL could not register as VRAM, a cache registered after a refusal).
  void Covered(const std::vector<iovec> &local);

  std::shared_ptr<Agent> agent_;
  std::string remote_;
  uint64_t generation_ = 0;
  bool wired_ = false;    // a NIXL read completed on this connection
  bool lease_ok_ = true;  // false once the owner refused a lease for want of a reverse channel
  std::list<std::pair<std::string, void *>> handles_;  // most recent first
  std::mutex mu_;                                      // guards the leases below (Revoke comes from another thread)
  std::condition_variable cv_;
  std::map<LeaseKey, std::shared_ptr<Held>> leases_;
  std::map<uint64_t, std::shared_ptr<Held>> lease_ids_;
  std::set<uint64_t> revoked_early_;
  bool asking_ = false;
};

}  // namespace nixl
}  // namespace datadist

#endif  // DATADIST_CPP_NIXL_H_
