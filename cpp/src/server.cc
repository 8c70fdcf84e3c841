#include "server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "auth.h"
#include "errors.h"

namespace datadist {
namespace {

constexpr double kHandshakeTimeout = 10.0;  // s the server waits for a new connection's HELLO
constexpr double kFrameTimeout = 30.0;      // s a frame may take once its first byte arrived
constexpr double kServeTimeout = 120.0;     // s a stalled reader / writer is waited for
constexpr int kPollSliceMs = 100;           // how often blocked waits look at the stop flag
constexpr uint32_t kPreAuthPayload = 4096;  // largest frame before the handshake completed

void TrySend(Conn &c, const std::vector<uint8_t> &frame) {
  try {
    c.SendFrame(frame, After(1.0));
  } catch (const Error &) {
  }
}

std::vector<uint8_t> ErrorFrame(const Error &e, uint32_t rid) {
  // Codes travel as their unsigned 32-bit value (LLM_FAILED is 0xFFFFFFFF, as Python's Code.FAILED).
  return wire::EncodeError({static_cast<int64_t>(e.code()), e.what()}, rid);
}

}  // namespace

bool Dispatch(Registry *registry_, Conn &c, const wire::Header &h, const std::vector<uint8_t> &payload);

void Server::Start(const std::string &host, uint16_t port, size_t max_conns, size_t max_per_peer) {
  max_conns_ = max_conns;
  max_per_peer_ = max_per_peer;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) Invalid("not an IPv4 address: '" + host + "'");
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) Fail(llm_datadist::LLM_LINK_FAILED, std::string("socket: ") + std::strerror(errno));
  int one = 1;
  (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, reinterpret_cast<sockaddr *>(&addr), sizeof(addr)) != 0 || listen(fd, 128) != 0) {
    std::string why = std::strerror(errno);
    close(fd);
    Fail(llm_datadist::LLM_LINK_FAILED, "cannot listen on " + host + ":" + std::to_string(port) + ": " + why);
  }
  socklen_t len = sizeof(addr);
  (void)getsockname(fd, reinterpret_cast<sockaddr *>(&addr), &len);
  port_ = ntohs(addr.sin_port);
  listen_fd_ = fd;
  stopping_ = false;
  accept_thread_ = std::thread([this] { AcceptLoop(); });
}

void Server::Stop() {
  if (listen_fd_ < 0) return;
  stopping_ = true;
  if (accept_thread_.joinable()) accept_thread_.join();
  close(listen_fd_);
  listen_fd_ = -1;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto &w : workers_)
    if (w->conn) w->conn->Shutdown();
  ReapLocked(true);
}

void Server::ReapLocked(bool all) {
  for (auto it = workers_.begin(); it != workers_.end();) {
    if (all || (*it)->done) {
      if ((*it)->thread.joinable()) (*it)->thread.join();
      it = workers_.erase(it);
    } else {
      ++it;
    }
  }
}

void Server::AcceptLoop() {
  while (!stopping_) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (poll(&p, 1, kPollSliceMs) <= 0) {
      std::lock_guard<std::mutex> lock(mu_);
      ReapLocked(false);
      continue;
    }
    sockaddr_in peer{};
    socklen_t len = sizeof(peer);
    int fd = accept4(listen_fd_, reinterpret_cast<sockaddr *>(&peer), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) continue;
    char ip[INET_ADDRSTRLEN] = {0};
    inet_ntop(AF_INET, &peer.sin_addr, ip, sizeof(ip));
    std::lock_guard<std::mutex> lock(mu_);
    ReapLocked(false);
    size_t live = 0, same_ip = 0;
    for (const auto &other : workers_)
      if (!other->done) {
        ++live;
        same_ip += other->ip == ip;
      }
    if (live >= max_conns_ || same_ip >= max_per_peer_) {
      close(fd);  // over a cap: no thread, no word
      continue;
    }
    auto w = std::make_unique<Worker>();
    w->ip = ip;
    w->conn = std::make_unique<Conn>(fd, std::string(ip) + ":" + std::to_string(ntohs(peer.sin_port)));
    Worker *raw = w.get();
    workers_.push_back(std::move(w));
    raw->thread = std::thread([this, raw] { Serve(raw); });
  }
}

void Server::Serve(Worker *w) {
  Conn &c = *w->conn;
  try {
    uint64_t peer = 0;
    switch (Handshake(c, peer)) {
      case Greeted::kRefused:
        c.Close();
        break;
      case Greeted::kControl:
        ServeRequests(registry_, c, stopping_);
        break;
      case Greeted::kReverse: {
        std::unique_ptr<Conn> taken;
        {
          std::lock_guard<std::mutex> lock(mu_);  // Stop() reaches worker connections under it
          taken = std::move(w->conn);
        }
        if (on_reverse_ && !stopping_) on_reverse_(peer, std::move(taken));
        w->done = true;
        return;
      }
    }
  } catch (const Error &e) {
    if (e.code() == kSuspectRemoteError && !c.closed()) TrySend(c, ErrorFrame(e, 0));
  } catch (const std::exception &) {
  }
  c.Close();
  w->done = true;
}

void ServeRequests(Registry *registry, Conn &c, const std::atomic<bool> &stopping) {
  std::vector<uint8_t> payload;
  try {
    while (!c.closed() && !stopping) {
      if (!c.WaitReadable(kPollSliceMs)) continue;
      wire::Header h = c.RecvFrame(payload, After(kFrameTimeout));
      if (!Dispatch(registry, c, h, payload)) break;
    }
  } catch (const Error &e) {
    if (e.code() == kSuspectRemoteError && !c.closed()) TrySend(c, ErrorFrame(e, 0));
  } catch (const std::exception &) {
  }
}

Server::Greeted Server::Handshake(Conn &c, uint64_t &peer_cluster) {
  std::vector<uint8_t> payload;
  const Deadline deadline = After(kHandshakeTimeout);
  wire::Header h = c.RecvFrame(payload, deadline, kPreAuthPayload);
  if (h.type != wire::kHello) ProtocolViolation("expected HELLO");
  wire::Hello hello = wire::DecodeHello(payload);
  peer_cluster = hello.cluster_id;
  const Greeted greeted = (hello.features & wire::kFeatureReverse) ? Greeted::kReverse : Greeted::kControl;
  if (hello.cluster_id == identity_->cluster_id) {
    TrySend(c, wire::EncodeError({static_cast<int64_t>(llm_datadist::LLM_LINK_FAILED),
                                  "peer uses our own cluster id " + std::to_string(hello.cluster_id)},
                                 h.request_id));
    return Greeted::kRefused;
  }
  // No same-host identity (zero boot id and pid namespace): a Python peer then always uses
  // TCP toward us. Features only for the shared secret.
  wire::Hello welcome;
  welcome.cluster_id = identity_->cluster_id;
  welcome.role = static_cast<uint8_t>(identity_->role.load());
  welcome.pid = static_cast<uint32_t>(getpid());
  welcome.features = on_reverse_ ? wire::kFeatureReverse : 0;  // we accept reverse channels
  const std::string &secret = identity_->secret;
  if (!secret.empty()) {
    welcome.features |= auth::kFeatureAuth;
    welcome.proof = auth::ServerProof(secret, hello.proof, auth::Nonce(), identity_->cluster_id, hello.cluster_id);
  }
  c.SendFrame(wire::EncodeHello(wire::kWelcome, welcome, h.request_id), deadline);
  if (secret.empty()) return greeted;
  // Nothing but the client's proof is accepted until it checks out.
  h = c.RecvFrame(payload, deadline, kPreAuthPayload);
  bool ok = false;
  if (h.type == wire::kAuth) {
    std::string server_nonce = welcome.proof.substr(0, auth::kNonceBytes);
    std::string want = auth::ClientProof(secret, hello.proof, server_nonce, identity_->cluster_id, hello.cluster_id);
    ok = auth::Same(want, wire::DecodeAuth(payload));
  }
  if (!ok) {
    TrySend(c, wire::EncodeError({static_cast<int64_t>(llm_datadist::LLM_LINK_FAILED),
                                  "cluster " + std::to_string(hello.cluster_id) + " failed to prove the shared secret"},
                                 h.request_id));
    return Greeted::kRefused;
  }
  c.SendFrame(wire::EncodeEmpty(wire::kOk, h.request_id), deadline);
  return greeted;
}

bool Dispatch(Registry *registry_, Conn &c, const wire::Header &h, const std::vector<uint8_t> &payload) {
  const uint32_t rid = h.request_id;
  switch (h.type) {
    case wire::kRead: {
      wire::Request req = wire::DecodeRequest(h.type, payload);
      std::unique_ptr<Lease> lease;
      try {
        if (req.flags & wire::kFlagGrant)  // grants only on a local channel, which we do not serve
          Invalid("grants are served on the local channel only; read without GRANT");
        lease = registry_->Open(req);
      } catch (const Error &e) {
        c.SendFrame(ErrorFrame(e, rid), After(kServeTimeout));
        return true;
      }
      Deadline deadline = After(kServeTimeout);
      std::vector<uint8_t> head = wire::EncodeU64(wire::kReadData, lease->nbytes, rid);
      std::vector<iovec> iov;
      iov.reserve(lease->iov.size() + 1);
      iov.push_back({head.data(), head.size()});
      iov.insert(iov.end(), lease->iov.begin(), lease->iov.end());
      c.SendV(std::move(iov), deadline);
      if (req.flags & wire::kFlagChecksum) {
        uint32_t crc = 0;
        for (const iovec &v : lease->iov) crc = wire::Crc32(crc, v.iov_base, v.iov_len);
        c.SendFrame(wire::EncodeChecksum(crc, lease->nbytes, rid), deadline);
      }
      return true;
    }
    case wire::kWrite: {
      wire::Request req = wire::DecodeRequest(h.type, payload);
      std::unique_ptr<Lease> lease;
      try {
        lease = registry_->Open(req);
      } catch (const Error &e) {
        c.SendFrame(ErrorFrame(e, rid), After(kServeTimeout));
        return true;
      }
      Deadline deadline = After(kServeTimeout);
      c.SendFrame(wire::EncodeEmpty(wire::kOk, rid), deadline);
      c.RecvV(lease->iov, deadline);
      lease.reset();
      c.SendFrame(wire::EncodeEmpty(wire::kOk, rid), deadline);
      return true;
    }
    case wire::kPing:
      c.SendFrame(wire::EncodeU64(wire::kPong, wire::DecodeU64(payload), rid), After(kServeTimeout));
      return true;
    case wire::kBye:
      wire::DecodeEmpty(payload);
      TrySend(c, wire::EncodeEmpty(wire::kOk, rid));
      return false;
    case wire::kRelease:  // we never grant, so there is no lease to release
      wire::CheckOther(h.type, payload);
      return true;
    default:
      ProtocolViolation("unexpected message type " + std::to_string(h.type) + " from a client");
  }
}

}  // namespace datadist
