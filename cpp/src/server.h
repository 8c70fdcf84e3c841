// Serving: a listener that accepts peers (over TCP and, on one host, the local channel) and
// serves each connection on its own thread, as the owner side of the protocol (handshake,
// READ, same-host GRANT and RELEASE, WRITE, PING, BYE), over the registry.
// Start() binds and returns at once; Stop() stops accepting, wakes and joins every thread
// (bounded by the poll slices below, never by a peer).
#ifndef DATADIST_CPP_SERVER_H_
#define DATADIST_CPP_SERVER_H_

#include <atomic>
#include <functional>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "local.h"
#include "net.h"
#include "registry.h"

namespace datadist {

struct Identity {
  uint64_t cluster_id = 0;
  std::atomic<int32_t> role{0};
  std::string secret;  // shared secret peers must prove (empty: none); set before serving
  bool serve_local = true;   // serve the local channel too (off when TCP is forced)
  bool allow_ptrace = true;  // may PR_SET_PTRACER_ANY be set for same-host readers (Yama 1)
  /// Called (on a serving thread, no lock of the server held) each time a peer's control
  /// channel completes its handshake, with the cluster id it announced: two-sided links see
  /// a member join by it. Set before serving; may be empty.
  std::function<void(uint64_t)> on_control;
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
  void Take(pid_t pid);
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
};

/// Serves requests on a connection whose handshake is done, as the owner of the context's
/// caches (READ, WRITE, PING, BYE, RELEASE), until the peer says BYE or leaves, `stopping` is
/// set, or the connection breaks. Used by the listener's threads and by a link's reverse
/// channel (where the roles swap). Returns when done (every grant of the connection
/// released); the caller closes the connection.
void ServeRequests(const ServeContext &ctx, Conn &c, const std::atomic<bool> &stopping);

/// A client's reverse channel to us (HELLO with FEATURE_REVERSE): handed over to become our
/// end of that client's link *before* the handshake's last frame (`last`) goes out, which the
/// handler sends once the link is registered (the client's link call returns on that frame,
/// and the listener may push at once, as in CANN's push samples).
/// `token`: the link token the HELLO echoed (a live control channel's of that cluster, checked);
/// `peer`: what the per-peer cap counts the connection by (its IP); `server`: the listener,
/// alive for the call (HoldsToken: is another token still live).
class Server;
using ReverseHandler =
    std::function<void(Server &server, uint64_t cluster_id, std::unique_ptr<Conn> conn, const std::vector<uint8_t> &last,
                       const std::string &token, const std::string &peer)>;

class Server {
 public:
  /// Stop waits at most this long (seconds) for leased copies in flight.
  static constexpr double kRevokeWait = 2.0;
  Server(Registry *registry, Identity *identity, ReverseHandler on_reverse = nullptr)
      : registry_(registry), identity_(identity), on_reverse_(std::move(on_reverse)),
        grants_(identity->allow_ptrace) {}
  ~Server() { Stop(); }
  /// Binds host:port (port 0 picks one) and starts accepting; with identity->serve_local,
  /// also on the local channel (docs/protocol.md), unless its name is taken. LLM_LINK_FAILED
  /// if it cannot bind the TCP address. At most `max_conns` connections are served at once,
  /// `max_per_peer` from one IP address (local ones: from one uid, so that a fork gains
  /// nothing); TCP and the local channel share the one budget. One over either cap gets
  /// ERROR LLM_LINK_FAILED in answer to its first frame, from the accept thread, and is closed.
  void Start(const std::string &host, uint16_t port, size_t max_conns = 256, size_t max_per_peer = 64);
  void Stop();
  uint16_t port() const { return port_; }
  bool serves_local() const { return serves_local_; }
  /// Connections refused over a cap so far (for tests).
  size_t refused() const { return refused_; }
  /// The cluster ids of the peers' control channels being served now (handshake done).
  std::vector<uint64_t> ControlClusters();
  /// `token` is that of a live control channel of `cluster` (constant-time compares).
  bool HoldsToken(uint64_t cluster, const std::string &token);

 private:
  struct Worker {
    std::string peer;  // what the per-peer cap counts by: the IP, or "uid N" for local ones
    bool local = false;
    local::Cred cred;  // local connections: the kernel-verified peer
    std::unique_ptr<Conn> conn;
    std::thread thread;
    std::atomic<bool> done{false};
    // A control channel whose handshake completed (under mu_): its peer's cluster id and the
    // link token we issued it, which that peer's reverse channel must echo.
    uint64_t cluster = 0;
    std::string token;
  };
  /// A connection over a cap, waiting (on the accept thread) for its first frame.
  struct Refusal {
    int fd;
    Deadline until;
    std::vector<uint8_t> buf;
    std::string why;
  };
  void AcceptLoop();
  void AcceptOne(int listen_fd, bool local);
  void Refuse(int fd, std::string why);
  bool StepRefusal(Refusal &r);  // true: done with it (answered or given up)
  void Serve(Worker *w);
  enum class Greeted { kRefused, kControl, kReverse };
  /// HELLO, WELCOME (and the secret's proofs); the last frame to send (WELCOME, or OK after
  /// AUTH) is left in `last` for the caller, except on refusal. A control channel's link token
  /// (issued in its WELCOME), or the one a reverse channel echoed, is left in `token`; a reverse channel is refused (ERROR
  /// LLM_LINK_FAILED) unless its HELLO echoed the token of a live control channel of its
  /// cluster id.
  Greeted Handshake(Conn &c, uint64_t &peer_cluster, std::vector<uint8_t> &last, std::string &token);
  void ReapLocked();  // joins the workers that are done (mu_ held)

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
  std::thread accept_thread_;
  std::vector<Refusal> refusing_;  // the accept thread's only
  std::mutex mu_;
  std::list<std::unique_ptr<Worker>> workers_;
};

}  // namespace datadist

#endif  // DATADIST_CPP_SERVER_H_
