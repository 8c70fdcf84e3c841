#include "server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "addr.h"
#include "auth.h"
#include "errors.h"

namespace datadist {
namespace {

constexpr double kHandshakeTimeout = 10.0;  // s the server waits for a new connection's HELLO
constexpr double kFrameTimeout = 30.0;      // s a frame may take once its first byte arrived
constexpr double kServeTimeout = 120.0;     // s a stalled reader / writer is waited for
constexpr int kPollSliceMs = 100;           // how often blocked waits look at the stop flag
constexpr uint32_t kPreAuthPayload = 4096;  // largest frame before the handshake completed
// Over-cap connections (docs/protocol.md, "Connection limits"): each gets this long to send its
// first frame, which is answered with ERROR; past this many waiting, one is closed unanswered.
constexpr double kRefuseTimeout = 2.0;
constexpr size_t kMaxRefusing = 64;
// Same-host grants (docs/protocol.md, "Pull on the same host"): an honest reader holds one per
// connection at a time and releases it right after its copy.
constexpr size_t kMaxGrantsPerConnection = 4;
constexpr size_t kMaxGrantsPerPeer = 16;
constexpr double kGrantTtl = 30.0;     // s a grant may stay unreleased
constexpr double kReclaimGrace = 5.0;  // s once its owner wants the memory back

std::atomic<uint64_t> next_lease_id{1};

double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

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

/// One granted read: the lease pins the cache until RELEASE (or expiry, or the connection
/// ending); the grant counts against its reader's pid until then.
class Granted {
 public:
  Granted(std::unique_ptr<Lease> lease, GrantBook *book, pid_t pid)
      : lease_(std::move(lease)), book_(book), pid_(pid), since_(Clock::now()) {}
  ~Granted() {
    lease_.reset();
    book_->Drop(pid_);
  }
  Granted(const Granted &) = delete;
  Granted &operator=(const Granted &) = delete;
  void Settle() { lease_->Settle(true); }  // RELEASE said ok: the read may consume its key
  /// Past its time: kGrantTtl, or kReclaimGrace once the owner wants the memory back.
  bool Expired() const {
    const double age = SecondsSince(since_);
    return age >= kGrantTtl || (age >= kReclaimGrace && lease_->WantedBack());
  }

 private:
  std::unique_ptr<Lease> lease_;
  GrantBook *book_;
  pid_t pid_;
  Clock::time_point since_;
};

using Grants = std::map<uint64_t, std::unique_ptr<Granted>>;

}  // namespace

GrantBook::~GrantBook() { Close(); }

void GrantBook::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (ptracer_) local::Ptracer::Release(this);
  ptracer_ = false;
}

void GrantBook::Take(pid_t pid) {
  std::lock_guard<std::mutex> lock(mu_);
  size_t &held = held_[pid];
  if (held >= kMaxGrantsPerPeer) {
    const size_t n = held;
    Fail(llm_datadist::LLM_LINK_BUSY, "pid " + std::to_string(pid) + " holds " + std::to_string(n) + " grants not released yet");
  }
  ++held;
  // The first cross-memory-attach grant: let same-user readers in under Yama ptrace_scope=1.
  if (allow_ptrace_ && !ptracer_) {
    local::Ptracer::Acquire(this);
    ptracer_ = true;
  }
}

void GrantBook::AllowReaders() {
  std::lock_guard<std::mutex> lock(mu_);
  if (allow_ptrace_ && !ptracer_) {
    local::Ptracer::Acquire(this);
    ptracer_ = true;
  }
}

void GrantBook::Drop(pid_t pid) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(pid);
  if (it != held_.end() && --it->second == 0) held_.erase(it);
}


bool Dispatch(const ServeContext &ctx, Grants &grants, Conn &c, const wire::Header &h, const std::vector<uint8_t> &payload);

void Server::Start(const std::string &host, uint16_t port, size_t max_conns, size_t max_per_peer) {
  max_conns_ = max_conns;
  max_per_peer_ = max_per_peer;
  SockAddr addr = ToSockAddr(host, port);
  int fd = socket(addr.family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) Fail(llm_datadist::LLM_LINK_FAILED, std::string("socket: ") + std::strerror(errno));
  int one = 1;
  (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, addr.get(), addr.len) != 0 || listen(fd, 128) != 0) {
    std::string why = std::strerror(errno);
    close(fd);
    Fail(llm_datadist::LLM_LINK_FAILED, "cannot listen on " + FormatHostPort(host, port) + ": " + why);
  }
  socklen_t len = sizeof(addr.storage);
  (void)getsockname(fd, addr.get(), &len);
  port_ = PortOf(addr.storage);
  listen_fd_ = fd;
  // The local channel: same-host peers are verified there, and only there get grants.
  if (identity_->serve_local) local_fd_ = local::Listen(local::Name(static_cast<uint64_t>(getpid()), identity_->cluster_id));
  serves_local_ = local_fd_ >= 0;
  stopping_ = false;
  accept_thread_ = std::thread([this] { AcceptLoop(); });
}

void Server::Stop() {
  if (listen_fd_ < 0) return;
  stopping_ = true;
  if (accept_thread_.joinable()) accept_thread_.join();
  close(listen_fd_);
  listen_fd_ = -1;
  if (local_fd_ >= 0) close(local_fd_);
  local_fd_ = -1;
  // Joined without mu_ held: a serving thread may take it (its handshake checks link tokens,
  // a reverse channel is handed over under it) and would otherwise never end.
  std::list<std::unique_ptr<Worker>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto &w : workers_)
      if (w->conn) w->conn->Shutdown();
    all.swap(workers_);
  }
  for (auto &w : all)
    if (w->thread.joinable()) w->thread.join();
  all.clear();
  grants_.Close();  // every grant ended with its connection
  // Nobody is served any more: whole-cache leases end too (a reader's next transfer asks
  // us, and finds nobody); copies in flight end first, within a bound.
  registry_->RevokeLeases(kRevokeWait);
}

void Server::ReapLocked() {
  for (auto it = workers_.begin(); it != workers_.end();) {
    if ((*it)->done) {  // its thread takes mu_ no more
      if ((*it)->thread.joinable()) (*it)->thread.join();
      it = workers_.erase(it);
    } else {
      ++it;
    }
  }
}

void Server::AcceptLoop() {
  std::vector<pollfd> fds;
  while (!stopping_) {
    // The listening sockets, then every refused connection still owed its ERROR.
    fds.assign({{listen_fd_, POLLIN, 0}, {local_fd_, POLLIN, 0}});  // fd -1 is ignored by poll
    int wait_ms = kPollSliceMs;
    const size_t polled = refusing_.size();
    for (const Refusal &r : refusing_) {
      fds.push_back({r.fd, POLLIN, 0});
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(r.until - Clock::now()).count();
      wait_ms = static_cast<int>(std::max<long long>(0, std::min<long long>(wait_ms, left + 1)));
    }
    const int n = poll(fds.data(), fds.size(), wait_ms);
    if (n > 0) {
      if (fds[0].revents) AcceptOne(listen_fd_, false);
      if (fds[1].revents) AcceptOne(local_fd_, true);
    }
    // Refusals: answered once their frame is whole, dropped when they break, stall or expire.
    std::vector<Refusal> keep;
    for (size_t i = 0; i < polled; ++i) {
      Refusal &r = refusing_[i];
      const bool done = (n > 0 && fds[2 + i].revents) ? StepRefusal(r) : false;
      if (done || Clock::now() >= r.until) {
        (void)::shutdown(r.fd, SHUT_RDWR);
        close(r.fd);
      } else {
        keep.push_back(std::move(r));
      }
    }
    // New refusals were appended by AcceptOne after the snapshot: keep them too.
    for (size_t i = polled; i < refusing_.size(); ++i) keep.push_back(std::move(refusing_[i]));
    refusing_ = std::move(keep);
    std::lock_guard<std::mutex> lock(mu_);
    ReapLocked();
  }
  for (Refusal &r : refusing_) close(r.fd);
  refusing_.clear();
}

void Server::AcceptOne(int listen_fd, bool is_local) {
  sockaddr_storage peer{};
  socklen_t len = sizeof(peer);
  int fd = accept4(listen_fd, reinterpret_cast<sockaddr *>(&peer), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0) return;  // gone before we got to it, or out of descriptors: the next poll retries
  std::string key, address;
  local::Cred cred;
  if (is_local) {
    try {
      cred = local::PeerCred(fd);
    } catch (const Error &) {
      close(fd);
      return;
    }
    // Local peers share no address: they are counted per verified uid (a per-pid count would
    // let a process multiply its share by forking).
    key = "uid " + std::to_string(cred.uid);
    address = "local pid " + std::to_string(cred.pid) + " uid " + std::to_string(cred.uid);
  } else {
    key = IpOf(peer);
    address = FormatHostPort(key, PortOf(peer));
  }
  std::lock_guard<std::mutex> lock(mu_);
  ReapLocked();
  size_t live = 0, same_peer = 0;
  for (const auto &other : workers_)
    if (!other->done) {
      ++live;
      same_peer += other->peer == key;
    }
  if (live >= max_conns_ || same_peer >= max_per_peer_) {
    Refuse(fd, "too many connections to this owner (" +
                   (live >= max_conns_ ? std::to_string(live) + " connections"
                                       : std::to_string(same_peer) + " connections from " + key) +
                   ")");
    return;
  }
  auto w = std::make_unique<Worker>();
  w->peer = key;
  w->local = is_local;
  w->cred = cred;
  w->conn = std::make_unique<Conn>(fd, address);
  Worker *raw = w.get();
  workers_.push_back(std::move(w));
  raw->thread = std::thread([this, raw] { Serve(raw); });
}

void Server::Refuse(int fd, std::string why) {
  ++refused_;
  if (refusing_.size() >= kMaxRefusing) {  // a flood: no word, no memory
    close(fd);
    return;
  }
  refusing_.push_back({fd, After(kRefuseTimeout), {}, std::move(why)});
}

bool Server::StepRefusal(Refusal &r) {
  const size_t cap = wire::kHeaderSize + kPreAuthPayload;
  uint8_t chunk[512];
  ssize_t got = recv(r.fd, chunk, std::min(sizeof(chunk), cap - r.buf.size()), MSG_DONTWAIT);
  if (got < 0) return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
  if (got == 0) return true;
  r.buf.insert(r.buf.end(), chunk, chunk + got);
  if (r.buf.size() < wire::kHeaderSize) return false;
  wire::Header h;
  try {
    h = wire::DecodeHeader(r.buf.data());
  } catch (const Error &) {
    return true;  // not our protocol: closed without a word
  }
  if (h.length > kPreAuthPayload) return true;
  if (r.buf.size() < wire::kHeaderSize + h.length) return false;
  std::vector<uint8_t> frame =
      wire::EncodeError({static_cast<int64_t>(llm_datadist::LLM_LINK_FAILED), r.why}, h.request_id);
  // One non-blocking send into an empty socket buffer: it fits, or the peer gets nothing.
  (void)send(r.fd, frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  return true;
}

void Server::Serve(Worker *w) {
  Conn &c = *w->conn;
  try {
    uint64_t peer = 0;
    std::vector<uint8_t> last;
    std::string token;
    Greeted greeted = Handshake(c, peer, last, token);
    if (greeted == Greeted::kControl) {
      {  // before the last frame: the client may open its reverse channel as soon as it has it
        std::lock_guard<std::mutex> lock(mu_);
        w->cluster = peer;
        w->token = token;
      }
      c.SendFrame(last, After(kHandshakeTimeout));
      if (identity_->on_control) identity_->on_control(peer);
    }
    switch (greeted) {
      case Greeted::kRefused:
        c.Close();
        break;
      case Greeted::kControl: {
        ServeContext ctx;
        ctx.registry = registry_;
        if (w->local) {
          ctx.peer = &w->cred;
          ctx.grants = &grants_;
        }
        ServeRequests(ctx, c, stopping_);
        break;
      }
      case Greeted::kReverse: {
        std::unique_ptr<Conn> taken;
        {
          std::lock_guard<std::mutex> lock(mu_);  // Stop() reaches worker connections under it
          taken = std::move(w->conn);
        }
        if (on_reverse_ && !stopping_) {
          on_reverse_(*this, peer, std::move(taken), last, token, w->peer);
        } else {  // stopping: the client's link fails with our answer, not a silent close
          const uint32_t rid = wire::DecodeHeader(last.data()).request_id;
          TrySend(*taken, wire::EncodeError({static_cast<int64_t>(llm_datadist::LLM_LINK_FAILED),
                                             "this listener is stopping: it takes no reverse channel"},
                                            rid));
          taken->Close();
        }
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

void ServeRequests(const ServeContext &ctx, Conn &c, const std::atomic<bool> &stopping) {
  std::vector<uint8_t> payload;
  Grants grants;  // released, whatever happens, when this returns
  try {
    while (!c.closed() && !stopping) {
      // Grants their reader kept too long are released (as failed reads): a peer cannot pin
      // caches for as long as it likes.
      for (auto it = grants.begin(); it != grants.end();) it = it->second->Expired() ? grants.erase(it) : std::next(it);
      if (!c.WaitReadable(kPollSliceMs)) continue;
      wire::Header h = c.RecvFrame(payload, After(kFrameTimeout));
      if (!Dispatch(ctx, grants, c, h, payload)) break;
    }
  } catch (const Error &e) {
    if (e.code() == kSuspectRemoteError && !c.closed()) TrySend(c, ErrorFrame(e, 0));
  } catch (const std::exception &) {
  }
}

std::vector<uint64_t> Server::ControlClusters() {
  std::vector<uint64_t> ids;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto &w : workers_)
    if (!w->done && !w->token.empty()) ids.push_back(w->cluster);
  return ids;
}

bool Server::HoldsToken(uint64_t cluster, const std::string &token) {
  if (token.size() != wire::kLinkTokenBytes) return false;
  std::lock_guard<std::mutex> lock(mu_);
  bool ok = false;
  for (const auto &w : workers_)
    if (!w->done && w->cluster == cluster && w->token.size() == token.size()) ok |= auth::Same(w->token, token);
  return ok;
}

Server::Greeted Server::Handshake(Conn &c, uint64_t &peer_cluster, std::vector<uint8_t> &last, std::string &token) {
  std::vector<uint8_t> payload;
  const Deadline deadline = After(kHandshakeTimeout);
  wire::Header h = c.RecvFrame(payload, deadline, kPreAuthPayload);
  if (h.type != wire::kHello) ProtocolViolation("expected HELLO");
  wire::Hello hello = wire::DecodeHello(payload);
  peer_cluster = hello.cluster_id;
  const Greeted greeted = (hello.features & wire::kFeatureReverse) ? Greeted::kReverse : Greeted::kControl;
  // A reverse HELLO's proof ends with the link token it echoes: the challenge is the rest.
  const std::pair<std::string, std::string> parts = wire::SplitToken(hello.proof, hello.features);
  const std::string &client_nonce = parts.first;
  // Ourselves (as Python's Engine.on_hello). Another process with our cluster id is a peer
  // like any other: vllm-ascend's V0 connector gives both sides cluster id = local rank.
  const local::HostIdentity &self = local::HostIdentity::Current();
  if (hello.cluster_id == identity_->cluster_id && hello.pid == static_cast<uint32_t>(getpid()) &&
      hello.boot_id == self.boot_id && hello.pid_ns == self.pid_ns) {
    TrySend(c, wire::EncodeError({static_cast<int64_t>(llm_datadist::LLM_LINK_FAILED),
                                  "a link from this engine to itself (cluster id " + std::to_string(hello.cluster_id) +
                                      ")"},
                                 h.request_id));
    return Greeted::kRefused;
  }
  // Who we say we are (a client compares the boot id to decide whether to try our local
  // channel; nothing is read on our word), and what we serve.
  const local::HostIdentity &host = local::HostIdentity::Current();
  wire::Hello welcome;
  welcome.cluster_id = identity_->cluster_id;
  welcome.role = static_cast<uint8_t>(identity_->role.load());
  welcome.pid = static_cast<uint32_t>(getpid());
  welcome.pid_ns = host.pid_ns;
  welcome.boot_id = host.boot_id;
  welcome.features = on_reverse_ ? wire::kFeatureReverse : 0;  // we accept reverse channels
  if (serves_local_) welcome.features |= wire::kFeatureLocal | wire::kFeatureLease;
  const std::string &secret = identity_->secret;
  if (!secret.empty()) {
    welcome.features |= auth::kFeatureAuth;
    welcome.proof = auth::ServerProof(secret, client_nonce, auth::Nonce(), identity_->cluster_id, hello.cluster_id);
  }
  if (greeted == Greeted::kControl) {  // its link token, for its reverse channel to echo
    token = auth::Nonce();  // kLinkTokenBytes random bytes
    welcome.features |= wire::kFeatureToken;
    welcome.proof += token;
  }
  // A reverse channel only from the peer holding its cluster's control channel (after the
  // secret's proofs, when there is a secret): answered with an ERROR, never adopted.
  auto refuse_reverse = [&](uint32_t rid) {
    if (greeted != Greeted::kReverse || HoldsToken(hello.cluster_id, parts.second)) return false;
    TrySend(c, wire::EncodeError({static_cast<int64_t>(llm_datadist::LLM_LINK_FAILED),
                                  "a reverse channel for cluster " + std::to_string(hello.cluster_id) +
                                      " must come from the peer holding that cluster's control channel to us (its link token)"},
                                 rid));
    return true;
  };
  if (greeted == Greeted::kReverse) token = parts.second;  // checked by refuse_reverse
  if (secret.empty()) {
    if (refuse_reverse(h.request_id)) return Greeted::kRefused;
    last = wire::EncodeHello(wire::kWelcome, welcome, h.request_id);
    return greeted;
  }
  c.SendFrame(wire::EncodeHello(wire::kWelcome, welcome, h.request_id), deadline);
  // Nothing but the client's proof is accepted until it checks out.
  h = c.RecvFrame(payload, deadline, kPreAuthPayload);
  bool ok = false;
  if (h.type == wire::kAuth) {
    std::string server_nonce = welcome.proof.substr(0, auth::kNonceBytes);
    std::string want = auth::ClientProof(secret, client_nonce, server_nonce, identity_->cluster_id, hello.cluster_id);
    ok = auth::Same(want, wire::DecodeAuth(payload));
  }
  if (!ok) {
    TrySend(c, wire::EncodeError({static_cast<int64_t>(llm_datadist::LLM_LINK_FAILED),
                                  "cluster " + std::to_string(hello.cluster_id) + " failed to prove the shared secret"},
                                 h.request_id));
    return Greeted::kRefused;
  }
  if (refuse_reverse(h.request_id)) return Greeted::kRefused;
  last = wire::EncodeEmpty(wire::kOk, h.request_id);
  return greeted;
}

namespace {

/// A same-host read: the spans checked, the addresses granted, the lease held until RELEASE.
/// Only on the local channel, to a peer the kernel says may read us, within the limits.
void Grant(const ServeContext &ctx, Grants &grants, Conn &c, const wire::Request &req, uint32_t rid) {
  if (ctx.peer == nullptr || ctx.grants == nullptr)
    Invalid("grants are served on the local channel only, to peers the kernel verified on this host; read without GRANT");
  const local::Cred &peer = *ctx.peer;
  if (!peer.MayReadUs())
    Invalid("pid " + std::to_string(peer.pid) + " (uid " + std::to_string(peer.uid) +
            ") may not read this process's memory: read without GRANT");
  if (grants.size() >= kMaxGrantsPerConnection)
    Fail(llm_datadist::LLM_LINK_BUSY, std::to_string(grants.size()) + " grants are still not released on this connection");
  std::unique_ptr<Lease> lease = ctx.registry->Open(req);  // every span checked here
  if (lease->bases.size() != req.tensors.size()) Invalid("this request cannot be granted");
  ctx.grants->Take(peer.pid);
  const uint64_t id = next_lease_id++;
  wire::Grant g{id, lease->bases};
  uint32_t crc = 0;
  const uint64_t nbytes = lease->nbytes;
  if (req.flags & wire::kFlagChecksum)  // computed while the lease holds the memory
    for (const iovec &v : lease->iov) crc = wire::Crc32(crc, v.iov_base, v.iov_len);
  grants.emplace(id, std::make_unique<Granted>(std::move(lease), ctx.grants, peer.pid));
  const Deadline deadline = After(kServeTimeout);
  c.SendFrame(wire::EncodeGrant(g, rid), deadline);
  if (req.flags & wire::kFlagChecksum) c.SendFrame(wire::EncodeChecksum(crc, nbytes, rid), deadline);
}

}  // namespace

bool Dispatch(const ServeContext &ctx, Grants &grants, Conn &c, const wire::Header &h, const std::vector<uint8_t> &payload) {
  Registry *registry_ = ctx.registry;
  const uint32_t rid = h.request_id;
  switch (h.type) {
    case wire::kRead: {
      wire::Request req = wire::DecodeRequest(h.type, payload);
      std::unique_ptr<Lease> lease;
      try {
        if (req.flags & wire::kFlagGrant) {
          // SHM too: nothing of ours is in shareable memory, so a plain GRANT answers it.
          Grant(ctx, grants, c, req, rid);
          return true;
        }
        lease = registry_->Open(req);
      } catch (const Error &e) {
        if (e.code() == kSuspectRemoteError || c.closed()) throw;
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
      lease->Settle(true);  // sent: may consume its CacheKey (a throw above settles it failed)
      return true;
    }
    case wire::kWrite: {
      wire::Request req = wire::DecodeRequest(h.type, payload);
      std::unique_ptr<Lease> lease;
      try {
        lease = registry_->OpenWrite(req);
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
    case wire::kLeaseRequest: {
      // A whole-cache lease (docs/protocol.md, "Cache leases"): on the local channel, to a
      // peer the kernel says may read us, as grants. The reader checks and copies by itself;
      // the cache's fence is revoked and drained before its memory goes (Registry::Remove).
      wire::LeaseRequest q = wire::DecodeLeaseRequest(payload);
      std::vector<uint8_t> answer;
      try {
        if (ctx.peer == nullptr || ctx.grants == nullptr || !ctx.peer->MayReadUs())
          Invalid("cache leases are granted only on the local channel, to peers allowed to read this process's memory");
        wire::CacheLease l = registry_->LeaseCache(q);  // nothing of ours is in shareable memory: m = 0
        ctx.grants->AllowReaders();
        answer = wire::EncodeCacheLease(l, rid);
      } catch (const Error &e) {
        if (e.code() == kSuspectRemoteError) throw;
        answer = ErrorFrame(e, rid);
      }
      c.SendFrame(answer, After(kServeTimeout));
      return true;
    }
    case wire::kRelease: {
      // Ends a grant of this connection (ok: its read may consume its CacheKey). Unknown
      // ids (released already, expired, or lease 0, a checksum verdict) settle nothing.
      wire::Release rel = wire::DecodeRelease(payload);
      if (rel.ok && grants.count(rel.lease_id)) grants[rel.lease_id]->Settle();
      grants.erase(rel.lease_id);
      return true;
    }
    default:
      ProtocolViolation("unexpected message type " + std::to_string(h.type) + " from a client");
  }
}

}  // namespace datadist
