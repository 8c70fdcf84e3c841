#include "server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "addr.h"
#include "auth.h"
#include "errors.h"
#include "metrics.h"
#include "nixl.h"
#include "verify.h"

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

/// What a NIXL grant (NIXL_READ / NIXL_WRITE answered by NIXL_GRANT) holds besides its lease:
/// the agent kept progressing until RELEASE, whether its connection had completed a NIXL read
/// when it was granted, and the bytes of its request's span arrays (capped per connection).
struct NixlGrantInfo {
  std::shared_ptr<nixl::Agent> agent;
  bool fresh = false;
  bool write = false;
  uint64_t request_bytes = 0;
};

/// One granted read: the lease pins the cache until RELEASE (or expiry, or the connection
/// ending); a same-host grant counts against its reader's pid until then, a NIXL grant keeps
/// the agent's pump beating.
/// Counted as serve_read (a NIXL write: serve_write) when it ends (metrics.h): its bytes after
/// a RELEASE that said ok, else LLM_FAILED, timed from the request.
class Granted {
 public:
  Granted(std::unique_ptr<Lease> lease, GrantBook *book, pid_t pid, uint64_t cluster, Clock::time_point asked)
      : lease_(std::move(lease)), book_(book), pid_(pid), since_(Clock::now()), cluster_(cluster), asked_(asked),
        nbytes_(lease_->nbytes) {}
  Granted(std::unique_ptr<Lease> lease, NixlGrantInfo nixl, uint64_t cluster, Clock::time_point asked)
      : lease_(std::move(lease)), book_(nullptr), pid_(0), since_(Clock::now()), cluster_(cluster), asked_(asked),
        nbytes_(lease_->nbytes), nixl_(std::move(nixl)) {
    nixl_.agent->PumpAcquire(nixl_.fresh);
  }
  ~Granted() {
    lease_.reset();
    if (book_) book_->Drop(pid_);
    if (nixl_.agent) nixl_.agent->PumpRelease(nixl_.fresh);
    metrics::RecordSince(nixl_.write ? metrics::Op::kServeWrite : metrics::Op::kServeRead, cluster_, ok_ ? nbytes_ : 0,
                         asked_, ok_ ? llm_datadist::LLM_SUCCESS : llm_datadist::LLM_FAILED);
  }
  Granted(const Granted &) = delete;
  Granted &operator=(const Granted &) = delete;
  void Settle() {  // RELEASE said ok: the read may consume its key
    lease_->Settle(true);
    ok_ = true;
  }
  bool nixl() const { return nixl_.agent != nullptr; }
  uint64_t request_bytes() const { return nixl_.request_bytes; }
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
  uint64_t cluster_;
  Clock::time_point asked_;
  uint64_t nbytes_;
  bool ok_ = false;
  NixlGrantInfo nixl_;
};

/// A connection's grants (same-host and NIXL) by lease id, and its streamed read awaiting a
/// checksum verdict (verify.h); clear() ends both, as failed reads, and the connection's NIXL
/// cache leases (nixl.h).
struct Grants : std::map<uint64_t, std::unique_ptr<Granted>> {
  verify::Pending verdict;
  nixl::Owner *nixl_owner = nullptr;  // set once the connection held a NIXL cache lease
  bool nixl_wired = false;            // a NIXL read of this connection completed (RELEASE ok)
  void clear() {
    std::map<uint64_t, std::unique_ptr<Granted>>::clear();
    verdict.Drop();
    if (nixl_owner) nixl_owner->DropConnection(this);
    nixl_owner = nullptr;
  }
};

/// Grants their reader kept too long are released (as failed reads): a peer cannot pin caches
/// for as long as it likes.
void ExpireGrants(Grants &grants) {
  for (auto it = grants.begin(); it != grants.end();) it = it->second->Expired() ? grants.erase(it) : std::next(it);
}

/// When a parked connection needs a timer step: while it holds grants, every poll slice (their
/// expiry is checked, as the thread per connection did between its polls); else never.
Deadline NextCheck(const Grants &grants) {
  return grants.empty() ? Deadline::max() : After(kPollSliceMs / 1000.0);
}

}  // namespace

bool Dispatch(const ServeContext &ctx, Grants &grants, Conn &c, const wire::Header &h, const std::vector<uint8_t> &payload);

namespace {

/// One step of a parked connection whose handshake is done: the request that arrived (when
/// `readable`); grants checked for expiry either way. False when the connection is done (BYE,
/// EOF, a broken or hostile stream): the caller releases its grants and closes it. A request
/// that followed at once (a RELEASE after its GRANT's copy) finds the connection readable as
/// soon as it is parked again: no poll here for it, which every request would pay.
bool ServeStep(const ServeContext &ctx, Grants &grants, Conn &c, bool readable, Deadline &wake) {
  std::vector<uint8_t> payload;
  try {
    ExpireGrants(grants);
    // TLS: frames already decrypted (a record that held more than one) are served now; the
    // socket would not wake a parked connection for them.
    for (bool more = readable; more; more = !c.closed() && c.Buffered()) {
      wire::Header h = c.RecvFrame(payload, After(kFrameTimeout));
      if (!Dispatch(ctx, grants, c, h, payload)) return false;
    }
  } catch (const Error &e) {
    if (e.code() == kSuspectRemoteError && !c.closed()) TrySend(c, ErrorFrame(e, 0));
    return false;
  } catch (const std::exception &) {
    return false;
  }
  if (c.closed()) return false;
  wake = NextCheck(grants);
  return true;
}

/// A connection whose handshake is done, served parked (ServeParked).
class Served : public IoPool::Task {
 public:
  Served(const ServeContext &ctx, std::unique_ptr<Conn> conn) : ctx_(ctx), conn_(std::move(conn)) {}
  int fd() const override { return conn_->fd(); }
  bool Run(bool readable, Deadline &wake) override {
    if (ServeStep(ctx_, grants_, *conn_, readable, wake)) return true;
    grants_.clear();
    conn_->Close();
    return false;
  }
  void Cancel() override { conn_->Shutdown(); }  // the connection is never handed on

 private:
  ServeContext ctx_;
  Grants grants_;
  std::unique_ptr<Conn> conn_;
};

/// Frames up to this size are waited for whole while their connection stays parked (a socket's
/// receive buffer always holds that much); bigger ones are read as they come.
constexpr size_t kWholeFrameMax = 64 << 10;

/// A parked TCP connection woke with bytes to read: is a whole frame there yet? When not (a
/// peer that sends part of a frame and stops, on purpose or not), SO_RCVLOWAT is set to the
/// frame's size, so that epoll wakes us again only once it is all there, and false says: park
/// it again rather than wait on the peer with a pool thread. True: read now (a whole frame,
/// EOF or an error, or a frame too big to wait for whole, read as before). Unix sockets do not
/// honour SO_RCVLOWAT in poll: their partial frames are read as before (local peers are
/// counted per uid, and their frames come whole from one send).
///
/// TLS (`tls`): the socket holds records, not frames, so what is waited for whole is the next
/// record (5 bytes of header, then at most 16 KiB and its overhead): a peer that stalls
/// mid-record holds no thread. Frames up to 16 KiB travel in one record from the core
/// (it writes a frame in one call); a frame split across records whose sender stalls between
/// them is read as it comes, within its deadline, as a frame over kWholeFrameMax is.
bool FrameReady(int fd, bool tcp, bool tls, uint32_t max_payload, bool &lowered) {
  if (!tcp) return true;
  int avail = 0;
  if (ioctl(fd, FIONREAD, &avail) != 0 || avail <= 0) return true;  // EOF or an error: the read says
  constexpr size_t kRecordHeader = 5;             // type, version, length (big-endian)
  constexpr size_t kMaxRecordBody = 16384 + 2048;  // the most a TLS 1.2 / 1.3 record holds
  size_t need = tls ? kRecordHeader : wire::kHeaderSize;
  if (tls && static_cast<size_t>(avail) >= need) {
    uint8_t head[kRecordHeader];
    if (recv(fd, head, sizeof head, MSG_PEEK | MSG_DONTWAIT) != static_cast<ssize_t>(sizeof head)) return true;
    const size_t body = (size_t{head[3]} << 8) | head[4];
    if (body > kMaxRecordBody) return true;  // not a TLS record: the read refuses it at once
    need += body;
    if (static_cast<size_t>(avail) >= need) return true;
  } else if (static_cast<size_t>(avail) >= need) {
    uint8_t head[wire::kHeaderSize];
    if (recv(fd, head, sizeof head, MSG_PEEK | MSG_DONTWAIT) != static_cast<ssize_t>(sizeof head)) return true;
    try {
      const uint32_t length = wire::DecodeHeader(head).length;
      if (length > max_payload) return true;  // refused on its header: no need to wait
      need += length;
    } catch (const std::exception &) {
      return true;  // a bad header: the read refuses it at once
    }
    if (need > kWholeFrameMax) return true;
    if (static_cast<size_t>(avail) >= need) return true;
  }
  // The peer shut its side: the rest never comes, and the read ends it now (an EOF wakes
  // epoll whatever SO_RCVLOWAT says, so waiting would spin).
  pollfd hup{fd, POLLRDHUP, 0};
  if (poll(&hup, 1, 0) != 0) return true;
  int low = static_cast<int>(need);
  if (setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &low, sizeof(low)) != 0) return true;
  lowered = true;
  return false;
}

void RestoreLowWater(int fd, bool &lowered) {
  if (!lowered) return;
  int one = 1;
  (void)setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof(one));
  lowered = false;
}

}  // namespace

bool ServeParked(IoGroup &io, const ServeContext &ctx, std::unique_ptr<Conn> conn) {
  return io.Add(std::make_shared<Served>(ctx, std::move(conn)));
}

/// The state of a handshake between its frames.
struct Server::Shake {
  Greeted greeted = Greeted::kRefused;
  uint64_t cluster = 0;        // the peer's, from its HELLO
  std::string client_nonce;    // its challenge
  std::string server_nonce;    // ours (with a secret)
  std::string echoed;          // a reverse HELLO's link token
  std::string token;           // see Hello()
  std::vector<uint8_t> last;   // see Hello()
};

/// One accepted connection: its handshake, then its requests (or, for a reverse channel, its
/// hand-over to on_reverse_), a frame at a time on the I/O pool.
class Server::Connection : public IoPool::Task {
 public:
  Connection(Server *server, std::unique_ptr<Conn> conn, std::string key, bool local, const local::Cred &cred)
      : peer(std::move(key)), server_(server), local_(local), cred_(cred), conn_(std::move(conn)),
        handshake_until_(After(kHandshakeTimeout)) {}
  int fd() const override { return conn_ ? conn_->fd() : -1; }  // parked: conn_ is there
  bool Run(bool readable, Deadline &wake) override;
  void Cancel() override {
    std::lock_guard<std::mutex> lock(conn_mu_);  // vs the hand-over of a reverse channel
    if (conn_) conn_->Shutdown();
  }
  Deadline handshake_until() const { return handshake_until_; }
  void StartTls() { stage_ = Stage::kTls; }

  // Read by the server under its mu_ (caps, HoldsToken).
  const std::string peer;  // what the per-peer cap counts by: the IP, or "uid N" for local ones
  std::atomic<bool> done{false};
  // A control channel whose handshake completed (under mu_): its peer's cluster id and the
  // link token we issued it, which that peer's reverse channel must echo.
  uint64_t cluster = 0;
  std::string token;

 private:
  enum class Stage { kTls, kHello, kAuth, kServing };
  bool Handshake(bool readable, Deadline &wake);
  /// When a frame begun at partial_since_ must be whole: its 30 s, or the handshake's end.
  Deadline PartialDeadline() const {
    Deadline d = partial_since_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(kFrameTimeout));
    return stage_ == Stage::kServing ? d : std::min(d, handshake_until_);
  }
  bool Finish() {  // done: grants released, closed
    grants_.clear();
    if (conn_) conn_->Close();
    done = true;
    return false;
  }
  Server *server_;
  const bool local_;
  const local::Cred cred_;  // local connections: the kernel-verified peer
  std::mutex conn_mu_;      // guards conn_ being handed over (Cancel reads it from another thread)
  std::unique_ptr<Conn> conn_;
  const Deadline handshake_until_;
  Stage stage_ = Stage::kHello;  // kTls first on a TLS listener (AcceptOne)
  Deadline partial_since_{};  // when part of the next frame arrived (epoch: none pending)
  bool lowered_ = false;      // SO_RCVLOWAT raised to wait for a whole frame
  Shake shake_;
  ServeContext ctx_;
  Grants grants_;
};

bool Server::Connection::Run(bool readable, Deadline &wake) {
  if (server_->stopping_) return Finish();
  // Part of a frame: parked again (a timer step at its deadline) instead of a pool thread
  // waiting on the peer; the frame's 30 s (the handshake's 10 s before it) still hold.
  const uint32_t cap = stage_ == Stage::kServing ? wire::kMaxPayload : kPreAuthPayload;
  if (readable && conn_ && !conn_->Buffered() && stage_ != Stage::kTls &&
      !FrameReady(conn_->fd(), !local_, conn_->tls(), cap, lowered_)) {
    if (partial_since_ == Deadline()) partial_since_ = Clock::now();
    wake = PartialDeadline();
    if (stage_ == Stage::kServing) wake = std::min(wake, After(kPollSliceMs / 1000.0));  // grants still expire
    return true;
  }
  if (readable) {
    partial_since_ = Deadline();
    if (conn_) RestoreLowWater(conn_->fd(), lowered_);
  } else if (partial_since_ != Deadline() && Clock::now() >= PartialDeadline()) {
    return Finish();  // the rest of the frame never came
  }
  if (stage_ != Stage::kServing) return Handshake(readable, wake);
  if (!ServeStep(ctx_, grants_, *conn_, readable, wake)) return Finish();
  if (partial_since_ != Deadline()) wake = std::min(wake, PartialDeadline());
  return true;
}

bool Server::Connection::Handshake(bool readable, Deadline &wake) {
  Conn &c = *conn_;
  if (!readable && !c.Buffered()) {  // the timer: a peer silent past the handshake's deadline is closed
    if (Clock::now() >= handshake_until_) return Finish();
    wake = handshake_until_;
    return true;
  }
  try {
    if (stage_ == Stage::kTls) {
      // The TLS handshake, a step per wake-up as the client's flights arrive (non-blocking):
      // a client that stalls in it holds no thread, and is closed at the handshake's deadline.
      try {
        if (c.TlsAccept(handshake_until_)) stage_ = Stage::kHello;
      } catch (const Error &e) {  // as Python's listener: told (DATADIST_CPP_LOG=1), closed
        Log(std::string(e.what()) + " (a connection to our listener)");
        return Finish();
      }
      wake = c.Buffered() ? Clock::now() : handshake_until_;  // a HELLO decrypted already: at once
      return true;
    }
    const Greeted greeted =
        stage_ == Stage::kHello ? server_->Hello(c, shake_, handshake_until_) : server_->Auth(c, shake_, handshake_until_);
    switch (greeted) {
      case Greeted::kPending:  // WELCOME sent; the client's AUTH is waited for parked
        stage_ = Stage::kAuth;
        wake = handshake_until_;
        return true;
      case Greeted::kRefused:
        return Finish();
      case Greeted::kControl: {
        {  // before the last frame: the client may open its reverse channel as soon as it has it
          std::lock_guard<std::mutex> lock(server_->mu_);
          cluster = shake_.cluster;
          token = shake_.token;
        }
        c.SendFrame(shake_.last, After(kHandshakeTimeout));
        if (server_->identity_->on_control) server_->identity_->on_control(shake_.cluster);
        stage_ = Stage::kServing;
        ctx_.registry = server_->registry_;
        ctx_.cluster = shake_.cluster;
        ctx_.token = shake_.token;
        ctx_.stats = server_->identity_->stats;
        ctx_.nixl = server_->identity_->nixl;
        if (local_) {
          ctx_.peer = &cred_;
          ctx_.grants = &server_->grants_;
        }
        wake = Deadline::max();
        return true;
      }
      case Greeted::kReverse: {
        // Unwatched already (a running task's socket is not in the pool's set): handed on.
        std::unique_ptr<Conn> taken;
        {
          std::lock_guard<std::mutex> lock(conn_mu_);  // Cancel reaches it under this
          taken = std::move(conn_);
        }
        if (server_->on_reverse_ && !server_->stopping_) {
          server_->on_reverse_(*server_, shake_.cluster, std::move(taken), shake_.last, shake_.token, peer);
        } else {  // stopping: the client's link fails with our answer, not a silent close
          const uint32_t rid = wire::DecodeHeader(shake_.last.data()).request_id;
          TrySend(*taken, wire::EncodeError({static_cast<int64_t>(llm_datadist::LLM_LINK_FAILED),
                                             "this listener is stopping: it takes no reverse channel"},
                                            rid));
          taken->Close();
        }
        done = true;
        return false;
      }
    }
  } catch (const Error &e) {
    if (e.code() == kSuspectRemoteError && conn_ && !conn_->closed()) TrySend(*conn_, ErrorFrame(e, 0));
  } catch (const std::exception &) {
  }
  return Finish();
}

GrantBook::~GrantBook() { Close(); }

void GrantBook::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (ptracer_) local::Ptracer::Release(this);
  ptracer_ = false;
}

void GrantBook::Take(pid_t pid, bool cma) {
  std::lock_guard<std::mutex> lock(mu_);
  size_t &held = held_[pid];
  if (held >= kMaxGrantsPerPeer) {
    const size_t n = held;
    Fail(llm_datadist::LLM_LINK_BUSY, "pid " + std::to_string(pid) + " holds " + std::to_string(n) + " grants not released yet");
  }
  ++held;
  // The first cross-memory-attach grant: let same-user readers in under Yama ptrace_scope=1
  // (shared memory needs no ptrace permission).
  if (cma && allow_ptrace_ && !ptracer_) {
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
  // Without mu_ held: a connection being served may take it (its handshake checks link tokens,
  // a control channel records its token under it) and would otherwise never end. Parked
  // connections are removed at once, those being served are shut down and waited for.
  io_.Stop();
  std::list<std::shared_ptr<Connection>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    all.swap(conns_);
  }
  all.clear();  // closed, their grants released
  grants_.Close();  // every grant ended with its connection
  // Nobody is served any more: whole-cache leases end too (a reader's next transfer asks
  // us, and finds nobody); copies in flight end first, within a bound.
  registry_->RevokeLeases(kRevokeWait);
}

void Server::ReapLocked() {
  for (auto it = conns_.begin(); it != conns_.end();) it = (*it)->done ? conns_.erase(it) : std::next(it);
}

size_t Server::connections() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t live = 0;
  for (const auto &c : conns_) live += !c->done;
  return live;
}

std::vector<uint64_t> Server::ControlClusters() {
  std::vector<uint64_t> ids;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto &c : conns_)
    if (!c->done && !c->token.empty()) ids.push_back(c->cluster);
  return ids;
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
  for (const auto &other : conns_)
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
  auto conn = std::make_unique<Conn>(fd, address);
  if (identity_->tls) {
    try {
      conn->TlsServe(*identity_->tls);
    } catch (const Error &e) {
      Log("cannot serve " + address + ": " + e.what());
      return;  // closed with `conn`
    }
  }
  auto c = std::make_shared<Connection>(this, std::move(conn), key, is_local, cred);
  if (identity_->tls) c->StartTls();
  // Parked until its HELLO arrives; closed at the handshake's deadline if it never does.
  if (io_.Add(c, c->handshake_until())) conns_.push_back(std::move(c));  // else stopping: closed with `c`
}

void Server::Refuse(int fd, std::string why) {
  ++refused_;
  // A flood: no word, no memory. TLS: no handshake is spent on a refused connection, so no
  // ERROR frame can reach it (the client sees its handshake fail), as on Python's listener.
  if (refusing_.size() >= kMaxRefusing || identity_->tls) {
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

bool Server::HoldsToken(uint64_t cluster, const std::string &token) {
  if (token.size() != wire::kLinkTokenBytes) return false;
  std::lock_guard<std::mutex> lock(mu_);
  bool ok = false;
  for (const auto &w : conns_)
    if (!w->done && w->cluster == cluster && w->token.size() == token.size()) ok |= auth::Same(w->token, token);
  return ok;
}

namespace {

/// A reverse channel only from the peer holding its cluster's control channel (after the
/// secret's proofs, when there is a secret): answered with an ERROR, never adopted. True: refused.
bool RefuseReverse(Server &server, Conn &c, const std::string &what, uint64_t cluster, const std::string &echoed,
                   uint32_t rid) {
  if (server.HoldsToken(cluster, echoed)) return false;
  TrySend(c, wire::EncodeError({static_cast<int64_t>(llm_datadist::LLM_LINK_FAILED), what}, rid));
  return true;
}

std::string ReverseRefusal(uint64_t cluster) {
  return "a reverse channel for cluster " + std::to_string(cluster) +
         " must come from the peer holding that cluster's control channel to us (its link token)";
}

}  // namespace

Server::Greeted Server::Hello(Conn &c, Shake &s, Deadline deadline) {
  std::vector<uint8_t> payload;
  wire::Header h = c.RecvFrame(payload, deadline, kPreAuthPayload);
  if (h.type != wire::kHello) ProtocolViolation("expected HELLO");
  wire::Hello hello = wire::DecodeHello(payload);
  s.cluster = hello.cluster_id;
  s.greeted = (hello.features & wire::kFeatureReverse) ? Greeted::kReverse : Greeted::kControl;
  // A reverse HELLO's proof ends with the link token it echoes: the challenge is the rest.
  std::pair<std::string, std::string> parts = wire::SplitToken(hello.proof, hello.features);
  s.client_nonce = std::move(parts.first);
  s.echoed = std::move(parts.second);
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
    welcome.proof = auth::ServerProof(secret, s.client_nonce, auth::Nonce(), identity_->cluster_id, hello.cluster_id);
    s.server_nonce = welcome.proof.substr(0, auth::kNonceBytes);
  }
  if (s.greeted == Greeted::kControl) {  // its link token, for its reverse channel to echo
    s.token = auth::Nonce();  // kLinkTokenBytes random bytes
    welcome.features |= wire::kFeatureToken;
    welcome.proof += s.token;
  } else {
    s.token = s.echoed;  // checked by RefuseReverse
  }
  if (secret.empty()) {
    if (s.greeted == Greeted::kReverse && RefuseReverse(*this, c, ReverseRefusal(s.cluster), s.cluster, s.echoed, h.request_id))
      return Greeted::kRefused;
    s.last = wire::EncodeHello(wire::kWelcome, welcome, h.request_id);
    return s.greeted;
  }
  c.SendFrame(wire::EncodeHello(wire::kWelcome, welcome, h.request_id), deadline);
  return Greeted::kPending;  // the client's proof comes next (Auth)
}

Server::Greeted Server::Auth(Conn &c, Shake &s, Deadline deadline) {
  // Nothing but the client's proof is accepted until it checks out.
  std::vector<uint8_t> payload;
  wire::Header h = c.RecvFrame(payload, deadline, kPreAuthPayload);
  bool ok = false;
  if (h.type == wire::kAuth) {
    std::string want = auth::ClientProof(identity_->secret, s.client_nonce, s.server_nonce, identity_->cluster_id, s.cluster);
    ok = auth::Same(want, wire::DecodeAuth(payload));
  }
  if (!ok) {
    TrySend(c, wire::EncodeError({static_cast<int64_t>(llm_datadist::LLM_LINK_FAILED),
                                  "cluster " + std::to_string(s.cluster) + " failed to prove the shared secret"},
                                 h.request_id));
    return Greeted::kRefused;
  }
  if (s.greeted == Greeted::kReverse && RefuseReverse(*this, c, ReverseRefusal(s.cluster), s.cluster, s.echoed, h.request_id))
    return Greeted::kRefused;
  s.last = wire::EncodeEmpty(wire::kOk, h.request_id);
  return s.greeted;
}

namespace {

/// A same-host read: the spans checked, the addresses granted, the lease held until RELEASE.
/// Only on the local channel, to a peer the kernel says may read us, within the limits.
void Grant(const ServeContext &ctx, Grants &grants, Conn &c, const wire::Request &req, uint32_t rid,
           Clock::time_point asked) {
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
  // SHM asked and the cache in shareable memory: where each tensor's unit lies in its memfd.
  const Entry &e = lease->entry();
  const bool shm = (req.flags & wire::kFlagShm) && e.shm.shareable();
  std::vector<uint8_t> checksum;  // read fault-safely while the lease holds the memory: a hole is an error frame
  if (req.flags & wire::kFlagChecksum) checksum = verify::Frame(*lease, rid);
  ctx.grants->Take(peer.pid, !shm);
  const uint64_t id = next_lease_id++;
  std::vector<uint8_t> frame;
  if (shm) {
    wire::ShmGrant g;
    g.lease_id = id;
    for (size_t i = 0; i < req.tensors.size(); ++i) {
      const uint32_t t = req.tensors[i];
      g.fds.push_back(e.shm.fds[t]);
      g.inos.push_back(e.shm.inos[t]);
      g.offsets.push_back(e.shm.offsets[t] + (lease->bases[i] - e.addrs[t]));
    }
    frame = wire::EncodeShmGrant(g, rid);
  } else {
    frame = wire::EncodeGrant({id, lease->bases}, rid);
  }
  grants.emplace(id, std::make_unique<Granted>(std::move(lease), ctx.grants, peer.pid, ctx.cluster, asked));
  const Deadline deadline = After(kServeTimeout);
  c.SendFrame(frame, deadline);
  if (!checksum.empty()) c.SendFrame(checksum, deadline);
}

}  // namespace

namespace {

constexpr uint64_t kMaxGrantedRequestBytes = wire::kMaxPayload;  // NIXL grants' span arrays, per connection

bool IsNixl(uint8_t type) {
  return (type >= wire::kNixlMdRequest && type <= wire::kNixlWrite && type != wire::kNixlMd && type != wire::kNixlGrant) ||
         type == wire::kNixlLease || type == wire::kNixlRevoke;
}

/// NIXL_READ / NIXL_WRITE (docs/protocol.md, "Pull and push over NIXL"): checked exactly as
/// READ / WRITE, then granted (NIXL_GRANT, and CHECKSUM for a read with that flag) and held
/// until RELEASE, as a same-host grant is. Refusals are ERROR frames; the connection stays.
void NixlGrantOne(const ServeContext &ctx, Grants &grants, Conn &c, uint8_t type, const std::vector<uint8_t> &payload,
                  uint32_t rid) {
  wire::Request req = wire::DecodeRequest(type, payload);
  const bool write = type == wire::kNixlWrite;
  const Clock::time_point asked = Clock::now();
  const metrics::Op op = write ? metrics::Op::kServeWrite : metrics::Op::kServeRead;
  std::vector<uint8_t> frame, checksum;
  try {
    uint64_t granted = 0;
    for (const auto &kv : grants) granted += kv.second->request_bytes();
    const uint64_t size = req.tensors.size() * 4 + req.offsets.size() * 16;
    if (grants.size() >= kMaxGrantsPerConnection || granted + size > kMaxGrantedRequestBytes)
      Fail(llm_datadist::LLM_LINK_BUSY, std::to_string(grants.size()) + " grants (" + std::to_string(granted) +
                                            " bytes of requests) are still not released on this connection");
    if (ctx.nixl == nullptr) Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED, "this owner does not serve NIXL");
    std::shared_ptr<nixl::Agent> agent = ctx.nixl->Serving();
    std::unique_ptr<Lease> lease = write ? ctx.registry->OpenWrite(req) : ctx.registry->Open(req);
    nixl::MemKind kind;
    if (!agent->Registered(&lease->entry(), &kind))
      Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED, "the cache is not registered with NIXL on the owner");
    const uint64_t id = next_lease_id++;
    wire::NixlGrant g;
    g.lease_id = id;
    g.agent = agent->name();
    g.generation = agent->generation();
    g.mem = kind.mem;  // the cache's registration: VRAM on its CUDA device, or DRAM
    g.device = kind.device;
    // The client adds its offsets to the bases; raw-address offsets are absolute already.
    g.bases = req.kind == wire::kAddress ? std::vector<uint64_t>(req.tensors.size(), 0) : lease->bases;
    frame = wire::EncodeNixlGrant(g, rid);
    if (!write && (req.flags & wire::kFlagChecksum)) checksum = verify::Frame(*lease, rid);
    NixlGrantInfo info{agent, !grants.nixl_wired, write, size};
    grants.emplace(id, std::make_unique<Granted>(std::move(lease), std::move(info), ctx.cluster, asked));
  } catch (const Error &e) {
    metrics::RecordSince(op, ctx.cluster, 0, asked, e.code());  // refused: nothing granted
    if (e.code() == kSuspectRemoteError) throw;
    c.SendFrame(ErrorFrame(e, rid), After(kServeTimeout));
    return;
  }
  const Deadline deadline = After(kServeTimeout);
  c.SendFrame(frame, deadline);
  if (!checksum.empty()) c.SendFrame(checksum, deadline);
}

/// The NIXL messages a peer may send (docs/protocol.md): on a link's reverse channel only
/// NIXL_REVOKE (answered once no read of ours is under the lease: the core holds none, so at
/// once), never anything that would hand the owner our agent, grants or leases; on any other
/// connection everything but NIXL_REVOKE. A misplaced one is refused (FEATURE_NOT_ENABLED),
/// the connection kept.
void DispatchNixl(const ServeContext &ctx, Grants &grants, Conn &c, const wire::Header &h,
                  const std::vector<uint8_t> &payload) {
  const uint32_t rid = h.request_id;
  if (ctx.reverse != (h.type == wire::kNixlRevoke)) {
    c.SendFrame(ErrorFrame(Error(llm_datadist::LLM_FEATURE_NOT_ENABLED,
                                 std::string(wire::TypeName(h.type)) + " is not served on " +
                                     (ctx.reverse ? "a reverse channel" : "a client's connection")),
                           rid),
                After(kServeTimeout));
    return;
  }
  std::vector<uint8_t> answer;
  switch (h.type) {
    case wire::kNixlMdRequest:
      wire::DecodeEmpty(payload);
      try {
        if (ctx.nixl == nullptr) Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED, "this owner does not serve NIXL");
        answer = wire::EncodeNixlMd(ctx.nixl->Serving()->Metadata(), rid);
      } catch (const Error &e) {
        answer = ErrorFrame(e, rid);
      }
      break;
    case wire::kNixlRead:
    case wire::kNixlWrite:
      NixlGrantOne(ctx, grants, c, h.type, payload, rid);
      return;
    case wire::kNixlLease: {
      wire::NixlLease q = wire::DecodeNixlLease(payload);
      try {
        if (ctx.nixl == nullptr) Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED, "this owner does not serve NIXL");
        answer = wire::EncodeNixlLeased(ctx.nixl->OpenLease(&grants, &c, ctx.cluster, ctx.token, q), rid);
        grants.nixl_owner = ctx.nixl;
      } catch (const Error &e) {
        if (e.code() == kSuspectRemoteError) throw;
        answer = ErrorFrame(e, rid);
      }
      break;
    }
    case wire::kNixlRevoke: {
      // Answered once no read of ours is under the lease, which may take a while: the
      // answer's deadline starts after.
      const uint64_t lease_id = wire::DecodeU64(payload);
      if (ctx.nixl_revoke && !ctx.nixl_revoke(lease_id, nixl::kRevokeWait))
        answer = ErrorFrame(Error(llm_datadist::LLM_TIMEOUT,
                                  "a NIXL read under lease " + std::to_string(lease_id) + " is still in flight"),
                            rid);
      else
        answer = wire::EncodeEmpty(wire::kOk, rid);
      break;
    }
    default:
      ProtocolViolation("unexpected message type " + std::to_string(h.type) + " from a client");
  }
  c.SendFrame(answer, After(kServeTimeout));
}

}  // namespace

// Registered user memory that its caller freed behind our back (their bug) must cost the peer
// an error frame, not a connection cut mid-answer by a send() that hits EFAULT: before this
// thread streams a request from or into such memory, the first and last byte of each tensor
// it names are probed, with process_vm_readv on ourselves (one call per 512 tensors). Memory
// the core or the Python package allocated (pools, AllocateCache) is ours and is not probed.
// Throws LLM_DEVICE_MEM_ERROR naming the tensor (the lease then ends unsettled: nothing is
// consumed); a kernel that will not tell (EPERM, ENOSYS: seccomp, no CMA) lets it go on.
void CheckOwnMemory(const Entry &e, const std::vector<uint32_t> &tensors, const char *what) {
  if (e.opts.allocated || !e.owned.empty() || e.region || e.geo.tensor_bytes == 0) return;
  constexpr size_t kBatch = 1024;  // probes per call (<= IOV_MAX)
  uint8_t scratch[kBatch];
  std::vector<iovec> probes;
  probes.reserve(2 * tensors.size());
  for (uint32_t t : tensors) {
    probes.push_back({reinterpret_cast<void *>(e.addrs[t]), 1});
    probes.push_back({reinterpret_cast<void *>(e.addrs[t] + e.geo.tensor_bytes - 1), 1});
  }
  for (size_t start = 0; start < probes.size(); start += kBatch) {
    const size_t n = std::min(kBatch, probes.size() - start);
    iovec local{scratch, n};
    const ssize_t got = process_vm_readv(getpid(), &local, 1, &probes[start], n, 0);
    if (got == static_cast<ssize_t>(n)) continue;
    if (got < 0 && errno != EFAULT) return;  // cannot tell
    const size_t bad = start + static_cast<size_t>(got < 0 ? 0 : got);
    const uint32_t tensor = tensors[bad / 2];
    char at[32];
    std::snprintf(at, sizeof at, "%#llx", static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(probes[bad].iov_base)));
    // Always told (a bug of the caller's, who may never see the peer's error), as link failures are.
    std::fprintf(stderr, "[datadist] error: cache %lld: tensor %u's memory at %s is not mapped any more (freed after "
                 "it was registered?); a peer's %s of it is refused\n",
                 static_cast<long long>(e.id), tensor, at, what);
    Fail(kDeviceMemError, "the owner's memory of cache " + std::to_string(e.id) + " tensor " + std::to_string(tensor) +
                              " is not mapped any more (freed after it was registered)");
  }
}

bool Dispatch(const ServeContext &ctx, Grants &grants, Conn &c, const wire::Header &h, const std::vector<uint8_t> &payload) {
  Registry *registry_ = ctx.registry;
  const uint32_t rid = h.request_id;
  if (grants.verdict.Settle(h, payload)) return true;  // a checksummed read's verdict
  if (IsNixl(h.type)) {
    DispatchNixl(ctx, grants, c, h, payload);
    return true;
  }
  switch (h.type) {
    case wire::kRead: {
      wire::Request req = wire::DecodeRequest(h.type, payload);
      const Clock::time_point asked = Clock::now();  // counted as serve_read from here
      const size_t held = grants.size();
      std::unique_ptr<Lease> lease;
      std::vector<uint8_t> checksum;
      try {
        if (req.flags & wire::kFlagGrant) {
          Grant(ctx, grants, c, req, rid, asked);  // SHM_GRANT for SHM on shareable memory
          return true;
        }
        lease = registry_->Open(req);
        CheckOwnMemory(lease->entry(), req.tensors, "read");
        // Before the bytes go, read fault-safely: a hole anywhere in the spans is an error
        // frame here, not a cut connection (or a SIGSEGV) after READ_DATA.
        if (req.flags & wire::kFlagChecksum) checksum = verify::Frame(*lease, rid);
      } catch (const Error &e) {
        // Refused (a grant given, then not sent, is counted when it ends: Granted).
        if (grants.size() == held) metrics::RecordSince(metrics::Op::kServeRead, ctx.cluster, 0, asked, e.code());
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
      metrics::Serving served(metrics::Op::kServeRead, ctx.cluster, asked);
      c.SendV(std::move(iov), deadline);
      if (req.flags & wire::kFlagChecksum) {  // the key waits for the reader's verdict
        c.SendFrame(checksum, deadline);
        served.Done(lease->nbytes);  // sent; whether the reader accepts it is its own count
        grants.verdict.Await(rid, std::move(lease));
        return true;
      }
      served.Done(lease->nbytes);
      lease->Settle(true);  // sent: may consume its CacheKey (a throw above settles it failed)
      return true;
    }
    case wire::kWrite: {
      wire::Request req = wire::DecodeRequest(h.type, payload);
      const Clock::time_point asked = Clock::now();  // counted as serve_write from here
      std::unique_ptr<Lease> lease;
      try {
        lease = registry_->OpenWrite(req);
        if (req.kind != wire::kAddress) CheckOwnMemory(lease->entry(), req.tensors, "write");
      } catch (const Error &e) {
        metrics::RecordSince(metrics::Op::kServeWrite, ctx.cluster, 0, asked, e.code());  // refused
        c.SendFrame(ErrorFrame(e, rid), After(kServeTimeout));
        return true;
      }
      Deadline deadline = After(kServeTimeout);
      metrics::Serving served(metrics::Op::kServeWrite, ctx.cluster, asked);
      c.SendFrame(wire::EncodeEmpty(wire::kOk, rid), deadline);
      c.RecvV(lease->iov, deadline);
      served.Done(lease->nbytes);
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
      // Counted as serve_lease, 0 bytes: the reads under a lease are the reader's to count.
      wire::LeaseRequest q = wire::DecodeLeaseRequest(payload);
      const Clock::time_point asked = Clock::now();
      std::vector<uint8_t> answer;
      try {
        if (ctx.peer == nullptr || ctx.grants == nullptr || !ctx.peer->MayReadUs())
          Invalid("cache leases are granted only on the local channel, to peers allowed to read this process's memory");
        wire::CacheLease l = registry_->LeaseCache(q);  // its memfds too, for SHM on shareable memory
        if (l.shm_fds.empty()) ctx.grants->AllowReaders();  // read by cross-memory attach
        answer = wire::EncodeCacheLease(l, rid);
        metrics::RecordSince(metrics::Op::kServeLease, ctx.cluster, 0, asked, llm_datadist::LLM_SUCCESS);
      } catch (const Error &e) {
        metrics::RecordSince(metrics::Op::kServeLease, ctx.cluster, 0, asked, e.code());
        if (e.code() == kSuspectRemoteError) throw;
        answer = ErrorFrame(e, rid);
      }
      c.SendFrame(answer, After(kServeTimeout));
      return true;
    }
    case wire::kStatsRequest: {
      // The peer's own series only (metrics.h's StatsJson; docs/protocol.md, STATS).
      wire::DecodeEmpty(payload);
      const std::vector<uint8_t> answer =
          ctx.stats ? wire::EncodeStats(ctx.stats(ctx.cluster, ctx.token), rid)
                    : ErrorFrame(Error(llm_datadist::LLM_FEATURE_NOT_ENABLED, "this peer serves no metrics"), rid);
      c.SendFrame(answer, After(kServeTimeout));
      return true;
    }
    case wire::kRelease: {
      // Ends a grant of this connection (ok: its read may consume its CacheKey). Unknown
      // ids (released already, expired, or lease 0 that was no read's verdict) settle nothing.
      wire::Release rel = wire::DecodeRelease(payload);
      auto it = grants.find(rel.lease_id);
      if (rel.ok && it != grants.end()) {
        it->second->Settle();
        if (it->second->nixl()) grants.nixl_wired = true;  // UCX's endpoint is up: the pump may beat slowly
      }
      grants.erase(rel.lease_id);
      return true;
    }
    default:
      ProtocolViolation("unexpected message type " + std::to_string(h.type) + " from a client");
  }
}

}  // namespace datadist
