// Serving: a listener that accepts peers (over TCP and, on one host, the local channel) and
// serves their connections as the owner side of the protocol (handshake, READ, same-host
// GRANT and RELEASE, WRITE, PING, BYE), over the registry.
//
// Threads: one accept thread per listener; everything else runs on the I/O pool's fixed set
// of threads (iopool.h), shared with every other listener and link of the process. Each
// connection is a state machine with its own buffers (server.cc's PeerStream): the frame it
// is reading, its header first, grown only as its bytes arrive (never to the length a header
// declares; at most 64 KiB past what came); the answers it has still to send. A pool thread
// woken for it reads what the socket holds, non-blocking; when a frame is whole it serves it,
// and parks the connection again when the socket has nothing more. Answers go the same way:
// small ones (ERROR, PONG, OK, GRANT, STATS...) are queued and sent as the socket takes them,
// a READ's data is sent from the registered memory under its lease, and a WRITE's data is
// received into it, each as far as the socket allows, the connection parked for EPOLLOUT
// (or EPOLLIN) in between with the lease held. The handshake runs the same way (TLS's, then
// HELLO, then AUTH when there is a secret). So no pool thread waits on a peer, and a
// server's thread count does not grow with its connections. A step serves the frames one read
// brought (at most 2 KiB of read-ahead) and moves at most 8 MiB of a transfer before it parks
// the connection again (ready at once),
// so a busy peer shares the threads; what a linked peer may still cost the others is CPU (its
// requests' work: a checksum, a large request's decoding), never a wait on its own bytes
// (docs/reliability.md). A reverse channel's adoption (ReverseHandler), which may wait on a
// PING of the channel it replaces, runs on the server's adopter threads (Server::Adopt).
//
// Deadlines, kept as the parked connection's timer (closed past one): 10 s from the accept
// for the whole handshake; 30 s for a frame from its first byte; 120 s for an answer (a READ's
// data and CHECKSUM) from when it was queued, and for a WRITE's data from its request.
//
// Budgets: at most `max_conns` connections (256) and `max_per_peer` from one IP address or,
// on the local channel, one uid (64), as before; besides, connections still in their
// handshake are counted apart, in small budgets of their own: 32 from one address or uid
// (at most max_per_peer; 2 from a uid that may not read this process: on the local channel
// it gains nothing a TCP stranger does not have), max_conns / 4 in all (64; but at least
// min(max_conns, 32)). So strangers, who cost a parked connection each (a descriptor and a
// few KiB: pre-auth frames are 4 KiB at most), can hold at most a quarter of the connections
// for 10 s each, and never a thread; linked peers keep the rest. When that total is full, a
// newcomer whose address holds fewer handshakes than the heaviest holder (by more than one)
// is let in and that holder's oldest handshake is shut down (EvictShakingLocked): strangers
// must come from max_conns / 4 addresses (64), not two, to keep a new peer's handshake out.
// A stranger on the same address (or uid) as an honest peer shares its budget: 32 stalled
// handshakes from one address keep that address's next handshake out until one ends.
//
// Start() binds and returns at once; Stop() stops accepting, joins the accept thread, removes
// every parked connection and waits for those being served (a step, which never waits on
// its peer).
#ifndef DATADIST_CPP_SERVER_H_
#define DATADIST_CPP_SERVER_H_

#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "iopool.h"
#include "local.h"
#include "net.h"
#include "registry.h"
#include "tls.h"

namespace datadist {
namespace nixl {
class Owner;  // nixl.h
}  // namespace nixl
}  // namespace datadist

namespace datadist {

class PeerStream;  // server.cc: a connection's buffers between its steps

/// The answer to a peer's STATS_REQUEST (metrics.h's StatsJson): `peer` is the cluster id the
/// connection announced, `token` the link token of its control channel ("" on a reverse
/// channel). Called on a serving thread; takes short locks only.
using StatsAnswer = std::function<std::string(uint64_t peer, const std::string &token)>;

struct Identity {
  uint64_t cluster_id = 0;
  std::atomic<int32_t> role{0};
  std::string secret;        // shared secret peers must prove (empty: none); set before serving
  bool serve_local = true;   // serve the local channel too (off when TCP is forced)
  bool allow_ptrace = true;  // may PR_SET_PTRACER_ANY be set for same-host readers (Yama 1)
  /// Mutual TLS on every accepted connection, the local channel's too (null: none); set
  /// before serving. Over the caps, a TLS listener closes without a word (no handshake spent).
  std::shared_ptr<const tls::Context> tls;
  /// Called (on a serving thread, no lock of the server held) each time a peer's control
  /// channel completes its handshake, with the cluster id it announced: two-sided links see
  /// a member join by it. Set before serving; may be empty.
  std::function<void(uint64_t)> on_control;
  /// Answers peers' STATS_REQUEST; set before serving (empty: refused, FEATURE_NOT_ENABLED).
  StatsAnswer stats;
  /// Serves NIXL requests (nixl.h); null: each is refused with LLM_FEATURE_NOT_ENABLED.
  nixl::Owner *nixl = nullptr;
};

/// Same-host grants outstanding per peer process (by its kernel-verified pid), over all its
/// connections to one server; and the ptrace permission, asked for at the first grant and
/// given back when the book goes (the server stops). Thread-safe.
class GrantBook {
 public:
  explicit GrantBook(bool allow_ptrace) : allow_ptrace_(allow_ptrace) {}
  ~GrantBook();
  GrantBook(const GrantBook &) = delete;
  GrantBook &operator=(const GrantBook &) = delete;
  /// One more grant to `pid`; LLM_LINK_BUSY when it holds kMaxGrantsPerPeer already.
  /// `cma`: it is read with cross-memory attach (not from shared memory): the first such
  /// grant lets same-user readers attach.
  void Take(pid_t pid, bool cma = true);
  void Drop(pid_t pid);
  /// A whole-cache lease was given (not counted: a lease holds no memory of ours, its fence
  /// does): let same-user readers attach, as the first grant does.
  void AllowReaders();
  /// No more grants (the server stopped): gives the ptrace permission back.
  void Close();

 private:
  std::mutex mu_;
  std::map<pid_t, size_t> held_;
  bool allow_ptrace_;
  bool ptracer_ = false;  // we hold local::Ptracer
};

/// What a connection is served with.
struct ServeContext {
  Registry *registry = nullptr;
  /// Set for a local-channel connection: who the kernel says the peer is, and the book its
  /// grants count in. Null (TCP, reverse channels): grants are refused.
  const local::Cred *peer = nullptr;
  GrantBook *grants = nullptr;
  /// Who the peer is (the cluster id its HELLO announced; a reverse channel's: the linked
  /// owner's) and its control channel's link token: what its requests are counted under
  /// (metrics.h) and what STATS tells it.
  uint64_t cluster = 0;
  std::string token;
  StatsAnswer stats;
  /// A link's reverse channel (we linked; the peer is an owner we read from): of NIXL's
  /// messages only NIXL_REVOKE is served on it, and only on it.
  bool reverse = false;
  /// The owner side of NIXL (nixl.h); null: NIXL requests are refused (LLM_FEATURE_NOT_ENABLED).
  nixl::Owner *nixl = nullptr;
  /// A reverse channel's NIXL_REVOKE (the link's ReadPath::Revoke): true once no read under
  /// the lease is in flight (within the wait). Empty: answered at once.
  std::function<bool(uint64_t lease_id, double wait)> nixl_revoke;
};

/// Serves requests on a connection whose handshake is done, as the owner of the context's
/// caches (READ, WRITE, PING, BYE, RELEASE), parked in `io` between requests (iopool.h), until
/// the peer says BYE or leaves, the group is stopped, or the connection breaks; then every
/// grant of the connection is released and the connection closed. Used for a link's reverse
/// channel (where the roles swap); the listener's connections are served the same way.
/// `ctx`'s pointers must outlive the group's Stop. Never blocks. False (the connection
/// closed) when the group is stopped already.
bool ServeParked(IoGroup &io, const ServeContext &ctx, std::unique_ptr<Conn> conn);

/// How long an owner waits for a stalled writer: a WRITE's bytes, or a refused eager WRITE's
/// (drained), from its request on (default 120 s; docs/protocol.md, "Deadlines"); the
/// connection is closed past it. Process-wide, for WRITEs asked from then on; <= 0 restores
/// the default. Tests shorten it.
void SetWriteTimeout(double seconds);

/// A client's reverse channel to us (HELLO with FEATURE_REVERSE): handed over to become our
/// end of that client's link *before* the handshake's last frame (`last`) goes out, which the
/// handler sends once the link is registered (the client's link call returns on that frame,
/// and the listener may push at once, as in CANN's push samples).
/// `token`: the link token the HELLO echoed (a live control channel's of that cluster, checked);
/// `peer`: what the per-peer cap counts the connection by (its IP); `server`: the listener,
/// alive for the call (HoldsToken: is another token still live). Called on one of the
/// server's adopter threads (Server::Adopt), never on an I/O pool thread: what it waits for
/// (its frame's send, a PING of the channel it may replace, which the peer may never answer)
/// holds that thread and delays the next adoptions, so it waits within short deadlines only.
class Server;
using ReverseHandler = std::function<void(Server &server, uint64_t cluster_id, std::unique_ptr<Conn> conn,
                                          const std::vector<uint8_t> &last, const std::string &token,
                                          const std::string &peer, bool eager)>;

class Server {
 public:
  /// Stop waits at most this long (seconds) for leased copies in flight.
  static constexpr double kRevokeWait = 2.0;
  /// Threads a server adopts reverse channels on at most (Adopt), started as adoptions wait:
  /// one while they are quick.
  static constexpr size_t kAdopters = 4;
  /// `pool`: the I/O threads its connections are served on (null: the process's shared pool).
  Server(Registry *registry, Identity *identity, ReverseHandler on_reverse = nullptr,
         std::shared_ptr<IoPool> pool = nullptr)
      : registry_(registry),
        identity_(identity),
        on_reverse_(std::move(on_reverse)),
        grants_(identity->allow_ptrace),
        io_(std::move(pool)) {}
  ~Server() { Stop(); }
  /// Binds host:port (port 0 picks one) and starts accepting; with identity->serve_local,
  /// also on the local channel (docs/protocol.md), unless its name is taken. LLM_LINK_FAILED
  /// if it cannot bind the TCP address. At most `max_conns` connections are served at once,
  /// `max_per_peer` from one IP address (local ones: from one uid, so that a fork gains
  /// nothing); TCP and the local channel share the one budget. Connections in their handshake
  /// also count in the pre-auth budgets (above). One over a cap or budget gets ERROR
  /// LLM_LINK_FAILED in answer to its first frame, from the accept thread, and is closed.
  void Start(const std::string &host, uint16_t port, size_t max_conns = 256, size_t max_per_peer = 64);
  void Stop();
  uint16_t port() const { return port_; }
  bool serves_local() const { return serves_local_; }
  /// Connections refused over a cap so far (for tests).
  size_t refused() const { return refused_; }
  /// Connections accepted and closed unserved because no I/O thread could be had (the
  /// process at its thread limit: each is logged), so far. The next accept tries again.
  size_t unserved() const { return unserved_; }
  /// Connections in their handshake shut down to let a newcomer's in, so far (AcceptFd: the
  /// pre-auth total full, the newcomer's address holding fewer than the heaviest).
  size_t evicted() const { return evicted_; }
  /// Bytes the connections' frame buffers hold now (for tests: never a declared length).
  size_t buffered();
  /// The cluster ids of the peers' control channels being served now (handshake done).
  std::vector<uint64_t> ControlClusters();
  /// Connections being served now (handshake or requests; for tests).
  size_t connections();
  /// `token` is that of a live control channel of `cluster` (constant-time compares).
  bool HoldsToken(uint64_t cluster, const std::string &token);

 private:
  /// One accepted connection, a task of the I/O pool (server.cc).
  class Connection;
  /// A handshake between its frames (HELLO, then AUTH when there is a secret).
  struct Shake;
  /// A connection over a cap, waiting (on the accept thread) for its first frame.
  struct Refusal {
    int fd;
    Deadline until;
    std::vector<uint8_t> buf;
    std::string why;
  };
  void AcceptLoop();
  void AcceptStep(std::vector<pollfd> &fds);  // one poll of the listeners and refusals
  /// Accepts one connection: served, refused over a cap, or (no I/O thread to be had)
  /// closed, logged and counted (unserved). Never throws.
  void AcceptOne(int listen_fd, bool local);
  /// The connection `fd` accepted (closed on every way out but a hand-over); `address` is set
  /// as soon as known. Throws when it cannot be served (std::system_error, bad_alloc).
  void AcceptFd(int fd, const sockaddr_storage &peer, bool local, std::string &address);
  void Refuse(int fd, std::string why);
  /// The pre-auth total is full: shuts down the oldest handshake of the address (or uid) that
  /// holds the most, if it holds more than the newcomer's address would with it
  /// (`same_shaking` + 1); false (the newcomer is refused) when none does. mu_ held; never blocks.
  bool EvictShakingLocked(const std::map<std::string, size_t> &shaking_from, size_t same_shaking);
  bool StepRefusal(Refusal &r);  // true: done with it (answered or given up)
  enum class Greeted { kRefused, kControl, kReverse, kPending };
  /// The handshake, a frame per call, each as it arrives: HELLO answered by WELCOME (and,
  /// with a secret, the client's AUTH checked: kPending after HELLO until then). The last
  /// frame to send (WELCOME, or OK after AUTH) is left in `s.last` for the caller, except on
  /// refusal. A control channel's link token (issued in its WELCOME), or the one a reverse
  /// channel echoed, is left in `s.token`; a reverse channel is refused (ERROR
  /// LLM_LINK_FAILED) unless its HELLO echoed the token of a live control channel of its
  /// cluster id. Each takes the frame whole in `c` (read by the caller, within the
  /// handshake's deadline) and queues its answers there; never blocks.
  Greeted Hello(PeerStream &c, Shake &s);
  Greeted Auth(PeerStream &c, Shake &s);
  /// The connections whose handshake is done, as reverse channels, refused or served: dropped (mu_ held).
  void ReapLocked();
  /// A reverse channel whose handshake is done, waiting for on_reverse_ (Adopt).
  struct Adoption {
    uint64_t cluster = 0;
    std::unique_ptr<Conn> conn;
    std::vector<uint8_t> last;
    std::string token;
    std::string peer;
    bool eager = false;  // its HELLO set FEATURE_EAGER_WRITE: it serves eager WRITEs
  };
  /// Hands a reverse channel to on_reverse_ off the I/O pool (on_reverse_ may wait: up to
  /// Engine::kReverseProbe for the PONG of the channel it would replace, which the peer may
  /// never send), on at most kAdopters threads of this server's, started at need, one
  /// adoption at a time per peer address (or uid) and the addresses served in turn: a peer
  /// whose adoptions wait on its own silence holds one such thread, never an I/O thread, and
  /// delays other addresses' adoptions by its turn only. At most kPreAuthPerPeer waiting per
  /// address; beyond that, or stopping, the channel is refused (ERROR LLM_LINK_FAILED). Called
  /// on an I/O pool thread; never blocks (but to start a thread).
  void Adopt(Adoption a);
  void AdoptLoop();                                                 // an adopter thread
  static void RefuseAdoption(Adoption &a, const std::string &why);  // ERROR, closed
  void StopAdopters();                                              // joined; the waiting ones refused

  Registry *registry_;
  Identity *identity_;
  ReverseHandler on_reverse_;
  GrantBook grants_;
  int listen_fd_ = -1;
  int local_fd_ = -1;
  bool serves_local_ = false;  // set by Start, before any thread reads it
  uint16_t port_ = 0;
  size_t max_conns_ = 256, max_per_peer_ = 64;
  std::atomic<bool> stopping_{false};
  std::atomic<size_t> refused_{0};
  std::atomic<size_t> unserved_{0};
  std::atomic<size_t> evicted_{0};
  std::thread accept_thread_;
  std::vector<Refusal> refusing_;  // the accept thread's only
  std::mutex mu_;
  std::list<std::shared_ptr<Connection>> conns_;  // accepted, not reaped yet (mu_)
  IoGroup io_;                                    // every accepted connection is a task of this group
  // Adopt's: the reverse channels waiting by peer address, the addresses with some waiting and
  // none being adopted in the order they are served, those being adopted, the threads.
  std::mutex adopt_mu_;
  std::condition_variable adopt_cv_;
  std::map<std::string, std::deque<Adoption>> adopt_waiting_;
  std::deque<std::string> adopt_turns_;
  std::set<std::string> adopting_;
  std::vector<std::thread> adopters_;
  size_t adopters_busy_ = 0;  // adopter threads in on_reverse_
  bool adopt_stop_ = false;
};

}  // namespace datadist

#endif  // DATADIST_CPP_SERVER_H_
