#include "link.h"

#include <algorithm>
#include <deque>

#include "addr.h"
#include "auth.h"
#include "blocking.h"
#include "errors.h"
#include "local.h"
#include "server.h"
#include "verify.h"

namespace datadist {
namespace {

// Link::Prepare: a connection that gave a whole answer this recently is taken as still open.
constexpr auto kFresh = std::chrono::milliseconds(1);

// An ERROR frame's code as a Status: codes travel as i64; -1 (UNKNOWN_ERROR) and anything
// outside 32 bits become LLM_FAILED.
Status CodeOf(int64_t code) {
  if (code < 0 || code > 0xFFFFFFFFLL) return llm_datadist::LLM_FAILED;
  return static_cast<Status>(code);
}

uint64_t IovBytes(const std::vector<iovec> &iov) {
  uint64_t n = 0;
  for (const iovec &v : iov) n += v.iov_len;
  return n;
}

// The next `len` bytes of `iov` from the cursor (entry `at`, `off` bytes into it), as iovecs;
// the cursor moves past them. Touches only the entries it returns.
std::vector<iovec> Take(const std::vector<iovec> &iov, size_t &at, uint64_t &off, uint64_t len) {
  std::vector<iovec> out;
  while (len > 0 && at < iov.size()) {
    const uint64_t take = std::min<uint64_t>(iov[at].iov_len - off, len);
    if (take > 0) out.push_back({static_cast<uint8_t *>(iov[at].iov_base) + off, take});
    off += take;
    len -= take;
    if (off == iov[at].iov_len) {
      ++at;
      off = 0;
    }
  }
  return out;
}

}  // namespace

namespace {

// The answer to request `rid` on `c`; an ERROR raises its code. A broken stream closes `c`.
wire::Header AnswerOn(Conn &c, uint32_t rid, std::vector<uint8_t> &payload, Deadline deadline) {
  wire::Header h;
  try {
    h = c.RecvFrame(payload, deadline);
    if (h.request_id != rid)
      ProtocolViolation("answer to request " + std::to_string(h.request_id) + ", expected " + std::to_string(rid));
    if (h.type == wire::kError) {
      wire::ErrorMsg e = wire::DecodeError(payload);
      Fail(CodeOf(e.code), "peer: " + e.message);
    }
  } catch (const Error &e) {
    if (e.code() == kSuspectRemoteError) c.Close();  // the stream cannot be trusted any more
    throw;
  }
  return h;
}

wire::Header CallOn(Conn &c, uint32_t rid, const std::vector<uint8_t> &frame, std::vector<uint8_t> &payload,
                    Deadline deadline) {
  c.SendFrame(frame, deadline);
  return AnswerOn(c, rid, payload, deadline);
}

}  // namespace

std::unique_ptr<Link::Busy> Link::Acquire(Deadline deadline, bool timeout_if_late, bool defer) {
  if (timeout_if_late && Clock::now() >= deadline) Fail(llm_datadist::LLM_TIMEOUT, "no time left for a transfer");
  std::unique_lock<std::mutex> lock(mu_);
  if ((busy_ || (defer && waiting_.load(std::memory_order_relaxed) > 0)) && !shut_ && blocking::Pending()) {
    // Another transfer holds the link (it may need what our caller holds, the GIL, to end):
    // let go before waiting for it (blocking.h).
    lock.unlock();
    blocking::AboutToBlock();
    lock.lock();
  }
  bool free;
  if (defer) {
    free = idle_.wait_until(lock, deadline,
                            [this] { return (!busy_ && waiting_.load(std::memory_order_relaxed) == 0) || shut_; });
  } else {
    waiting_.fetch_add(1, std::memory_order_relaxed);
    free = idle_.wait_until(lock, deadline, [this] { return !busy_ || shut_; });
    waiting_.fetch_sub(1, std::memory_order_relaxed);
    // A deferring caller waits for the count to fall: wake it (Release wakes it otherwise).
    if (!free || shut_) idle_.notify_all();
  }
  if (!free)
    Fail(llm_datadist::LLM_LINK_BUSY, "link to cluster " + std::to_string(remote_) + " stayed busy until the deadline");
  if (shut_) Fail(llm_datadist::LLM_LINK_FAILED, "link to cluster " + std::to_string(remote_) + " was closed");
  busy_ = true;
  return std::make_unique<Busy>(this);
}

bool Link::TryAcquire() {
  std::lock_guard<std::mutex> lock(mu_);
  if (busy_) return false;
  busy_ = true;
  return true;
}

void Link::Release(bool failed) {
  if (failed) heard_ = Deadline();
  {
    std::lock_guard<std::mutex> lock(mu_);
    busy_ = false;
  }
  // All: a caller that defers (ReadPipelined) must not take the one wake-up a waiter needs.
  idle_.notify_all();
}

void Link::SetConn(std::unique_ptr<Conn> conn) {
  std::unique_ptr<Conn> old;  // closed outside the mutex
  std::lock_guard<std::mutex> lock(mu_);
  old = std::move(conn_);
  conn_ = std::move(conn);
}

void Link::Open(Deadline deadline) {
  auto guard = Acquire(deadline);
  try {
    Connect(deadline);
    if (registry_ && peer_reverse_) {
      // The listener may use the link too: our reverse channel, opened before the link is
      // reported up, parked on the I/O pool between the listener's requests, which a pool
      // thread serves (docs/protocol.md, Reverse channels). No thread of its own.
      uint32_t rid = 0;
      wire::Hello welcome;
      std::unique_ptr<Conn> rev = Greet(true, deadline, rid, welcome);
      ServeContext ctx;  // a TCP connection: no grants on it
      ctx.registry = registry_;
      ctx.cluster = remote_;  // the owner's requests on it count under its id
      ctx.stats = stats_;
      ctx.reverse = true;
      ctx.nixl_revoke = [this](uint64_t lease_id, double wait) {
        std::shared_ptr<nixl::ReadPath> path;
        {
          std::lock_guard<std::mutex> lock(nixl_mu_);
          path = nixl_;
        }
        return path ? path->Revoke(lease_id, wait) : true;
      };
      if (!ServeParked(rev_io_, ctx, std::move(rev)))
        Fail(llm_datadist::LLM_LINK_FAILED,
             "link to cluster " + std::to_string(remote_) + " was closed while it opened");
    }
  } catch (const Error &e) {
    SetConn(nullptr);
    if (e.code() == kSuspectRemoteError || e.code() == llm_datadist::LLM_FAILED)
      Fail(llm_datadist::LLM_LINK_FAILED, e.what());
    throw;
  }
}

bool Link::Gone() {
  if (!TryAcquire()) return false;
  Busy guard(this);
  return !conn_ || conn_->closed() || conn_->PeerGone();
}

bool Link::AnswersPing(Deadline deadline) {
  if (!TryAcquire()) return true;  // busy with a transfer: live (the transfer has its deadline)
  Busy guard(this);
  if (!conn_ || conn_->closed()) return false;
  try {
    std::vector<uint8_t> payload;
    const uint32_t rid = ++rid_;
    if (Call(wire::EncodeU64(wire::kPing, rid, rid), payload, deadline).type == wire::kPong) return true;
  } catch (const std::exception &) {
    // no answer in time, or a broken channel: dead
  }
  conn_->Close();
  return false;
}

void Link::Ping(Deadline deadline) {
  auto guard = Acquire(deadline);
  Prepare(deadline);
  std::vector<uint8_t> payload;
  if (Call(wire::EncodeU64(wire::kPing, remote_, ++rid_), payload, deadline).type != wire::kPong) {
    conn_->Close();
    ProtocolViolation("expected PONG");
  }
}

void Link::NixlRevoke(uint64_t lease_id, Deadline deadline) {
  auto guard = Acquire(deadline);
  Prepare(deadline);
  std::vector<uint8_t> payload;
  if (Call(wire::EncodeU64(wire::kNixlRevoke, lease_id, ++rid_), payload, deadline).type != wire::kOk) {
    conn_->Close();
    ProtocolViolation("expected OK to a NIXL_REVOKE");
  }
}

std::string Link::Stats(Deadline deadline) {
  auto guard = Acquire(deadline);
  Prepare(deadline);
  std::vector<uint8_t> payload;
  if (Call(wire::EncodeEmpty(wire::kStatsRequest, ++rid_), payload, deadline).type != wire::kStats) {
    conn_->Close();
    ProtocolViolation("expected STATS");
  }
  try {
    return wire::DecodeStats(payload);
  } catch (const Error &) {
    conn_->Close();
    throw;
  }
}

bool Link::Adopted(const std::function<std::string()> &adopt, const std::vector<uint8_t> &frame, Deadline deadline) {
  auto guard = Acquire(deadline);
  const std::string refused = adopt();
  if (!refused.empty()) {
    const uint32_t rid = wire::DecodeHeader(frame.data()).request_id;
    conn_->SendFrame(wire::EncodeError({static_cast<int64_t>(llm_datadist::LLM_LINK_FAILED), refused}, rid), deadline);
    return false;
  }
  conn_->SendFrame(frame, deadline);
  return true;
}

void Link::Connect(Deadline deadline) {
  DropLeases();
  DropNixl();
  SetConn(nullptr);
  maps_.reset();  // mappings of the old owner's memfds go with its connection
  cma_refused_ = false;
  wire::Hello welcome;
  SetConn(Greet(false, deadline, rid_, welcome));
  peer_reverse_ = welcome.features & wire::kFeatureReverse;
  peer_eager_ = welcome.features & wire::kFeatureEagerWrite;
  token_ = wire::SplitToken(welcome.proof, welcome.features).second;
  SetPath(Path::kTcp, "");
  if (nixl_agent_) {
    ConnectNixl(welcome, deadline);
    return;
  }
  if (!same_host_) {
    SetPath(Path::kTcp, "forced tcp");
    return;
  }
  TryLocal(welcome, deadline);
}

void Link::TryLocal(const wire::Hello &welcome, Deadline deadline) {
  if (!local::HostIdentity::Current().ClaimsSameHost(welcome.boot_id)) {
    SetPath(Path::kTcp, "the peer is on another host (its boot id is not ours)");
    return;
  }
  if (!(welcome.features & wire::kFeatureLocal)) {
    SetPath(Path::kTcp, "peer says it is on this host but offers no local channel");
    return;
  }
  std::unique_ptr<Conn> lc;
  local::Cred cred;
  uint32_t rid = 0;
  wire::Hello again;
  std::shared_ptr<lease::OwnerProc> owner;
  std::string no_lease;
  try {
    lc = local::Connect(local::Name(welcome.pid, remote_), deadline);
    cred = local::PeerCred(lc->fd());
    if (tls_) lc->TlsConnect(*tls_, deadline);  // as over TCP: certificates decide who links
    // The pidfd before the handshake: a pid that died and was reused before this line cannot
    // complete a handshake on this connection.
    if (cred.WeMayRead()) owner = lease::OwnerProc::Open(cred.pid, no_lease);
    Handshake(*lc, false, deadline, rid, again);
  } catch (const Error &e) {
    if (e.code() == llm_datadist::LLM_TIMEOUT) throw;
    SetPath(Path::kTcp, std::string("peer says it is on this host, but its local channel failed: ") + e.what());
    return;
  }
  SetConn(std::move(lc));  // the TCP connection closes: the owner sees an idle connection end
  rid_ = rid;
  peer_eager_ = again.features & wire::kFeatureEagerWrite;
  token_ = wire::SplitToken(again.proof, again.features).second;  // the live control channel's
  const std::string who = "pid " + std::to_string(cred.pid) + ", uid " + std::to_string(cred.uid);
  if (cred.WeMayRead()) {
    peer_pid_ = cred.pid;
    if (allow_shm_) maps_ = std::make_unique<shm::Maps>(cred.pid);
    SetPath(Path::kCma,
            shm_forced_  ? "forced shm (" + who + "; cross-memory attach where the owner's memory is not shareable)"
            : allow_shm_ ? "same host, verified by the kernel (" + who +
                               "): shared memory for caches in shareable memory, cross-memory attach otherwise"
                         : "same host, verified by the kernel (" + who + "): cross-memory attach");
    if (!(again.features & wire::kFeatureLease)) return;
    if (!owner) {
      Log("link to cluster " + std::to_string(remote_) + ": no cache leases (" + no_lease + ")");
      return;
    }
    std::lock_guard<std::mutex> lock(lease_mu_);
    lease_owner_ = std::move(owner);
  } else {
    SetPath(Path::kLocalStream, "same host, verified by the kernel (" + who +
                                    "), but not ours to read: bytes stream over the local socket");
  }
}

nixl::ReadPath::Channel Link::NixlChannel() {
  nixl::ReadPath::Channel ch;
  ch.call = [this](uint8_t, const std::function<std::vector<uint8_t>(uint32_t)> &frame, std::vector<uint8_t> &payload,
                   Deadline deadline) { return Call(frame(++rid_), payload, deadline); };
  ch.answer = [this](std::vector<uint8_t> &payload, Deadline deadline) { return Answer(payload, deadline); };
  ch.send = [this](const std::function<std::vector<uint8_t>(uint32_t)> &frame, Deadline deadline) {
    conn_->SendFrame(frame(rid_), deadline);
  };
  ch.peer_gone = [this] { return !conn_ || conn_->closed() || conn_->PeerGone(); };
  ch.closed = [this] { return !conn_ || conn_->closed(); };
  ch.close = [this] {
    if (conn_) conn_->Close();
  };
  return ch;
}

void Link::ConnectNixl(const wire::Hello &welcome, Deadline deadline) {
  (void)welcome;
  if (!nixl_refusal_.empty()) {
    SetPath(Path::kTcp, "nixl forced, but " + nixl_refusal_);
    return;
  }
  auto path = std::make_shared<nixl::ReadPath>(nixl_agent_);
  try {
    nixl::ReadPath::Channel ch = NixlChannel();
    path->Connect(ch, deadline);
  } catch (const Error &e) {
    // An owner without NIXL (ERROR, or a peer of an earlier version that closes), or whose
    // metadata our NIXL refuses: TCP on this connection, and why.
    if (e.code() == llm_datadist::LLM_TIMEOUT) throw;
    path->Close();
    if (!conn_ || conn_->closed()) {
      wire::Hello again;
      SetConn(Greet(false, deadline, rid_, again));
      peer_reverse_ = again.features & wire::kFeatureReverse;
      peer_eager_ = again.features & wire::kFeatureEagerWrite;
      token_ = wire::SplitToken(again.proof, again.features).second;
    }
    SetPath(Path::kTcp, std::string("nixl forced but the peer offers no NIXL agent: ") + e.what());
    return;
  }
  {
    std::lock_guard<std::mutex> lock(nixl_mu_);
    nixl_ = std::move(path);
  }
  SetPath(Path::kNixl, "forced nixl (UCX; metadata over the link)");
}

void Link::DropNixl() {
  std::shared_ptr<nixl::ReadPath> path;
  {
    std::lock_guard<std::mutex> lock(nixl_mu_);
    path.swap(nixl_);
  }
  if (path) path->Close();
}

size_t Link::nixl_leases() {
  std::lock_guard<std::mutex> lock(nixl_mu_);
  return nixl_ ? nixl_->leases() : 0;
}

const char *Link::PathName(Path p) {
  switch (p) {
    case Path::kNixl: return "nixl";
    case Path::kCma: return "cma";
    case Path::kLocalStream: return "local";
    default: return "tcp";
  }
}

void Link::SetPath(Path p, const std::string &why) {
  path_ = p;
  {
    std::lock_guard<std::mutex> lock(why_mu_);
    why_ = why;
  }
  if (!why.empty()) Log("link to cluster " + std::to_string(remote_) + ": " + PathName(p) + " (" + why + ")");
}

const char *Link::path_name() const {
  const Path p = path_;
  return p == Path::kCma && shm_forced_ ? "shm" : PathName(p);
}

const char *Link::last_moved() const {
  switch (last_.load()) {
    case Moved::kShm: return "shm";
    case Moved::kCma: return "cma";
    case Moved::kStream: return "stream";
    default: return "";
  }
}

void Link::CmaRefused(const std::string &why) {
  const std::string what =
      "cross-memory attach to pid " + std::to_string(peer_pid_) + " refused by the kernel (" + why + ")";
  if (maps_ && allow_shm_) {
    if (!cma_refused_.exchange(true))
      SetPath(Path::kCma, what + ": shared memory where the owner's cache is in it, a stream elsewhere");
    return;
  }
  DropLeases();
  SetPath(Path::kLocalStream, what + ": bytes stream over the local socket");
}

void Link::ProbeCma(Deadline deadline) {
  auto guard = Acquire(deadline);
  if (path_ != Path::kCma || cma_refused_) return;
  uint8_t scratch = 0;
  const std::vector<iovec> local{{&scratch, 1}};
  const std::vector<iovec> remote{{nullptr, 1}};
  std::string why;
  if (local::VmCopy(peer_pid_, local, remote, false, why) == local::CopyResult::kRefused) CmaRefused(why);
}

std::string Link::PathReason() const {
  std::lock_guard<std::mutex> lock(why_mu_);
  return why_;
}

std::unique_ptr<Conn> Link::Greet(bool reverse, Deadline deadline, uint32_t &rid, wire::Hello &welcome) {
  auto conn = Conn::Connect(host_, port_, deadline, greeted_);
  if (tls_) conn->TlsConnect(*tls_, deadline);
  Handshake(*conn, reverse, deadline, rid, welcome);
  greeted_ = true;  // the peer listened here: a later refusal means it stopped
  return conn;
}

void Link::Handshake(Conn &conn, bool reverse, Deadline deadline, uint32_t &rid, wire::Hello &welcome) {
  uint32_t r = 0;
  wire::Hello hello = hello_;
  // A reverse channel is served here as the listener's connections are (ServeParked), eager
  // WRITE included: its HELLO says so, and the listener's pushes on it take one round trip.
  hello.features = reverse ? wire::kFeatureReverse | wire::kFeatureEagerWrite : 0;
  std::string nonce;
  if (!secret_.empty()) {
    hello.features |= auth::kFeatureAuth;
    nonce = auth::Nonce();
  }
  hello.proof = nonce;
  if (reverse && !token_.empty()) {  // proof that we hold the link's control channel
    hello.features |= wire::kFeatureToken;
    hello.proof += token_;
  }
  std::vector<uint8_t> payload;
  ++r;
  wire::Header h;
  try {
    h = CallOn(conn, r, wire::EncodeHello(wire::kHello, hello, r), payload, deadline);
  } catch (const Error &e) {
    // A listener that requires TLS drops a plain HELLO: say so, as Python's handshake does
    // (the one place for both APIs: every connection of a link says HELLO here).
    if (tls_ || e.code() != llm_datadist::LLM_LINK_FAILED || !conn.closed()) throw;
    Fail(llm_datadist::LLM_LINK_FAILED, std::string(e.what()) + " during the handshake (does it require TLS?)");
  }
  if (h.type != wire::kWelcome) ProtocolViolation("expected WELCOME");
  welcome = wire::DecodeHello(payload);
  const std::string who = "the peer at " + FormatHostPort(host_, port_);
  if (welcome.cluster_id != remote_) {
    if (!take_peer_id_)
      Fail(llm_datadist::LLM_LINK_FAILED,
           who + " is cluster " + std::to_string(welcome.cluster_id) + ", not " + std::to_string(remote_));
    remote_ = welcome.cluster_id;
  }
  take_peer_id_ = false;
  const bool required = welcome.features & auth::kFeatureAuth;
  if (required && secret_.empty())
    Fail(llm_datadist::LLM_LINK_FAILED, who + " requires a shared secret (datadist.AuthSecret / DATADIST_AUTH_SECRET)");
  if (!secret_.empty()) {
    // The server must prove the secret before we prove it: a peer without it learns nothing.
    // A link token (kFeatureToken) ends the server's proof: the challenge is the rest.
    const std::string server_part = wire::SplitToken(welcome.proof, welcome.features).first;
    if (!required || server_part.size() != auth::kNonceBytes + auth::kMacBytes)
      Fail(llm_datadist::LLM_LINK_FAILED, who + " did not prove the shared secret");
    std::string server_nonce = server_part.substr(0, auth::kNonceBytes);
    std::string want = auth::ServerProof(secret_, nonce, server_nonce, remote_, hello.cluster_id);
    if (!auth::Same(want, server_part)) Fail(llm_datadist::LLM_LINK_FAILED, who + " failed to prove the shared secret");
    ++r;
    h = CallOn(conn, r, wire::EncodeAuth(auth::ClientProof(secret_, nonce, server_nonce, remote_, hello.cluster_id), r),
               payload, deadline);
    if (h.type != wire::kOk) ProtocolViolation("expected OK after AUTH");
  }
  rid = r;
}

Link::~Link() { StopReverse(); }

void Link::StopReverse() { rev_io_.Stop(); }

wire::Header Link::Answer(std::vector<uint8_t> &payload, Deadline deadline) {
  wire::Header h = AnswerOn(*conn_, rid_, payload, deadline);
  heard_ = Clock::now();
  return h;
}

wire::Header Link::Call(const std::vector<uint8_t> &frame, std::vector<uint8_t> &payload, Deadline deadline) {
  conn_->SendFrame(frame, deadline);
  return Answer(payload, deadline);
}

void Link::Prepare(Deadline deadline) {
  if (closing_) Fail(llm_datadist::LLM_NOT_YET_LINK, "link to cluster " + std::to_string(remote_) + " was unlinked");
  // The idle check: a connection with something to read between requests was closed by its
  // owner (or broke the protocol), and is dialled anew before the request goes. It cannot
  // close the race with an owner closing just after it (that transfer fails, as ever), so a
  // connection that gave a whole answer within kFresh (back-to-back calls: a layer loop, a
  // bench) is taken as open without the poll; bytes read ahead (Buffered) still count.
  if (conn_ && !conn_->closed()) {
    const bool fresh = Clock::now() - heard_ < kFresh;
    if ((fresh && conn_->Buffered() == 0) || !conn_->PeerGone()) return;
  }
  if (reverse_end_) {
    SetConn(nullptr);
    Fail(llm_datadist::LLM_LINK_FAILED,
         "the reverse channel of cluster " + std::to_string(remote_) + " closed; it must link again");
  }
  try {
    Connect(deadline);
  } catch (const Error &e) {
    // as Python: a link that cannot be reopened is a broken link
    if (e.code() == llm_datadist::LLM_TIMEOUT) throw;
    Fail(llm_datadist::LLM_LINK_FAILED, "link to cluster " + std::to_string(remote_) + " is down: " + e.what());
  }
}

void Link::DropLeases(const std::shared_ptr<lease::Leased> &only) {
  std::map<LeaseKey, std::shared_ptr<lease::Leased>> gone;  // closed outside the mutex
  std::lock_guard<std::mutex> lock(lease_mu_);
  if (!only) {
    gone.swap(leases_);
    lease_owner_.reset();
    return;
  }
  for (auto it = leases_.begin(); it != leases_.end(); ++it)
    if (it->second == only) {
      leases_.erase(it);
      return;
    }
}

std::shared_ptr<lease::Leased> Link::AskLease(const LeaseKey &key, Deadline deadline) {
  auto guard = Acquire(deadline);
  Prepare(deadline);
  std::shared_ptr<lease::OwnerProc> owner;
  {
    std::lock_guard<std::mutex> lock(lease_mu_);
    auto it = leases_.find(key);
    if (it != leases_.end()) return it->second;  // another thread asked meanwhile
    owner = lease_owner_;
  }
  if (!owner || path_ != Path::kCma) return nullptr;
  wire::LeaseRequest q;
  q.kind = std::get<0>(key);
  (q.kind == wire::kCacheId ? q.a : q.b) = std::get<1>(key);
  // Reads ask for the memfds too: a cache in the owner's shared memory is read by memcpy.
  q.flags = std::get<2>(key) ? wire::kLeaseWrite : (maps_ && allow_shm_ ? wire::kFlagShm : 0);
  std::vector<uint8_t> payload;
  wire::Header h;
  try {
    h = Call(wire::EncodeLeaseRequest(q, ++rid_), payload, deadline);  // ERROR: the refusal
  } catch (const Error &e) {
    // An owner that cannot lease now (out of fence descriptors: FEATURE_NOT_ENABLED, lease.cc)
    // still answers requests: this transfer asks it. Any other refusal (no such cache, writes not allowed) is the
    // transfer's answer.
    if (e.code() == llm_datadist::LLM_FEATURE_NOT_ENABLED) return nullptr;
    throw;
  }
  std::shared_ptr<lease::Leased> l;
  std::string why;
  try {
    if (h.type != wire::kCacheLease) ProtocolViolation("expected CACHE_LEASE");
    wire::CacheLease msg = wire::DecodeCacheLease(payload);
    if (q.kind == wire::kCacheId && msg.cache_id != q.a)
      ProtocolViolation("asked a lease on cache " + std::to_string(q.a) + ", got one on " +
                        std::to_string(msg.cache_id));
    std::string no_shm;
    const uint64_t cache_id = msg.cache_id;  // refusals name the cache, not the key's field
    l = lease::Make(std::move(msg), cache_id, std::get<2>(key), owner, why, allow_shm_ ? maps_.get() : nullptr,
                    &no_shm);
    if (!no_shm.empty())
      Log("link to cluster " + std::to_string(remote_) + ": leased cache without shared memory (" + no_shm + ")");
  } catch (const Error &) {
    conn_->Close();
    throw;
  }
  std::vector<std::shared_ptr<lease::Leased>> gone;  // closed outside the mutex
  std::lock_guard<std::mutex> lock(lease_mu_);
  if (!l) {
    Log("link to cluster " + std::to_string(remote_) + ": no cache leases (" + why +
        "): every transfer asks the owner");
    lease_owner_.reset();  // until the link reconnects
    leases_.clear();
    return nullptr;
  }
  if (lease_owner_ != owner) return nullptr;  // dropped meanwhile (a failed copy on another thread)
  // Leases of caches that went (revoked) are dropped here, and the oldest beyond kMaxLeases:
  // a reader of one cache per request must not keep a fence (a descriptor) per request.
  for (auto it = leases_.begin(); it != leases_.end();) {
    if (it->first == key || it->second->fence->Revoked()) {
      gone.push_back(std::move(it->second));
      it = leases_.erase(it);
    } else {
      ++it;
    }
  }
  while (leases_.size() >= kMaxLeases) {
    auto oldest = leases_.begin();
    for (auto it = leases_.begin(); it != leases_.end(); ++it)
      if (it->second->seq < oldest->second->seq) oldest = it;
    gone.push_back(std::move(oldest->second));
    leases_.erase(oldest);
  }
  l->seq = ++lease_seq_;
  leases_[key] = l;
  return l;
}

bool Link::TransferLeased(const wire::Request &req, const std::vector<iovec> &local, bool write, Deadline deadline) {
  if ((req.kind != wire::kCacheId && req.kind != wire::kBlocksKey) || path_ != Path::kCma) return false;
  const LeaseKey key{req.kind, req.kind == wire::kCacheId ? req.a : req.b, write};
  std::shared_ptr<lease::Leased> l;
  {
    std::lock_guard<std::mutex> lock(lease_mu_);
    if (!lease_owner_) return false;
    auto it = leases_.find(key);
    if (it != leases_.end()) l = it->second;
  }
  if (!l && !(l = AskLease(key, deadline))) return false;
  std::string why;
  bool used_shm = false;
  const bool refused = cma_refused_;
  switch (lease::Copy(*l, req, local, why, refused, &used_shm)) {
    case lease::Outcome::kDone: last_ = used_shm ? Moved::kShm : Moved::kCma; return true;
    case lease::Outcome::kRevoked:
      DropLeases(l);  // the owner's answer to the request says what became of the cache
      return false;
    case lease::Outcome::kRefused: {
      if (refused) return false;  // not in shared memory: the owner streams it
      auto guard = Acquire(deadline);
      if (path_ == Path::kCma && peer_pid_ == l->owner->pid() && !cma_refused_) CmaRefused(why);
      return false;
    }
    case lease::Outcome::kFailed:
      Log("link to cluster " + std::to_string(remote_) + ": leased " + (write ? "write" : "read") + " failed (" + why +
          "): asking the owner");
      DropLeases();
      return false;
  }
  return false;
}

bool Link::ReadLeasedNow(const wire::Request &req, const std::vector<iovec> &local) {
  if (req.flags & wire::kFlagChecksum) return false;  // checked pulls take no lease (Read)
  if ((req.kind != wire::kCacheId && req.kind != wire::kBlocksKey) || path_ != Path::kCma) return false;
  std::shared_ptr<lease::Leased> l;
  {
    std::lock_guard<std::mutex> lock(lease_mu_);
    if (!lease_owner_) return false;
    auto it = leases_.find(LeaseKey{req.kind, req.kind == wire::kCacheId ? req.a : req.b, false});
    if (it == leases_.end()) return false;
    l = it->second;
  }
  std::string why;
  return lease::Copy(*l, req, local, why) == lease::Outcome::kDone;
}

void Link::Read(const wire::Request &req, const std::vector<iovec> &local, Deadline deadline) {
  const bool checked = req.flags & wire::kFlagChecksum;  // no lease: its copies carry no checksum
  if (!checked && TransferLeased(req, local, false, deadline)) return;
  auto guard = Acquire(deadline);
  Prepare(deadline);
  if (path_ == Path::kNixl && nixl_) {
    nixl::ReadPath::Channel ch = NixlChannel();
    blocking::AboutToBlock();  // NIXL waits in its own loops, which call no hook
    nixl_->Read(ch, req, local, deadline);
    return;
  }
  // Small reads stream over the local socket even where cross-memory attach works: one round
  // trip, where a grant costs the same round trip plus a copy call and a RELEASE.
  if (path_ == Path::kCma && IovBytes(local) > grant_above_ && ReadGranted(req, local, deadline)) return;
  std::vector<uint8_t> payload;
  last_ = Moved::kStream;
  conn_->SendFrame(wire::EncodeRequest(wire::kRead, req, ++rid_), deadline);
  // The answer comes after the owner's wake-up at the soonest: waited for, not first looked
  // for with a receive that finds nothing (one system call less a small pull).
  conn_->AwaitAnswer(deadline);
  wire::Header h = Answer(payload, deadline);
  if (h.type != wire::kReadData) {
    conn_->Close();
    ProtocolViolation("expected READ_DATA");
  }
  uint64_t n = wire::DecodeU64(payload);
  if (n != IovBytes(local)) {
    conn_->Close();
    ProtocolViolation("owner announced " + std::to_string(n) + " bytes, " + std::to_string(IovBytes(local)) +
                      " were asked for");
  }
  conn_->RecvV(local, deadline);
  if (checked) ReadVerdict(local, deadline);
}

size_t Link::ReadPipelined(const std::function<const PipedRead *(size_t)> &at,
                           const std::function<void(size_t, const Error *)> &ended) {
  const PipedRead *first = at(0);
  if (!first) return 0;
  // One pull as Read runs it alone: a checksummed one, or any on a path that does not stream.
  const auto alone = [&](const PipedRead &p) {
    try {
      Read(*p.req, *p.local, p.deadline);
    } catch (const Error &e) {
      ended(0, &e);
      return size_t{1};
    }
    ended(0, nullptr);
    return size_t{1};
  };
  if ((first->req->flags & wire::kFlagChecksum) || !Streams()) return alone(*first);
  std::unique_ptr<Busy> guard;
  try {
    guard = Acquire(first->deadline, true, true);  // after any blocking transfer waiting for the link
    Prepare(first->deadline);
  } catch (const Error &e) {
    if (guard) heard_ = Deadline();  // as a failed transfer leaves it (Busy)
    guard.reset();
    ended(0, &e);
    return 1;
  }
  if (!Streams()) {  // the reconnect took another path
    guard.reset();
    return alone(*first);
  }
  struct Flight {
    size_t i;
    const PipedRead *p;
    uint32_t rid;
    uint64_t bytes;
    size_t frame;
  };
  std::deque<Flight> flight;  // sent, answers not all in yet, in order (the front one being read)
  uint64_t bytes_out = 0;     // their answers' bytes
  size_t frames_out = 0;      // their request frames' bytes
  size_t next = 0;            // the next pull to send
  std::vector<uint8_t> frame, payload;
  size_t framed = SIZE_MAX;  // the pull `frame` encodes (with request id rid_ + 1)
  // The connection broke under pull `i` (or its deadline passed): it and every pull in flight
  // fail; those not sent are left to the caller's next call (a reconnect).
  const auto broken = [&](size_t i, const Error &e) {
    if (conn_ && !conn_->closed()) conn_->Close();
    heard_ = Deadline();
    ended(i, &e);
    const bool timed_out = e.code() == llm_datadist::LLM_TIMEOUT;
    const Error rest(timed_out ? llm_datadist::LLM_TIMEOUT : llm_datadist::LLM_LINK_FAILED,
                     "link to cluster " + std::to_string(remote_) + ": the connection was closed with this pull's " +
                         "READ on it, sent with one that " + (timed_out ? "timed out" : "failed") + " (" + e.what() +
                         ")");
    for (const Flight &g : flight)
      if (g.i != i) ended(g.i, &rest);
    flight.clear();
  };
  // READs sent while the window has room, each under its own deadline; false when a send
  // broke the connection (every pull in flight ended).
  const auto fill = [&]() {
    while (flight.size() < kPipeCount) {
      // A blocking transfer waits for the link: send no more, let it go once these are in.
      if (next > 0 && waiting_.load(std::memory_order_relaxed) > 0) break;
      const PipedRead *p = next == 0 ? first : at(next);
      if (!p || (p->req->flags & wire::kFlagChecksum)) break;  // a checksummed one: alone, next call
      if (Clock::now() >= p->deadline) {
        if (!flight.empty()) break;  // ended once the window emptied: in order
        const Error late(llm_datadist::LLM_TIMEOUT, "no time left for a transfer");  // as Acquire says
        ended(next++, &late);
        continue;
      }
      const uint64_t bytes = IovBytes(*p->local);
      if (framed != next) {
        try {
          frame = wire::EncodeRequest(wire::kRead, *p->req, rid_ + 1);
        } catch (const Error &e) {  // a request the codec refuses: that pull's outcome, in order
          if (!flight.empty()) break;
          ended(next++, &e);
          continue;
        }
        framed = next;
      }
      if (!flight.empty() && (bytes_out + bytes > kPipeBytes || frames_out + frame.size() > kPipeFrames ||
                              p->deadline < flight.back().p->deadline))
        break;
      ++rid_;
      try {
        conn_->SendFrame(frame, p->deadline);
      } catch (const Error &e) {
        broken(next++, e);
        return false;
      }
      flight.push_back({next, p, rid_, bytes, frame.size()});
      bytes_out += bytes;
      frames_out += frame.size();
      ++next;
      framed = SIZE_MAX;
    }
    return true;
  };
  last_ = Moved::kStream;
  try {
    for (;;) {
      if (!fill() || flight.empty()) return next;
      // The oldest answer, under its pull's deadline; the READs behind it are with the owner.
      const Flight f = flight.front();
      try {
        const wire::Header h = AnswerOn(*conn_, f.rid, payload, f.p->deadline);
        heard_ = Clock::now();
        if (h.type != wire::kReadData) {
          conn_->Close();
          ProtocolViolation("expected READ_DATA");
        }
        const uint64_t n = wire::DecodeU64(payload);
        if (n != f.bytes) {
          conn_->Close();
          ProtocolViolation("owner announced " + std::to_string(n) + " bytes, " + std::to_string(f.bytes) +
                            " were asked for");
        }
        // Alone in flight, nothing else issued yet (the first pulls of a batch): its bytes a
        // part at a time, so that a pull issued meanwhile has its READ sent before the owner
        // runs out of requests, not after this answer's tail is read.
        // Parts grow with what arrived (kPipePart, then doubling): a few calls for any size.
        uint64_t in = 0, off = 0;
        size_t at_iov = 0;
        while (flight.size() == 1 && f.bytes - in > std::max(kPipePart, in)) {
          const uint64_t part = std::max(kPipePart, in);
          conn_->RecvV(Take(*f.p->local, at_iov, off, part), f.p->deadline);
          in += part;
          if (!fill()) return next;
        }
        conn_->RecvV(in == 0 ? *f.p->local : Take(*f.p->local, at_iov, off, f.bytes - in), f.p->deadline);
      } catch (const Error &e) {
        if (conn_->closed()) {
          broken(f.i, e);
          return next;
        }
        flight.pop_front();  // the owner's ERROR: the stream is at the next answer's start
        bytes_out -= f.bytes;
        frames_out -= f.frame;
        ended(f.i, &e);
        continue;
      }
      flight.pop_front();
      bytes_out -= f.bytes;
      frames_out -= f.frame;
      ended(f.i, nullptr);
    }
  } catch (...) {  // not an Error (bad_alloc): the stream's place is unknown
    if (conn_ && !conn_->closed()) conn_->Close();
    heard_ = Deadline();
    throw;
  }
}

void Link::ReadVerdict(const std::vector<iovec> &local, Deadline deadline) {
  std::vector<uint8_t> payload;
  wire::Header h = Answer(payload, deadline);
  wire::Checksum ck;
  try {
    ck = verify::Expect(h, payload);
  } catch (const Error &) {
    conn_->Close();
    throw;
  }
  const std::string why = verify::Compare(ck, local);
  try {  // the verdict: only ok lets the owner consume the key; undelivered counts as not ok
    conn_->SendFrame(wire::EncodeRelease({0, why.empty()}, rid_), deadline);
  } catch (const Error &) {
  }
  if (!why.empty()) verify::Mismatch(why);
}

bool Link::ReadGranted(const wire::Request &req, const std::vector<iovec> &local, Deadline deadline) {
  wire::Request granted = req;
  granted.flags |= wire::kFlagGrant;
  const bool cma_refused = cma_refused_;
  // SHM where the owner's memory may be mapped here and memcpy pays (or is all we have left).
  const bool ask_shm = maps_ && allow_shm_ && (cma_refused || shm::Pays(req.tensors.size(), req.lengths));
  if (ask_shm) granted.flags |= wire::kFlagShm;
  std::vector<uint8_t> payload;
  wire::Header h = Call(wire::EncodeRequest(wire::kRead, granted, ++rid_), payload, deadline);
  wire::Grant grant;
  wire::ShmGrant sgrant;
  const bool shm = h.type == wire::kShmGrant;
  try {
    if (shm) {
      if (!ask_shm) ProtocolViolation("SHM_GRANT for a read that did not ask for shared memory");
      sgrant = wire::DecodeShmGrant(payload);
      if (sgrant.fds.size() != req.tensors.size()) ProtocolViolation("shm grant does not match the request");
    } else {
      if (h.type != wire::kGrant) ProtocolViolation("expected GRANT");
      grant = wire::DecodeGrant(payload);
      if (grant.bases.size() != req.tensors.size()) ProtocolViolation("the grant does not match the request");
    }
  } catch (const Error &) {
    conn_->Close();
    throw;
  }
  wire::Checksum ck;  // with CHECKSUM, its frame follows the GRANT
  if (req.flags & wire::kFlagChecksum) {
    h = Answer(payload, deadline);
    try {
      ck = verify::Expect(h, payload);
    } catch (const Error &) {
      conn_->Close();
      throw;
    }
  }
  const uint64_t lease_id = shm ? sgrant.lease_id : grant.lease_id;
  auto release = [&](bool ok) {
    try {  // no answer comes; an undelivered RELEASE is taken back by the owner (TTL, close)
      conn_->SendFrame(wire::EncodeRelease({lease_id, ok}, 0), deadline);
    } catch (const Error &) {
    }
  };
  if (shm) {
    std::vector<shm::MappingPtr> maps;  // held until the copy ends: a later grant cannot unmap them
    std::string why;
    bool mapped = false;
    try {
      mapped = maps_->Resolve(sgrant.fds, sgrant.inos, maps, why);
      if (mapped) {
        shm::Copy(local, shm::Spans(maps, sgrant.offsets, req.offsets, req.lengths));
        last_ = Moved::kShm;
      }
    } catch (const Error &) {  // a lying owner: nothing copied, the connection cannot be trusted
      release(false);
      conn_->Close();
      throw;
    }
    if (mapped) {
      const std::string bad = (req.flags & wire::kFlagChecksum) ? verify::Compare(ck, local) : std::string();
      release(bad.empty());  // ok: the owner may consume the key
      if (!bad.empty()) verify::Mismatch(bad);
      return true;
    }
    release(false);
    // Its shared memory cannot be mapped here: cross-memory attach may still work.
    allow_shm_ = false;
    if (cma_refused) {
      SetPath(Path::kLocalStream, "shared memory of pid " + std::to_string(peer_pid_) + " unavailable too (" + why +
                                      "): bytes stream over the local socket");
      DropLeases();
      return false;
    }
    Log("link to cluster " + std::to_string(remote_) + ": shared memory of pid " + std::to_string(peer_pid_) +
        " unavailable (" + why + "): cross-memory attach");
    return ReadGranted(req, local, deadline);
  }
  if (cma_refused) {  // not in shareable memory, and we may not attach: the caller streams it
    release(false);
    return false;
  }
  // The owner's spans, in its address space: tensor-major, as `local` (entry i of both has
  // the same length). A base that would wrap is a lying owner: nothing is copied.
  std::vector<iovec> remote;
  remote.reserve(local.size());
  bool wraps = false;
  for (uint64_t base : grant.bases)
    for (size_t i = 0; i < req.offsets.size(); ++i) {
      uint64_t at = base + req.offsets[i];
      wraps |= at < base || at + req.lengths[i] < at;
      remote.push_back({reinterpret_cast<void *>(at), static_cast<size_t>(req.lengths[i])});
    }
  if (wraps || remote.size() != local.size()) {
    release(false);
    conn_->Close();
    ProtocolViolation("the grant names addresses that wrap around");
  }
  std::string why;
  local::CopyResult got;
  try {
    got = local::VmRead(peer_pid_, local, remote, why);
  } catch (const Error &) {
    release(false);
    throw;
  }
  if (got == local::CopyResult::kDone) {
    last_ = Moved::kCma;
    const std::string bad = (req.flags & wire::kFlagChecksum) ? verify::Compare(ck, local) : std::string();
    release(bad.empty());  // ok: the owner may consume the key
    if (!bad.empty()) verify::Mismatch(bad);
    return true;
  }
  release(false);
  // The kernel refused (nothing to retry on this pid): once this link saw
  // the refusal, shared memory where it can, a stream elsewhere, on the same connection.
  CmaRefused(why);
  return false;
}

void Link::Write(const wire::Request &req, const std::vector<iovec> &local, Deadline deadline) {
  if (TransferLeased(req, local, true, deadline)) return;
  auto guard = Acquire(deadline);
  Prepare(deadline);
  if (path_ == Path::kNixl && nixl_) {
    nixl::ReadPath::Channel ch = NixlChannel();
    blocking::AboutToBlock();
    nixl_->Write(ch, req, local, deadline);
    return;
  }
  std::vector<uint8_t> payload;
  if (peer_eager_ && IovBytes(local) <= wire::kEagerMax) {
    // One round trip: the request and its bytes in one send, then the one answer. A refusal
    // (ERROR) comes after the owner drained the bytes: the connection goes on.
    wire::Request eager = req;
    eager.flags |= wire::kFlagEager;
    const std::vector<uint8_t> frame = wire::EncodeRequest(wire::kWrite, eager, ++rid_);
    std::vector<iovec> out;
    out.reserve(local.size() + 1);
    out.push_back({const_cast<uint8_t *>(frame.data()), frame.size()});
    out.insert(out.end(), local.begin(), local.end());
    conn_->SendV(std::move(out), deadline);
    if (Answer(payload, deadline).type != wire::kOk) {
      conn_->Close();
      ProtocolViolation("expected OK after an eager WRITE");
    }
    return;
  }
  // Two steps: WRITE, its go-ahead, the bytes. A caller's EAGER flag is not ours to send
  // here (the owner would wait for bytes while we wait for its go-ahead).
  const wire::Request *sent = &req;
  wire::Request plain;
  if (req.flags & wire::kFlagEager) {
    plain = req;
    plain.flags &= ~wire::kFlagEager;
    sent = &plain;
  }
  wire::Header h = Call(wire::EncodeRequest(wire::kWrite, *sent, ++rid_), payload, deadline);
  if (h.type != wire::kOk) {
    conn_->Close();
    ProtocolViolation("expected OK");
  }
  conn_->SendV(local, deadline);
  h = Answer(payload, deadline);
  if (h.type != wire::kOk) {
    conn_->Close();
    ProtocolViolation("expected OK after the pushed bytes");
  }
}

void Link::Close(Deadline deadline, bool force) {
  if (force) {
    // At once: a transfer in flight has its
    // socket shut down under it (it fails LLM_LINK_FAILED; the connection closes when it
    // lets go of the link), and transfers waiting for the link fail the same way.
    if (TryAcquire()) {
      Busy guard(this);
      closing_ = true;
      SetConn(nullptr);
      DropNixl();
    } else {
      {
        std::lock_guard<std::mutex> lock(mu_);
        shut_ = true;
        if (conn_) conn_->Shutdown();
      }
      idle_.notify_all();
    }
    DropLeases();
    StopReverse();
    return;
  }
  auto guard = Acquire(deadline, false);
  std::string untold;
  try {
    Prepare(deadline);  // a broken connection is dialled anew, as CANN's unlink always dials
    std::vector<uint8_t> payload;
    Call(wire::EncodeEmpty(wire::kBye, ++rid_), payload, deadline);
  } catch (const Error &e) {
    untold = e.what();
  }
  closing_ = true;
  SetConn(nullptr);
  DropLeases();
  DropNixl();
  StopReverse();
  // As CANN's UnlinkCluster when it cannot reach the peer; our end is closed all the same,
  // so that a relink (or the forced unlink CANN programs retry with) succeeds.
  if (!untold.empty())
    Fail(llm_datadist::LLM_UNLINK_FAILED,
         "cluster " + std::to_string(remote_) + " could not be told of the unlink: " + untold);
}

}  // namespace datadist
