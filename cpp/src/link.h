// Links: our client connections to remote clusters (LinkLlmClusters). One control connection
// per link, opened with HELLO / WELCOME; transfers on a link are serialised by its mutex and
// each carries a deadline. A connection a timeout or a dead peer broke is reopened, with a
// fresh handshake, on the next transfer. Transfers run on the caller's thread; a link's reverse
// channel (the listener's requests to us) has no thread of its own: it is parked on the
// process's I/O pool (iopool.h) and served there a request at a time.
//
// Path choice, on every connect: a peer whose WELCOME over TCP
// carries our boot id and FEATURE_LOCAL is greeted again on its local channel; if that works,
// the unix connection is the link's control channel and the TCP one is closed. Pulls then
// ask for grants and copy with process_vm_readv from the pid the kernel reported for that
// connection ("cma"), or, when that pid is not ours to read, stream over it ("local");
// pushes stream over the control channel. If the kernel refuses cross-memory attach, the link
// streams over the local channel from then on (until it reconnects).
//
// Whole-cache leases (docs/protocol.md, "Cache leases"): on the cma path, to an owner whose
// local WELCOME carries FEATURE_LEASE, the first pull (push) naming a cache by id asks
// LEASE_REQUEST (with LEASE_WRITE for pushes) once; later ones are checked against the lease
// and copied with process_vm_readv (_writev) under its fence, no frame sent, without taking
// the link (other threads' transfers run beside them). A revoked lease, a refused or failed
// copy, or an owner that exited send the transfer the request way, whose answer is its
// outcome. Leases are dropped when the link reconnects or closes.
#ifndef DATADIST_CPP_LINK_H_
#define DATADIST_CPP_LINK_H_

#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "errors.h"
#include "iopool.h"
#include "lease.h"
#include "net.h"
#include "nixl.h"
#include "registry.h"
#include "shm.h"
#include "tls.h"
#include "wire.h"

namespace datadist {

class Link {
 public:
  /// Our link to a listener. `secret`: the shared secret to prove, and to require the peer to
  /// prove (empty: none). `registry`: our caches, served to the peer on the link's reverse
  /// channel when the peer accepts one (null: no reverse channel).
  /// Same-host pulls of at most this many bytes stream over the local channel rather than
  /// being granted: one round trip, where a grant costs that round trip, a copy call and a
  /// RELEASE (measured: 16 KiB p50 ~7.5 us streamed, ~11 us granted).
  static constexpr uint64_t kGrantAbove = 64 << 10;
  /// `same_host`: may the link use the peer's local channel (false: TCP is forced).
  /// `grant_above`: see kGrantAbove (tests pass 0: every same-host pull is granted).
  Link(uint64_t remote_cluster_id, std::string host, uint16_t port, wire::Hello hello, std::string secret,
       Registry *registry, bool same_host = true, uint64_t grant_above = kGrantAbove)
      : remote_(remote_cluster_id),
        host_(std::move(host)),
        port_(port),
        hello_(std::move(hello)),
        secret_(std::move(secret)),
        registry_(registry),
        same_host_(same_host),
        grant_above_(grant_above) {}
  /// Our end of a client's link: the reverse channel it opened to our listener (handshake
  /// done), with the link token its HELLO echoed (that of the control channel it belongs to)
  /// and the key the listener's per-peer cap counts it by (its IP).
  /// It cannot be reopened from here: once it closes, transfers fail LLM_LINK_FAILED.
  /// `peer_eager`: the client's reverse HELLO set FEATURE_EAGER_WRITE (it serves a WRITE with
  /// flag EAGER on this channel), so our pushes on it take one round trip (Write).
  Link(uint64_t remote_cluster_id, std::unique_ptr<Conn> reverse_conn, std::string token = {},
       std::string peer_key = {}, bool peer_eager = false)
      : remote_(remote_cluster_id),
        conn_(std::move(reverse_conn)),
        reverse_end_(true),
        peer_eager_(peer_eager),
        token_(std::move(token)),
        peer_key_(std::move(peer_key)) {}
  ~Link();

  /// Connects and shakes hands within the deadline. LLM_LINK_FAILED / LLM_TIMEOUT.
  void Open(Deadline deadline);
  /// Our end of a client's link, adopted before its handshake ends: `adopt` (which makes the
  /// link reachable) runs with the link held, then the handshake's last `frame` goes out, so
  /// no transfer shares the socket with it and the link exists when the client's link returns.
  /// When `adopt` refuses (returns a non-empty reason), ERROR LLM_LINK_FAILED with that
  /// reason answers the handshake instead (the client's link fails with it); returns false.
  bool Adopted(const std::function<std::string()> &adopt, const std::vector<uint8_t> &frame, Deadline deadline);
  /// Pull: READ answered by READ_DATA and exactly the bytes `local` names. With flag CHECKSUM
  /// in `req` (verify.h) no cache lease is used, what landed is checked against the owner's
  /// CRC-32, and a mismatch is LLM_SUSPECT_REMOTE_ERROR ("checksum mismatch: ...").
  void Read(const wire::Request &req, const std::vector<iovec> &local, Deadline deadline);
  /// A pull under a whole-cache lease this link holds already, copied in the caller's thread:
  /// true once every byte moved. False when there is no such lease or it could not serve the
  /// pull (revoked, refused, failed: not done, Read handles those; a revoked lock-free read may
  /// have written `local`, which the READ then writes whole). Throws what
  /// the lease's checks refuse, as Read would. Never waits for the peer or the link (a leased
  /// copy takes neither): the issued pulls' inline path (cpp/python/module.cc).
  bool ReadLeasedNow(const wire::Request &req, const std::vector<iovec> &local);
  /// One pull of ReadPipelined: its request, where its bytes land, and its own deadline. The
  /// caller keeps all three unchanged until the pull ended.
  struct PipedRead {
    const wire::Request *req = nullptr;
    const std::vector<iovec> *local = nullptr;
    Deadline deadline{};
  };
  /// ReadPipelined's window: READs in flight at once on one connection, at most this many,
  /// with at most kPipeBytes of answers and kPipeFrames bytes of request frames (the owner
  /// reads a connection's next request only once its answer in progress is sent: what we
  /// send ahead must fit the socket buffers, or both ends would wait on each other). The
  /// first READ of a window is never held back by the bounds.
  static constexpr size_t kPipeCount = 16;
  static constexpr uint64_t kPipeBytes = 32ull << 20;
  static constexpr size_t kPipeFrames = 32 << 10;
  /// An answer read while it is the only READ in flight is read in parts, the window filled
  /// between them (pulls issued while the first answers arrive): this much first, then as
  /// much as arrived so far (a handful of parts for any size).
  static constexpr uint64_t kPipePart = 256 << 10;
  /// Issued pulls of this link run back to back, in order (the session's per-link queue of
  /// issued pulls, drained by one worker: Session::Submit). `at(i)`: the i-th pull (null: none
  /// yet; called with the link held, must not block); `ended(i, error)`: pull i ended, error
  /// null when its bytes are all in, else why it failed (each once, as soon as it ended, with
  /// the link held; must not throw). On a streamed path (TCP, the local stream) the link is
  /// taken once and READs are sent ahead, up to the window, while the answers are read in
  /// order: the owner, which serves a connection's requests in order, always has the next one
  /// (no round trip between pulls). Each pull keeps its outcome and its deadline: an ERROR
  /// fails that pull only (the stream stays in step); a broken connection or a pull's
  /// deadline passing closes the connection and fails it and every pull in flight behind it
  /// (LLM_LINK_FAILED, or LLM_TIMEOUT after a timeout); pulls not sent yet are left for the
  /// next call, which reconnects as a lone pull would. A pull whose deadline comes before one
  /// in flight ahead of it waits for the window to empty. While another transfer waits for
  /// the link (a blocking pull), no more READs are sent: the call returns once those in flight
  /// are in, and the next call takes the link only after the waiters had it. A checksummed pull (its verdict
  /// follows its answer), or any on another path (grants, leases, NIXL), runs alone, as Read
  /// runs it. Returns how many pulls, from 0, ended (at least 1 when at(0) gave one). Blocks
  /// up to the pulls' deadlines; throws only what is not an Error (bad_alloc), the pulls in
  /// flight then unended.
  size_t ReadPipelined(const std::function<const PipedRead *(size_t)> &at,
                       const std::function<void(size_t, const Error *)> &ended);
  /// Does the link stream pulls over its control channel now (TCP, or the local stream), so
  /// that ReadPipelined overlaps them? Never blocks.
  bool Streams() const {
    const Path p = path_;
    return p == Path::kTcp || p == Path::kLocalStream;
  }
  /// Push, on the caller's thread, blocking up to the deadline. To an owner whose WELCOME set
  /// FEATURE_EAGER_WRITE, a push of at most wire::kEagerMax bytes is one round trip: the WRITE
  /// (flag EAGER) and its bytes in one send (a sendmsg for a small push), then OK or ERROR.
  /// Larger pushes, and any to an owner without the bit: WRITE, go-ahead OK, the bytes,
  /// confirming OK. An ERROR raises its code (the connection stays: the owner drained the
  /// bytes); a broken or lying stream closes the connection (LLM_LINK_FAILED, or
  /// kSuspectRemoteError); LLM_TIMEOUT past the deadline.
  void Write(const wire::Request &req, const std::vector<iovec> &local, Deadline deadline);
  /// Tells the peer we leave (BYE), waiting for a transfer in flight up to the deadline:
  /// LLM_LINK_BUSY if it does not finish. With force, closes at once: a transfer in flight
  /// (its socket shut down) and those waiting for the link fail LLM_LINK_FAILED.
  void Close(Deadline deadline, bool force);
  /// A reverse channel whose client went away (unlinked, or ended): closed, or readable while
  /// idle (EOF). A link busy with a transfer is not gone. Never blocks.
  bool Gone();
  /// A PING answered by a PONG within the deadline (check_link): LLM_TIMEOUT,
  /// LLM_LINK_FAILED, LLM_LINK_BUSY. Reconnects a broken link as a transfer would.
  void Ping(Deadline deadline);
  /// The peer's transfer metrics (STATS_REQUEST answered by STATS): the JSON as it came, for
  /// the caller to parse. Reconnects a broken link as a transfer would. LLM_TIMEOUT,
  /// LLM_LINK_FAILED, LLM_LINK_BUSY; a peer without STATS breaks the protocol (ERROR, then
  /// close: kSuspectRemoteError). Blocks up to the deadline.
  std::string Stats(Deadline deadline);
  /// How our reverse channel answers the peer's STATS_REQUEST (set before Open; unset: refused).
  void SetStatsAnswer(std::function<std::string(uint64_t, const std::string &)> answer) { stats_ = std::move(answer); }
  /// A reverse end: NIXL_REVOKE for `lease_id` (one of the client's NIXL leases on our
  /// caches, nixl.h), answered by OK once no read of the client's is under it. Throws when the
  /// answer does not come by `deadline` (LLM_TIMEOUT, LLM_LINK_BUSY), the channel is gone
  /// (LLM_LINK_FAILED) or the client refuses (its ERROR's code). Blocks up to the deadline.
  void NixlRevoke(uint64_t lease_id, Deadline deadline);
  /// A reverse end: does its client answer a PING before `deadline`? Busy with a transfer
  /// counts as yes; no answer closes the channel. Called by the listener, without its own
  /// locks, before a newer reverse channel of the same id may replace this one. Blocks.
  bool AnswersPing(Deadline deadline);
  /// The cluster id the link is filed under: the one it was made with, or after Open the id
  /// the peer announced, when TakePeerId was called.
  uint64_t remote_cluster_id() const { return remote_; }
  /// A reverse end's link token (see the constructor); our link's: the one the peer issued.
  const std::string &link_token() const { return token_; }
  /// A reverse end's peer key (see the constructor).
  const std::string &peer_key() const { return peer_key_; }
  /// Which link this is, for the process's lifetime (1, 2, ... in the order links are made,
  /// never reused): tells a link that replaced another under the same cluster id from the one
  /// a caller saw (tests and tools; the Python binding's NativeLink compares by it).
  uint64_t serial() const { return serial_; }
  /// Before Open: the first handshake takes the peer's announced cluster id instead of
  /// refusing one that differs (CANN's LinkMsgHandler files a link under the peer's id and
  /// never compares). Later handshakes (reverse channel, local channel, reconnects) must meet
  /// that same id.
  void TakePeerId() { take_peer_id_ = true; }
  /// Before Open: every connection of the link (control, reverse and local channel, and
  /// reconnects) runs mutual TLS with `tls` before its HELLO (null: plain).
  void SetTls(std::shared_ptr<const tls::Context> tls) { tls_ = std::move(tls); }
  /// The data path pulls use now: "tcp", "cma" (grants and process_vm_readv above
  /// kGrantAbove bytes, the local stream below) or "local" (the bytes stream over the local
  /// channel), and why.
  enum class Path { kTcp, kCma, kLocalStream, kNixl };
  /// Before Open: the link is forced to NIXL (transport "nixl"): every connection asks the
  /// owner for its NIXL metadata (NIXL_MD_REQUEST) and, when it gets it, pulls and pushes by
  /// NIXL (nixl.h's ReadPath) on `agent`; an owner that serves no NIXL, or `refusal` (why
  /// this process may not: the whole-process allowance), leaves the connection on TCP, its
  /// path's reason saying why.
  void SetNixl(std::shared_ptr<nixl::Agent> agent, std::string refusal) {
    nixl_agent_ = std::move(agent);
    nixl_refusal_ = std::move(refusal);
  }
  /// NIXL leases on whole remote caches the current connection holds (tests).
  size_t nixl_leases();
  Path path() const { return path_; }
  /// Shared memory (shm.h) on the same-host path: `allow` (default on; off when cma is
  /// forced) asks owners for SHM grants and leases, and reads caches in their shareable
  /// memory by memcpy; `forced` (transport shm) names the path "shm". Before Open.
  void SetShm(bool allow, bool forced) {
    allow_shm_ = allow;
    shm_forced_ = forced;
  }
  /// path() by name, as the Python API names it: "shm" for kCma when shm is forced.
  const char *path_name() const;
  /// How the last pull (or leased push) moved its bytes: "shm", "cma", "stream" (over the
  /// control channel) or "" (none yet). For tests and tools.
  const char *last_moved() const;
  /// Why the link took its path (for `datadist info` and logs); "" before any choice.
  std::string PathReason() const;
  /// On the cma path: asks the kernel now whether it lets us read the owner's memory (one
  /// byte at address 0: the permission check comes before the copy, so EFAULT means allowed
  /// and nothing is read); a refusal is taken as a pull's would be (CmaRefused), so path()
  /// and PathReason() say what the first pull will do. Who calls: `datadist info --peer`,
  /// before any pull. Waits for the link's transfer in progress (<= deadline); Timeout.
  void ProbeCma(Deadline deadline);
  static const char *PathName(Path p);

 private:
  void Prepare(Deadline deadline);  // busy held: reconnect a broken connection
  void Connect(Deadline deadline);  // busy held: a fresh connection and handshake
  /// A new TCP connection with its handshake done (`reverse`: as our reverse channel). Sets
  /// `rid` to the last request id used and `welcome` to the peer's WELCOME.
  std::unique_ptr<Conn> Greet(bool reverse, Deadline deadline, uint32_t &rid, wire::Hello &welcome);
  /// HELLO / WELCOME (and the secret's proofs) on a connected `conn`.
  void Handshake(Conn &conn, bool reverse, Deadline deadline, uint32_t &rid, wire::Hello &welcome);
  /// After a TCP handshake: move to the peer's local channel if it is on this host.
  void TryLocal(const wire::Hello &welcome, Deadline deadline);
  void SetPath(Path p, const std::string &why);
  /// Same-host pull: GRANT (with SHM where that pays), then memcpy from the owner's mapped
  /// memfd (SHM_GRANT) or process_vm_readv (GRANT), RELEASE. False (nothing moved: the caller
  /// streams it) when the kernel refused cross-memory attach (the link then streams, or with
  /// shared memory keeps it for caches in it), or refuses it still and the cache is not in
  /// shared memory.
  bool ReadGranted(const wire::Request &req, const std::vector<iovec> &local, Deadline deadline);
  /// A streamed READ with CHECKSUM whose bytes landed: the owner's CHECKSUM frame, compared
  /// with what landed, and our verdict (RELEASE, lease 0, the READ's id); a mismatch throws
  /// (verify.h).
  void ReadVerdict(const std::vector<iovec> &local, Deadline deadline);
  /// The kernel refused cross-memory attach to the owner (`why`): with shared memory allowed
  /// the link keeps it for caches in it (no ptrace permission needed) and streams the rest;
  /// else it streams. Busy held.
  void CmaRefused(const std::string &why);
  /// A pull (push) under a whole-cache lease; false when there is none to use (nothing
  /// moved: the caller asks the owner). Throws the owner's refusals (LEASE_REQUEST's answer,
  /// or the checks it would make).
  bool TransferLeased(const wire::Request &req, const std::vector<iovec> &local, bool write, Deadline deadline);
  /// LEASE_REQUEST for `key` (takes the link); null when leases cannot work on this connection.
  using LeaseKey = std::tuple<uint8_t, uint64_t, bool>;  // key kind, cache / model id, write
  std::shared_ptr<lease::Leased> AskLease(const LeaseKey &key, Deadline deadline);
  void DropLeases(const std::shared_ptr<lease::Leased> &only = nullptr);
  void StopReverse();
  /// Busy held, at connect: the owner's NIXL metadata, and the path by NIXL or why not.
  void ConnectNixl(const wire::Hello &welcome, Deadline deadline);
  void DropNixl();
  nixl::ReadPath::Channel NixlChannel();
  wire::Header Call(const std::vector<uint8_t> &frame, std::vector<uint8_t> &payload, Deadline deadline);
  wire::Header Answer(std::vector<uint8_t> &payload, Deadline deadline);
  /// Held for one transfer; released by the guard's destructor.
  class Busy {
   public:
    explicit Busy(Link *link) : link_(link), unwinding_(std::uncaught_exceptions()) {}
    ~Busy() { link_->Release(std::uncaught_exceptions() > unwinding_); }
    Busy(const Busy &) = delete;
    Busy &operator=(const Busy &) = delete;

   private:
    Link *link_;
    int unwinding_;  // exceptions in flight when taken: more at the end, the transfer failed
  };
  /// Takes the link for one transfer by the deadline, else LLM_LINK_BUSY (as Python). A
  /// mutex and a flag rather than a timed mutex: ThreadSanitizer sees through these.
  /// `defer`: wait also while other callers wait for the link (ReadPipelined: the issued
  /// pulls' queue lets a blocking pull in between its windows, never ahead of it forever).
  std::unique_ptr<Busy> Acquire(Deadline deadline, bool timeout_if_late = true, bool defer = false);
  bool TryAcquire();
  /// Ends a transfer; `failed` (it threw): conn_ is no longer known to be at a frame's end.
  void Release(bool failed = false);

  uint64_t remote_;
  bool take_peer_id_ = false;  // see TakePeerId
  std::string host_;
  uint16_t port_;
  wire::Hello hello_;
  std::string secret_;
  std::shared_ptr<const tls::Context> tls_;  // see SetTls
  Registry *registry_ = nullptr;
  std::function<std::string(uint64_t, const std::string &)> stats_;  // see SetStatsAnswer
  /// Replaces conn_ (busy held) under mu_, so that a forced Close on another thread may
  /// shut the current connection down under a transfer in flight.
  void SetConn(std::unique_ptr<Conn> conn);
  std::mutex mu_;  // guards busy_ and shut_, and conn_'s replacement (SetConn)
  std::condition_variable idle_;
  bool busy_ = false;  // a transfer (or open / close) holds the fields below
  // Acquire calls waiting for the link, not deferring (changed under mu_): ReadPipelined sends
  // no more READs while one waits, and its next Acquire lets the waiters go first.
  std::atomic<int> waiting_{0};
  bool shut_ = false;           // closed by force while busy: no transfer may take the link again
  std::unique_ptr<Conn> conn_;  // replaced by SetConn only
  // When conn_ last gave a whole answer (Answer), in a transfer that did not fail: Prepare
  // takes a connection heard from within kFresh as open without asking the kernel (busy held).
  Deadline heard_{};
  uint32_t rid_ = 0;
  bool closing_ = false;
  bool reverse_end_ = false;   // conn_ is a client's reverse channel: no reconnect
  bool peer_reverse_ = false;  // the peer's WELCOME accepted reverse channels
  bool peer_eager_ = false;  // conn_'s WELCOME (a reverse end: the client's HELLO) set FEATURE_EAGER_WRITE (busy held)
  std::string token_;     // the link token the peer issued our control channel (conn_); a reverse end's: the one echoed
  std::string peer_key_;  // a reverse end's: the listener's per-peer key of its connection
  static uint64_t NextSerial() {
    static std::atomic<uint64_t> last{0};
    return last.fetch_add(1, std::memory_order_relaxed) + 1;
  }
  const uint64_t serial_ = NextSerial();  // see serial()
  bool same_host_ = true;                 // the local channel may be used
  uint64_t grant_above_ = kGrantAbove;
  std::atomic<Path> path_{Path::kTcp};
  mutable std::mutex why_mu_;  // guards why_ only
  std::string why_;
  pid_t peer_pid_ = 0;     // kCma: the pid SO_PEERCRED reported for conn_
  bool allow_shm_ = true;  // SetShm; cleared when the owner's shared memory cannot be mapped here
  bool shm_forced_ = false;
  std::atomic<bool> greeted_{false};      // a handshake succeeded once (Greet): reconnects say the peer stopped
  std::atomic<bool> cma_refused_{false};  // kCma with shared memory only (CmaRefused); per connection
  std::unique_ptr<shm::Maps> maps_;       // kCma: our mappings of the owner's memfds (busy_)
  enum class Moved { kNone, kStream, kCma, kShm };
  std::atomic<Moved> last_{Moved::kNone};
  // Whole-cache leases of the current connection. lease_mu_ guards these two only; copies
  // under a lease hold its shared_ptr, not the mutex.
  std::mutex lease_mu_;
  std::shared_ptr<lease::OwnerProc> lease_owner_;  // null: no leases on this connection
  std::map<LeaseKey, std::shared_ptr<lease::Leased>> leases_;
  uint64_t lease_seq_ = 0;                  // lease_mu_: the last Leased::seq given
  static constexpr size_t kMaxLeases = 64;  // kept per connection
  // Our reverse channel (client links): parked on the I/O pool (iopool.h) between the
  // listener's requests, served by a pool thread a request at a time, until unlink / finalize
  // (StopReverse). It is its own socket: our transfers (conn_, under busy_) never share it.
  // NIXL (SetNixl): the agent, why this process may not use it, and the current connection's
  // path (null: none; replaced under nixl_mu_, busy held, and read under it by the reverse
  // channel's NIXL_REVOKE).
  std::shared_ptr<nixl::Agent> nixl_agent_;
  std::string nixl_refusal_;
  std::mutex nixl_mu_;
  std::shared_ptr<nixl::ReadPath> nixl_;
  IoGroup rev_io_;
};

}  // namespace datadist

#endif  // DATADIST_CPP_LINK_H_
