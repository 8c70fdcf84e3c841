// Serving: a listener that accepts peers and serves each connection on its own thread, as the
// owner side of the protocol (handshake, READ, WRITE, PING, BYE), over the registry.
// Start() binds and returns at once; Stop() stops accepting, wakes and joins every thread
// (bounded by the poll slices below, never by a peer).
#ifndef DATADIST_CPP_SERVER_H_
#define DATADIST_CPP_SERVER_H_

#include <atomic>
#include <functional>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "net.h"
#include "registry.h"

namespace datadist {

struct Identity {
  uint64_t cluster_id = 0;
  std::atomic<int32_t> role{0};
  std::string secret;  // shared secret peers must prove (empty: none); set before serving
};

/// Serves requests on a connection whose handshake is done, as the owner of `registry`'s
/// caches (READ, WRITE, PING, BYE, RELEASE), until the peer says BYE or leaves, `stopping` is
/// set, or the connection breaks. Used by the listener's threads and by a link's reverse
/// channel (where the roles swap). Returns when done; the caller closes the connection.
void ServeRequests(Registry *registry, Conn &c, const std::atomic<bool> &stopping);

/// A client's reverse channel to us (HELLO with FEATURE_REVERSE): handed over after the
/// handshake, to become our end of that client's link.
using ReverseHandler = std::function<void(uint64_t cluster_id, std::unique_ptr<Conn> conn)>;

class Server {
 public:
  Server(Registry *registry, Identity *identity, ReverseHandler on_reverse = nullptr)
      : registry_(registry), identity_(identity), on_reverse_(std::move(on_reverse)) {}
  ~Server() { Stop(); }
  /// Binds host:port (port 0 picks one) and starts accepting. LLM_LINK_FAILED if it cannot bind.
  /// At most `max_conns` connections are served at once, `max_per_peer` from one IP address;
  /// one over either cap is closed at once (the peer's link fails).
  void Start(const std::string &host, uint16_t port, size_t max_conns = 256, size_t max_per_peer = 64);
  void Stop();
  uint16_t port() const { return port_; }

 private:
  struct Worker {
    std::string ip;
    std::unique_ptr<Conn> conn;
    std::thread thread;
    std::atomic<bool> done{false};
  };
  void AcceptLoop();
  void Serve(Worker *w);
  enum class Greeted { kRefused, kControl, kReverse };
  /// HELLO -> WELCOME (and the secret's challenge and response).
  Greeted Handshake(Conn &c, uint64_t &peer_cluster);
  void ReapLocked(bool all);

  Registry *registry_;
  Identity *identity_;
  ReverseHandler on_reverse_;
  int listen_fd_ = -1;
  uint16_t port_ = 0;
  size_t max_conns_ = 256, max_per_peer_ = 64;
  std::atomic<bool> stopping_{false};
  std::thread accept_thread_;
  std::mutex mu_;
  std::list<std::unique_ptr<Worker>> workers_;
};

}  // namespace datadist

#endif  // DATADIST_CPP_SERVER_H_
