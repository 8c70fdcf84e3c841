#include "server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <system_error>

#include "addr.h"
#include "auth.h"
#include "errors.h"
#include "metrics.h"
#include "nixl.h"
#include "threads.h"
#include "verify.h"

namespace datadist {
namespace {

constexpr double kHandshakeTimeout = 10.0;  // s the server waits for a new connection's HELLO
constexpr double kFrameTimeout = 30.0;      // s a frame may take once its first byte arrived
constexpr double kServeTimeout = 120.0;     // s a stalled reader / writer is waited for
constexpr int kPollSliceMs = 100;           // how often blocked waits look at the stop flag
constexpr uint32_t kPreAuthPayload = 4096;  // largest frame before the handshake completed
// A connection's own buffers (PeerStream): a frame's grows by at most kReadChunk beyond the
// bytes that arrived, never to the length its header declares; one over kKeepBuffer is let
// go once its frame is served (besides, the connection's read-ahead: Conn::kAhead, 2 KiB).
// A step sends or receives at most kStepShare bytes of a transfer and serves the frames it
// read in one go (one recv's, at most 2 KiB of read-ahead; TLS: a record's) before it parks
// (ready again at once), so that one busy peer does not keep a thread from the others.
constexpr size_t kReadChunk = 64 << 10;
constexpr size_t kKeepBuffer = 64 << 10;
constexpr size_t kStepShare = 8 << 20;
constexpr size_t kSumShare = 1 << 20;   // bytes a step checksums at most (a checksummed READ's CRC)
constexpr size_t kSumSpans = 64 << 10;  // spans a step checksums at most (besides kStepShare bytes)
// Connections still in their handshake (server.h, "Budgets"): counted apart from those whose
// handshake is done, each budget smaller than the caps on those.
constexpr size_t kPreAuthPerPeer = 32;   // from one IP address, or one uid on the local channel
constexpr size_t kPreAuthNonReader = 2;  // from a uid that may not read this process (local channel)
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
// How long a stalled writer is waited for (kServeTimeout; SetWriteTimeout: tests).
std::atomic<double> write_timeout{kServeTimeout};
// A refused eager WRITE's bytes are drained into this, a share of a step at a time.
constexpr size_t kDrainChunk = 64 << 10;

double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

/// One non-blocking try at sending a last word before closing (an ERROR, BYE's OK): what the
/// socket takes now, or nothing.
void TrySend(Conn &c, const std::vector<uint8_t> &frame) {
  Spans out;
  out.iov.push_back({const_cast<uint8_t *>(frame.data()), frame.size()});
  short want = 0;
  try {
    (void)c.SendSome(out, want);
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
      : lease_(std::move(lease)),
        book_(book),
        pid_(pid),
        since_(Clock::now()),
        cluster_(cluster),
        asked_(asked),
        nbytes_(lease_->nbytes) {}
  Granted(std::unique_ptr<Lease> lease, NixlGrantInfo nixl, uint64_t cluster, Clock::time_point asked)
      : lease_(std::move(lease)),
        book_(nullptr),
        pid_(0),
        since_(Clock::now()),
        cluster_(cluster),
        asked_(asked),
        nbytes_(lease_->nbytes),
        nixl_(std::move(nixl)) {
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
Deadline NextCheck(const Grants &grants) { return grants.empty() ? Deadline::max() : After(kPollSliceMs / 1000.0); }

}  // namespace

/// One connection's bytes between its wake-ups (iopool.h): the frame being read (its header,
/// then its payload, each as far as it arrived), and the answers not sent yet (frames queued
/// here, and spans of registered memory a READ answers with, sent from where they lie). Every
/// call is non-blocking: what the socket cannot give or take now is left for the next wake-up,
/// and interest() says which event that is. Deadlines are the caller's to keep, from
/// frame_until() and send_until(). Used by the one pool thread that runs its task at a time;
/// Shutdown (Cancel) and buffered() may be called from any thread.
class PeerStream {
 public:
  explicit PeerStream(std::unique_ptr<Conn> conn) : conn_(std::move(conn)) {}
  Conn *conn() { return conn_.get(); }  // null once handed on
  int fd() const { return conn_ ? conn_->fd() : -1; }
  /// The connection, handed on (a reverse channel): nothing may be left to send.
  std::unique_ptr<Conn> Take() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::move(conn_);
  }
  void Shutdown() {
    std::lock_guard<std::mutex> lock(mu_);
    if (conn_) conn_->Shutdown();
  }
  void Close() {
    if (conn_) conn_->Close();
  }
  /// What its park waits for. Bytes taken from the socket already and not served (read ahead
  /// with a handshake's last frame before the connection was handed here, or TLS's decrypted
  /// ones) are not reported by the socket: such a connection waits for room instead, which is
  /// there at once, and its step reads them.
  uint32_t interest() const {
    if (want_ != POLLOUT && conn_ && conn_->Buffered()) return EPOLLOUT;
    return want_ == POLLOUT ? EPOLLOUT : EPOLLIN;
  }
  /// The next step reads (a step that stopped while more may be there: epoll says at once).
  void WantInput() { want_ = POLLIN; }
  /// The next step waits for `want` (POLLIN or POLLOUT: what a TLS handshake step asked).
  void Want(short want) { want_ = want; }

  /// Reads what has arrived of the next frame: true once it is whole (header(), payload()
  /// until the next call); false when the socket has no more for now. A header announcing a
  /// payload over `cap` is refused before a byte of it is read (ProtocolViolation, the
  /// connection still open: the caller may answer ERROR); EOF or a broken socket throw too.
  bool ReadFrame(uint32_t cap) {
    short want = POLLIN;
    for (;;) {
      if (have_ < wire::kHeaderSize) {
        const size_t got = conn_->ReadSome(head_ + have_, wire::kHeaderSize - have_, want);
        held_ = payload_.capacity() + conn_->ahead_held();
        if (got == 0) return Wait(want);
        if (have_ == 0) since_ = Clock::now();
        have_ += got;
        if (have_ < wire::kHeaderSize) continue;
        h_ = wire::DecodeHeader(head_);
        if (h_.length > cap)
          ProtocolViolation("a frame of " + std::to_string(h_.length) + " bytes where at most " + std::to_string(cap) +
                            " are allowed");
        payload_.clear();
      }
      const size_t at = payload_.size();
      if (at == h_.length) {
        have_ = 0;
        since_ = Deadline();
        return true;
      }
      // Grown by what may arrive now, at most kReadChunk past what did: never to the length
      // a stranger declared.
      const size_t ask = std::min<size_t>(h_.length - at, kReadChunk);
      payload_.resize(at + ask);
      size_t got = 0;
      try {
        got = conn_->ReadSome(payload_.data() + at, ask, want);
      } catch (...) {
        payload_.resize(at);
        throw;
      }
      payload_.resize(at + got);
      held_ = payload_.capacity() + conn_->ahead_held();
      if (got == 0) return Wait(want);
    }
  }
  const wire::Header &header() const { return h_; }
  const std::vector<uint8_t> &payload() const { return payload_; }
  /// A frame's buffer over kKeepBuffer is let go once it was served.
  void Recycle() {
    if (payload_.capacity() > kKeepBuffer) std::vector<uint8_t>().swap(payload_);
    held_ = payload_.capacity() + (conn_ ? conn_->ahead_held() : 0);
  }
  /// When the frame begun must be whole: 30 s from its first byte (max: none begun).
  Deadline frame_until() const {
    return have_ == 0
               ? Deadline::max()
               : since_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(kFrameTimeout));
  }
  /// The bytes its frame buffer holds now (for tests: Server::buffered).
  size_t buffered() const { return held_; }

  /// A small answer, sent by Flush after what is queued already.
  void Queue(std::vector<uint8_t> frame) {
    Started();
    frames_.push_back(std::move(frame));
    out_.iov.push_back({frames_.back().data(), frames_.back().size()});
  }
  /// Spans sent by Flush after what is queued, from where they lie: their memory must stay
  /// (a READ's lease holds it) until nothing is left to send.
  void QueueSpans(const std::vector<iovec> &iov) {
    Started();
    out_.iov.insert(out_.iov.end(), iov.begin(), iov.end());
  }
  /// Sends what the socket takes now of what is queued, at most a step's share: true once
  /// everything was sent.
  bool Flush() {
    if (out_.done()) return true;
    short want = POLLOUT;
    if (!conn_->SendSome(out_, want, kStepShare)) return Wait(want);
    out_.clear();
    frames_.clear();
    return true;
  }
  /// A last word before closing: what the socket takes now; never throws.
  void FlushOnce() {
    try {
      if (conn_ && !conn_->closed()) (void)Flush();
    } catch (const std::exception &) {
    }
  }
  bool sending() const { return !out_.done(); }
  /// When what is queued must have gone: 120 s from when the queue was last empty.
  Deadline send_until() const { return sending() ? send_until_ : Deadline::max(); }
  /// Fills `in` with what has arrived (a WRITE's data, into its lease's memory), at most a
  /// step's share: true once full.
  bool Receive(Spans &in) {
    short want = POLLIN;
    return conn_->RecvSome(in, want, kStepShare) || Wait(want);
  }
  /// Reads and drops what has arrived of `left` bytes (a refused eager WRITE's), at most a
  /// step's share, into a fixed scratch buffer: true once `left` is 0.
  bool Discard(uint64_t &left) {
    thread_local uint8_t scratch[kDrainChunk];
    short want = POLLIN;
    for (size_t moved = 0; left > 0;) {
      if (moved >= kStepShare) return Wait(POLLIN);  // the rest at the next step (at once)
      const size_t got = conn_->ReadSome(scratch, std::min<uint64_t>(left, kDrainChunk), want);
      if (got == 0) return Wait(want);
      left -= got;
      moved += got;
    }
    return true;
  }

 private:
  bool Wait(short want) {
    want_ = want;
    return false;
  }
  void Started() {
    if (out_.done()) {
      out_.clear();
      frames_.clear();
      send_until_ = After(kServeTimeout);
    }
  }
  std::mutex mu_;  // conn_ handed on (Take) vs Shutdown
  std::unique_ptr<Conn> conn_;
  short want_ = POLLIN;
  uint8_t head_[wire::kHeaderSize] = {};
  size_t have_ = 0;  // bytes of the frame begun (header first): 0, none begun
  wire::Header h_{};
  std::vector<uint8_t> payload_;
  Deadline since_{};  // the frame begun's first byte
  std::atomic<size_t> held_{0};
  Spans out_;
  std::deque<std::vector<uint8_t>> frames_;  // the queued frames out_ points into
  Deadline send_until_ = Deadline::max();
};

/// A READ's answer being sent, or a WRITE's data being received, under its lease, across the
/// connection's parks (ServeStep).
struct ServeJob {
  enum class Kind { kNone, kRead, kWrite, kDrain };
  Kind kind = Kind::kNone;
  std::unique_ptr<Lease> lease;
  std::unique_ptr<metrics::Serving> served;  // gone before Done: counted failed
  uint32_t rid = 0;
  bool checksum = false;                // READ: its CHECKSUM frame follows the data, then the reader's verdict
  std::vector<uint8_t> checksum_frame;  // READ: that frame, read fault-safely before the data went
  bool tail = false;                    // READ: the data sent, the CHECKSUM queued
  // READ with CHECKSUM: its CRC, computed a step's share at a time (SumStep) before a byte
  // goes; where it stands (span, bytes into it), the CRC and the bytes so far.
  bool summing = false;
  size_t sum_span = 0, sum_off = 0;
  uint32_t sum_crc = 0;
  uint64_t sum_bytes = 0;
  size_t next_span = 0;       // the first span not queued to send (READ) or to receive into (WRITE)
  int parts_this_step = 0;    // parts of its spans moved in this step (ServeStep)
  uint64_t cluster = 0;       // READ: whom it is counted for (a hole found while summing)
  Clock::time_point asked{};  // READ: when it was asked
  // A same-host or NIXL grant with CHECKSUM: what is done once the CRC is whole (the grant
  // filed and answered, from the job's lease and CRC) instead of sending data.
  std::function<void(Grants &, PeerStream &, ServeJob &)> granted;
  Spans data;                        // WRITE: the lease's spans being filled
  uint64_t drain_left = 0;           // kDrain: a refused eager WRITE's bytes still to drop
  std::vector<uint8_t> refusal;      // kDrain: its ERROR, sent once they are all dropped
  Deadline until = Deadline::max();  // 120 s from the request, as a stalled reader's or writer's
  void Reset() {
    if (summing) metrics::RecordSince(metrics::Op::kServeRead, cluster, 0, asked, llm_datadist::LLM_FAILED);
    served.reset();  // counted failed unless Done
    lease.reset();   // unsettled: nothing consumed
    *this = ServeJob();
  }
};

bool Dispatch(const ServeContext &ctx, Grants &grants, ServeJob &job, PeerStream &s, const wire::Header &h,
              const std::vector<uint8_t> &payload);

namespace {

/// The earliest deadline in force: the frame begun, the answer queued, the transfer.
Deadline Due(const PeerStream &s, const ServeJob &job) {
  return std::min({s.frame_until(), s.send_until(), job.kind == ServeJob::Kind::kNone ? Deadline::max() : job.until});
}

/// A checksummed READ's next share of its CRC (at most kSumShare bytes and kSumSpans spans,
/// read fault-safely: verify::Continue): true once the CRC is whole. A request's spans may
/// repeat (4M spans of a whole tensor: terabytes), so its CRC is never computed in one go on
/// the I/O thread, which the other connections share; the 120 s of the job bound it in all.
/// Throws verify's errors (a hole: LLM_DEVICE_MEM_ERROR).
bool SumStep(ServeJob &job) {
  const Lease &lease = *job.lease;
  std::vector<iovec> part;
  size_t bytes = 0;
  while (job.sum_span < lease.spans() && bytes < kSumShare && part.size() < kSumSpans) {
    const iovec v = lease.Span(job.sum_span);
    const size_t len = std::min(v.iov_len - job.sum_off, kSumShare - bytes);
    part.push_back({static_cast<uint8_t *>(v.iov_base) + job.sum_off, len});
    bytes += len;
    job.sum_off += len;
    if (job.sum_off == v.iov_len) {
      ++job.sum_span;
      job.sum_off = 0;
    }
  }
  job.sum_crc = verify::Continue(lease, part, job.sum_crc);
  job.sum_bytes += bytes;
  return job.sum_span == lease.spans();
}

/// Makes `job` a checksummed grant's: the CRC of `lease`'s spans computed a share per step
/// (Progress), then `then` (which files and answers the grant, or answers an ERROR).
void StartSum(ServeJob &job, std::unique_ptr<Lease> lease, uint32_t rid, uint64_t cluster, Clock::time_point asked,
              std::function<void(Grants &, PeerStream &, ServeJob &)> then) {
  job.kind = ServeJob::Kind::kRead;
  job.until = After(kServeTimeout);
  job.rid = rid;
  job.lease = std::move(lease);
  job.cluster = cluster;
  job.asked = asked;
  job.summing = true;
  job.granted = std::move(then);
}

/// The next part of a transfer's spans (at most kSumSpans of them, from `job.next_span`),
/// expanded from its lease: what a READ's data is sent from, or a WRITE's received into, part
/// after part. False when none is left.
bool NextSpans(ServeJob &job, std::vector<iovec> &out) {
  const size_t from = job.next_span;
  if (from >= job.lease->spans()) return false;
  out.clear();
  job.lease->Expand(from, kSumSpans, out);
  job.next_span = from + out.size();
  return true;
}

/// READ_DATA's header and the first part of the read's spans, queued together, so that a
/// small read leaves in one send (the header sent alone made two, and a second wake-up of the
/// reader). Later parts follow, one a step (Progress).
void QueueReadData(ServeJob &job, PeerStream &s) {
  s.Queue(wire::EncodeU64(wire::kReadData, job.lease->nbytes, job.rid));
  std::vector<iovec> part;
  if (NextSpans(job, part)) {
    s.QueueSpans(part);
    ++job.parts_this_step;
  }
}

/// The transfer in progress, once what was queued before it has gone: true when it may go on
/// now (or is done), false when it waits for the socket (or, summing, for its next step).
bool Progress(Grants &grants, ServeJob &job, PeerStream &s) {
  if (job.kind == ServeJob::Kind::kRead && job.summing) {  // its CRC first, a share per step
    // A reader that went (or shut its sending side: its verdict can never come) is not
    // summed for any longer: the connection ends.
    pollfd gone{s.fd(), POLLRDHUP, 0};
    if (::poll(&gone, 1, 0) > 0 && (gone.revents & (POLLRDHUP | POLLHUP | POLLERR)))
      Fail(kSuspectRemoteError, "the reader went while its checksummed read was being prepared");
    bool whole = false;
    try {
      whole = SumStep(job);
    } catch (const Error &e) {  // a hole (the caller freed registered memory): an ERROR, not a cut
      if (e.code() == kSuspectRemoteError) throw;
      metrics::RecordSince(metrics::Op::kServeRead, job.cluster, 0, job.asked, e.code());
      const uint32_t rid = job.rid;
      job.served.reset();
      job.lease.reset();  // unsettled: nothing consumed
      job = ServeJob();
      s.Queue(ErrorFrame(e, rid));
      return true;
    }
    if (!whole) {
      s.Want(POLLOUT);  // the next share at the next step, after the other connections' turns
      return false;
    }
    job.summing = false;
    if (job.granted) {  // a grant: filed and answered now, its CHECKSUM after its frame
      auto then = std::move(job.granted);
      then(grants, s, job);
      job.Reset();
      return true;
    }
    job.checksum_frame = wire::EncodeChecksum(job.sum_crc, job.sum_bytes, job.rid);
    job.served = std::make_unique<metrics::Serving>(metrics::Op::kServeRead, job.cluster, job.asked);
    QueueReadData(job, s);
    return true;
  }
  if (job.kind == ServeJob::Kind::kRead && !job.tail && job.next_span < job.lease->spans()) {
    // its data, a part of its spans at a time, one part per step at most (with Flush's share:
    // a busy reader shares the threads)
    if (job.parts_this_step > 0) {
      s.Want(POLLOUT);
      return false;
    }
    std::vector<iovec> part;
    (void)NextSpans(job, part);
    s.QueueSpans(part);
    ++job.parts_this_step;
    return true;
  }
  if (job.kind == ServeJob::Kind::kRead) {  // its data (and CHECKSUM) sent
    if (job.checksum && !job.tail) {
      job.tail = true;
      s.Queue(std::move(job.checksum_frame));  // computed (fault-safely) before the data went
      return true;
    }
    job.served->Done(job.lease->nbytes);  // sent; whether the reader accepts it is its own count
    if (job.checksum)
      grants.verdict.Await(job.rid, std::move(job.lease));  // the key waits for the reader's verdict
    else
      job.lease->Settle(true);  // sent: may consume its CacheKey
    job.Reset();
    return true;
  }
  if (job.kind == ServeJob::Kind::kDrain) {  // a refused eager WRITE: its bytes dropped, then ERROR
    if (!s.Discard(job.drain_left)) return false;
    std::vector<uint8_t> refusal = std::move(job.refusal);
    job.Reset();
    s.Queue(std::move(refusal));
    return true;
  }
  // WRITE: OK sent (an eager one: none), then the data into the lease's memory as it arrives
  // (a part of its spans at a time), then OK.
  for (;;) {
    if (!s.Receive(job.data)) return false;
    job.data.clear();
    if (!NextSpans(job, job.data.iov)) break;
    if (++job.parts_this_step > 1) {  // the next part at the next step (level-triggered: at once)
      s.WantInput();
      return false;
    }
  }
  job.served->Done(job.lease->nbytes);
  const uint32_t rid = job.rid;
  job.lease.reset();
  job.Reset();
  s.Queue(wire::EncodeEmpty(wire::kOk, rid));
  return true;
}

/// One step of a parked connection whose handshake is done: what was queued sent, the transfer
/// in progress moved on, and the requests that arrived served, each as far as the socket
/// allows now; grants checked for expiry either way. False when the connection is done (BYE,
/// EOF, a broken or hostile stream, a deadline passed): the caller releases its grants and
/// closes it. True: park it again (PeerStream::interest), with `wake` at its next deadline.
bool ServeStep(const ServeContext &ctx, Grants &grants, ServeJob &job, PeerStream &s, Deadline &wake) {
  try {
    ExpireGrants(grants);
    if (Clock::now() >= Due(s, job)) return false;  // a frame, an answer or a transfer past its deadline
    job.parts_this_step = 0;
    for (int frames = 0;;) {
      if (!s.Flush()) break;
      if (job.kind != ServeJob::Kind::kNone) {
        if (!Progress(grants, job, s)) break;
        continue;
      }
      // After a frame served, with nothing read ahead or decrypted already (TLS: the socket
      // would not wake us for those; they are served on): parked at once, no recv to find the
      // socket empty. The socket's event is level-triggered: a frame already there (pipelined)
      // wakes the connection again at once.
      if (frames > 0 && !s.conn()->Buffered()) {
        s.WantInput();
        break;
      }
      if (!s.ReadFrame(wire::kMaxPayload)) break;
      ++frames;
      if (!Dispatch(ctx, grants, job, s, s.header(), s.payload())) {
        s.FlushOnce();
        return false;
      }
      s.Recycle();
    }
  } catch (const Error &e) {
    if (e.code() == kSuspectRemoteError && s.conn() && !s.conn()->closed()) {
      s.Queue(ErrorFrame(e, 0));
      s.FlushOnce();
    }
    return false;
  } catch (const std::exception &) {
    return false;
  }
  if (s.conn()->closed()) return false;
  wake = std::min(Due(s, job), NextCheck(grants));
  return true;
}

/// A connection whose handshake is done, served parked (ServeParked).
class Served : public IoPool::Task {
 public:
  Served(const ServeContext &ctx, std::unique_ptr<Conn> conn) : ctx_(ctx), stream_(std::move(conn)) {}
  int fd() const override { return stream_.fd(); }
  uint32_t Interest() const override { return stream_.interest(); }
  bool Run(bool, Deadline &wake) override {
    if (ServeStep(ctx_, grants_, job_, stream_, wake)) return true;
    job_.Reset();
    grants_.clear();
    stream_.Close();
    return false;
  }
  void Cancel() override { stream_.Shutdown(); }  // the connection is never handed on

 private:
  ServeContext ctx_;
  Grants grants_;
  ServeJob job_;
  PeerStream stream_;
};

}  // namespace

bool ServeParked(IoGroup &io, const ServeContext &ctx, std::unique_ptr<Conn> conn) {
  return io.Add(std::make_shared<Served>(ctx, std::move(conn)));
}

void SetWriteTimeout(double seconds) { write_timeout.store(seconds > 0 ? seconds : kServeTimeout); }

/// The state of a handshake between its frames.
struct Server::Shake {
  Greeted greeted = Greeted::kRefused;
  uint64_t cluster = 0;       // the peer's, from its HELLO
  std::string client_nonce;   // its challenge
  std::string server_nonce;   // ours (with a secret)
  std::string echoed;         // a reverse HELLO's link token
  std::string token;          // see Hello()
  std::vector<uint8_t> last;  // see Hello()
  bool eager = false;         // a reverse HELLO's FEATURE_EAGER_WRITE
};

/// One accepted connection: its handshake, then its requests (or, for a reverse channel, its
/// hand-over to on_reverse_), as a state machine run a step at a time on the I/O pool, never
/// waiting on the peer (iopool.h).
class Server::Connection : public IoPool::Task {
 public:
  Connection(Server *server, std::unique_ptr<Conn> conn, std::string key, bool local, const local::Cred &cred)
      : peer(std::move(key)),
        server_(server),
        local_(local),
        cred_(cred),
        stream_(std::move(conn)),
        handshake_until_(After(kHandshakeTimeout)) {}
  int fd() const override { return stream_.fd(); }  // parked: the connection is there
  uint32_t Interest() const override { return stream_.interest(); }
  bool Run(bool ready, Deadline &wake) override;
  void Cancel() override { stream_.Shutdown(); }  // vs the hand-over of a reverse channel: under its lock
  Deadline handshake_until() const { return handshake_until_; }
  void StartTls() { stage_ = Stage::kTls; }
  size_t buffered() const { return stream_.buffered(); }

  // Read by the server under its mu_ (caps, HoldsToken).
  const std::string peer;  // what the per-peer cap counts by: the IP, or "uid N" for local ones
  std::atomic<bool> done{false};
  // A control channel whose handshake completed (under mu_): its peer's cluster id and the
  // link token we issued it, which that peer's reverse channel must echo. `authed` once its
  // handshake completed: it counts under the caps, no longer under the pre-auth budgets.
  uint64_t cluster = 0;
  std::string token;
  bool authed = false;
  // Shut down by AcceptFd to make room for a newcomer's handshake (EvictShakingLocked), under
  // mu_: no longer counted in the pre-auth budgets while it closes.
  bool evicted = false;

 private:
  enum class Stage { kTls, kHello, kAuth, kServing };
  bool Handshake(Deadline &wake);
  bool Finish() {  // done: the transfer dropped, grants released, closed
    job_.Reset();
    grants_.clear();
    stream_.Close();
    done = true;
    return false;
  }
  Server *server_;
  const bool local_;
  const local::Cred cred_;  // local connections: the kernel-verified peer
  PeerStream stream_;
  const Deadline handshake_until_;
  Stage stage_ = Stage::kHello;  // kTls first on a TLS listener (AcceptOne)
  Shake shake_;
  ServeContext ctx_;
  Grants grants_;
  ServeJob job_;
};

bool Server::Connection::Run(bool, Deadline &wake) {
  if (server_->stopping_) return Finish();
  if (stage_ != Stage::kServing) return Handshake(wake);
  return ServeStep(ctx_, grants_, job_, stream_, wake) || Finish();
}

bool Server::Connection::Handshake(Deadline &wake) {
  // Everything before the handshake completes (TLS's, HELLO, WELCOME, AUTH, each frame read
  // as it comes) is bounded by its deadline, 10 s from the accept: the peer is parked between
  // its bytes, and closed at that deadline (a timer step) if it has not finished.
  if (Clock::now() >= handshake_until_) return Finish();
  wake = handshake_until_;
  Conn &c = *stream_.conn();
  try {
    for (;;) {
      if (stage_ == Stage::kTls) {
        // The TLS handshake, a step per wake-up as the client's flights arrive.
        short want = POLLIN;
        try {
          if (!c.TlsAcceptStep(want)) {  // the client's next flight, or room for ours
            stream_.Want(want);
            return true;
          }
        } catch (const Error &e) {  // as Python's listener: told (DATADIST_CPP_LOG=1), closed
          Log(std::string(e.what()) + " (a connection to our listener)");
          return Finish();
        }
        stage_ = Stage::kHello;
      }
      if (!stream_.Flush()) return true;  // WELCOME waits for room
      if (!stream_.ReadFrame(kPreAuthPayload)) return true;
      const Greeted greeted =
          stage_ == Stage::kHello ? server_->Hello(stream_, shake_) : server_->Auth(stream_, shake_);
      switch (greeted) {
        case Greeted::kPending:  // WELCOME queued; the client's AUTH is read next
          stage_ = Stage::kAuth;
          continue;
        case Greeted::kRefused: stream_.FlushOnce(); return Finish();
        case Greeted::kControl: {
          {  // before the last frame: the client may open its reverse channel as soon as it has it
            std::lock_guard<std::mutex> lock(server_->mu_);
            cluster = shake_.cluster;
            token = shake_.token;
            authed = true;
          }
          stream_.Queue(shake_.last);
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
          return ServeStep(ctx_, grants_, job_, stream_, wake) || Finish();
        }
        case Greeted::kReverse: {
          // Unwatched already (a running task's socket is never armed in the pool's set), nothing
          // left to send (WELCOME went before AUTH was read): handed on.
          Adoption a{shake_.cluster, stream_.Take(), shake_.last, shake_.token, peer, shake_.eager};
          if (server_->on_reverse_ && !server_->stopping_)
            server_->Adopt(std::move(a));  // off this thread: the adoption may wait on a PONG
          else                             // stopping: the client's link fails with our answer, not a silent close
            RefuseAdoption(a, "this listener is stopping: it takes no reverse channel");
          done = true;
          return false;
        }
      }
    }
  } catch (const Error &e) {
    if (e.code() == kSuspectRemoteError && stream_.conn() && !stream_.conn()->closed()) {
      stream_.Queue(ErrorFrame(e, 0));
      stream_.FlushOnce();
    }
  } catch (const std::exception &) {
  }
  return Finish();
}

void Server::RefuseAdoption(Adoption &a, const std::string &why) {
  if (!a.conn) return;
  const uint32_t rid = wire::DecodeHeader(a.last.data()).request_id;
  TrySend(*a.conn, wire::EncodeError({static_cast<int64_t>(llm_datadist::LLM_LINK_FAILED), why}, rid));
  a.conn->Close();
}

void Server::Adopt(Adoption a) {
  std::unique_lock<std::mutex> lock(adopt_mu_);
  if (adopt_stop_) {
    lock.unlock();
    RefuseAdoption(a, "this listener is stopping: it takes no reverse channel");
    return;
  }
  std::deque<Adoption> &waiting = adopt_waiting_[a.peer];
  if (waiting.size() >= kPreAuthPerPeer) {
    const std::string why = "too many reverse channels (" + std::to_string(waiting.size()) + ") from " + a.peer +
                            " waiting to be adopted by this listener";
    lock.unlock();
    RefuseAdoption(a, why);
    return;
  }
  const std::string peer = a.peer;
  waiting.push_back(std::move(a));
  if (waiting.size() == 1 && !adopting_.count(peer)) adopt_turns_.push_back(peer);
  // Another thread only when the ones there are all busy with an adoption (the next one free
  // takes it otherwise): one thread while adoptions are quick, up to kAdopters while they wait.
  if (adopt_turns_.size() > adopters_.size() - adopters_busy_ && adopters_.size() < kAdopters) {
    try {
      adopters_.emplace_back([this] {
        EnterCoreThread("datadist-adopt");
        AdoptLoop();
      });
    } catch (const std::system_error &e) {  // at the thread limit: the threads there are serve it in turn
      if (adopters_.empty()) {              // none: this one is refused, the next one tries again
        Adoption refused = std::move(adopt_waiting_[peer].back());
        adopt_waiting_[peer].pop_back();
        if (adopt_waiting_[peer].empty()) {
          adopt_waiting_.erase(peer);
          adopt_turns_.erase(std::remove(adopt_turns_.begin(), adopt_turns_.end(), peer), adopt_turns_.end());
        }
        lock.unlock();
        Log(std::string("cannot start a thread to adopt a reverse channel: ") + e.what());
        RefuseAdoption(refused, "this listener cannot start a thread to adopt a reverse channel now");
        return;
      }
    }
  }
  adopt_cv_.notify_one();
}

void Server::AdoptLoop() {
  std::unique_lock<std::mutex> lock(adopt_mu_);
  for (;;) {
    adopt_cv_.wait(lock, [this] { return adopt_stop_ || !adopt_turns_.empty(); });
    if (adopt_stop_) return;
    ++adopters_busy_;
    const std::string peer = std::move(adopt_turns_.front());
    adopt_turns_.pop_front();
    std::deque<Adoption> &waiting = adopt_waiting_[peer];
    Adoption a = std::move(waiting.front());
    waiting.pop_front();
    adopting_.insert(peer);
    lock.unlock();
    try {
      on_reverse_(*this, a.cluster, std::move(a.conn), a.last, a.token, a.peer, a.eager);
    } catch (const std::exception &e) {  // nothing escapes the thread: that channel is lost
      Log(std::string("adopting a reverse channel from ") + peer + ": " + e.what());
    }
    lock.lock();
    --adopters_busy_;
    adopting_.erase(peer);
    auto it = adopt_waiting_.find(peer);
    if (it != adopt_waiting_.end() && !it->second.empty())
      adopt_turns_.push_back(peer);  // its next one, after the other addresses' turns
    else if (it != adopt_waiting_.end())
      adopt_waiting_.erase(it);
  }
}

void Server::StopAdopters() {
  std::vector<std::thread> threads;
  std::map<std::string, std::deque<Adoption>> waiting;
  {
    std::lock_guard<std::mutex> lock(adopt_mu_);
    adopt_stop_ = true;
    threads.swap(adopters_);
  }
  adopt_cv_.notify_all();
  for (std::thread &t : threads) t.join();  // each ends its adoption (bounded waits) first
  {
    std::lock_guard<std::mutex> lock(adopt_mu_);
    waiting.swap(adopt_waiting_);
    adopt_turns_.clear();
  }
  for (auto &kv : waiting)
    for (Adoption &a : kv.second) RefuseAdoption(a, "this listener is stopping: it takes no reverse channel");
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
    Fail(llm_datadist::LLM_LINK_BUSY,
         "pid " + std::to_string(pid) + " holds " + std::to_string(n) + " grants not released yet");
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
  if (identity_->serve_local)
    local_fd_ = local::Listen(local::Name(static_cast<uint64_t>(getpid()), identity_->cluster_id));
  serves_local_ = local_fd_ >= 0;
  stopping_ = false;
  {
    std::lock_guard<std::mutex> lock(adopt_mu_);
    adopt_stop_ = false;
  }
  try {
    accept_thread_ = std::thread([this] {
      EnterCoreThread("datadist-accept");
      AcceptLoop();
    });
  } catch (const std::system_error &e) {  // the process at its thread limit: not listening
    close(listen_fd_);
    listen_fd_ = -1;
    if (local_fd_ >= 0) close(local_fd_);
    local_fd_ = -1;
    Fail(llm_datadist::LLM_FAILED, std::string("cannot start the listener's accept thread: ") + e.what());
  }
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
  StopAdopters();  // after the pool: no handshake hands a reverse channel on any more
  std::list<std::shared_ptr<Connection>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    all.swap(conns_);
  }
  all.clear();      // closed, their grants released
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

size_t Server::buffered() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto &c : conns_) n += c->buffered();
  return n;
}

void Server::AcceptLoop() {
  std::vector<pollfd> fds;
  while (!stopping_) {
    try {
      AcceptStep(fds);
    } catch (const std::exception &e) {  // nothing escapes the thread: logged, and on after a pause
      Log(std::string("the listener's accept thread: ") + e.what());
      ::poll(nullptr, 0, kPollSliceMs);
    }
  }
  for (Refusal &r : refusing_) close(r.fd);
  refusing_.clear();
}

void Server::AcceptStep(std::vector<pollfd> &fds) {
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

void Server::AcceptOne(int listen_fd, bool is_local) {
  sockaddr_storage peer{};
  socklen_t len = sizeof(peer);
  int fd = accept4(listen_fd, reinterpret_cast<sockaddr *>(&peer), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0) return;  // gone before we got to it, or out of descriptors: the next poll retries
  std::string address = "a peer";
  try {
    AcceptFd(fd, peer, is_local, address);
  } catch (const std::exception &e) {
    // No I/O thread could be started (std::system_error: the process at its thread limit),
    // or memory ran out: this connection is closed unserved (AcceptFd closed it), told and
    // counted; the next accept tries again.
    ++unserved_;
    Log("cannot serve " + address + ": " + e.what() + " (the connection is closed; the next one is tried again)");
  }
}

void Server::AcceptFd(int fd, const sockaddr_storage &peer, bool is_local, std::string &address) {
  std::unique_ptr<Conn> conn;  // owns fd once made
  try {
    std::string key;
    local::Cred cred;
    bool reader = true;  // may read this process (TCP peers: not asked)
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
      reader = cred.MayReadUs();
    } else {
      key = IpOf(peer);
      address = FormatHostPort(key, PortOf(peer));
    }
    std::lock_guard<std::mutex> lock(mu_);
    ReapLocked();
    size_t live = 0, same_peer = 0, shaking = 0, same_shaking = 0;
    std::map<std::string, size_t> shaking_from;  // connections in their handshake, by address / uid
    for (const auto &other : conns_)
      if (!other->done) {
        const bool same = other->peer == key;
        ++live;
        same_peer += same;
        if (!other->authed && !other->evicted) {
          ++shaking;
          same_shaking += same;
          ++shaking_from[other->peer];
        }
      }
    // A quarter of the connections, but never fewer than one address may hold (a small cap:
    // all of them): an owner capped at 4 still lets 4 handshakes run at once.
    const size_t shaking_cap = std::max(max_conns_ / 4, std::min(max_conns_, kPreAuthPerPeer));
    const size_t same_shaking_cap = std::min(max_per_peer_, reader ? kPreAuthPerPeer : kPreAuthNonReader);
    std::string why;
    if (live >= max_conns_)
      why = std::to_string(live) + " connections";
    else if (same_peer >= max_per_peer_)
      why = std::to_string(same_peer) + " connections from " + key;
    else if (same_shaking >= same_shaking_cap)
      why = std::to_string(same_shaking) + " connections in their handshake from " + key;
    else if (shaking >= shaking_cap && !EvictShakingLocked(shaking_from, same_shaking))
      why = std::to_string(shaking) + " connections in their handshake";
    if (!why.empty()) {
      const int taken = fd;
      fd = -1;
      Refuse(taken, "too many connections to this owner (" + why + ")");
      return;
    }
    conn = std::make_unique<Conn>(fd, address);
    fd = -1;
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
    // Add makes the I/O pool at need, which throws when no thread can be started: `c` then
    // closes the connection on the way out.
    if (io_.Add(c, c->handshake_until())) conns_.push_back(std::move(c));  // else stopping: closed with `c`
  } catch (...) {
    if (fd >= 0) close(fd);
    throw;
  }
}

bool Server::EvictShakingLocked(const std::map<std::string, size_t> &shaking_from, size_t same_shaking) {
  // The address (or uid) holding the most handshakes, if it holds more than the newcomer's
  // would once it is in: ties and smaller holders are never evicted for a newcomer, so an
  // address can only lose handshakes to one holding fewer (an honest peer's one or two).
  const std::string *heaviest = nullptr;
  size_t most = same_shaking + 1;
  for (const auto &[peer, n] : shaking_from)
    if (n > most) {
      most = n;
      heaviest = &peer;
    }
  if (heaviest == nullptr) return false;
  for (const auto &c : conns_)  // accepted in order: the first found is its oldest
    if (!c->done && !c->authed && !c->evicted && c->peer == *heaviest) {
      // Shut down under its stream's lock (PeerStream::Shutdown): the parked connection wakes
      // to an end of stream and closes on its I/O thread, as any handshake that broke.
      c->evicted = true;
      c->Cancel();
      ++evicted_;
      return true;
    }
  return false;
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
bool RefuseReverse(Server &server, PeerStream &c, const std::string &what, uint64_t cluster, const std::string &echoed,
                   uint32_t rid) {
  if (server.HoldsToken(cluster, echoed)) return false;
  c.Queue(wire::EncodeError({static_cast<int64_t>(llm_datadist::LLM_LINK_FAILED), what}, rid));
  return true;
}

std::string ReverseRefusal(uint64_t cluster) {
  return "a reverse channel for cluster " + std::to_string(cluster) +
         " must come from the peer holding that cluster's control channel to us (its link token)";
}

}  // namespace

Server::Greeted Server::Hello(PeerStream &c, Shake &s) {
  const wire::Header &h = c.header();
  const std::vector<uint8_t> &payload = c.payload();
  if (h.type != wire::kHello) ProtocolViolation("expected HELLO");
  wire::Hello hello = wire::DecodeHello(payload);
  s.cluster = hello.cluster_id;
  s.greeted = (hello.features & wire::kFeatureReverse) ? Greeted::kReverse : Greeted::kControl;
  s.eager = hello.features & wire::kFeatureEagerWrite;
  // A reverse HELLO's proof ends with the link token it echoes: the challenge is the rest.
  std::pair<std::string, std::string> parts = wire::SplitToken(hello.proof, hello.features);
  s.client_nonce = std::move(parts.first);
  s.echoed = std::move(parts.second);
  // Ourselves. Another process with our cluster id is a peer
  // like any other: vllm-ascend's V0 connector gives both sides cluster id = local rank.
  const local::HostIdentity &self = local::HostIdentity::Current();
  if (hello.cluster_id == identity_->cluster_id && hello.pid == static_cast<uint32_t>(getpid()) &&
      hello.boot_id == self.boot_id && hello.pid_ns == self.pid_ns) {
    c.Queue(
        wire::EncodeError({static_cast<int64_t>(llm_datadist::LLM_LINK_FAILED),
                           "a link from this engine to itself (cluster id " + std::to_string(hello.cluster_id) + ")"},
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
  welcome.features |= wire::kFeatureEagerWrite;  // a push in one round trip (Dispatch, kWrite)
  const std::string &secret = identity_->secret;
  if (!secret.empty()) {
    welcome.features |= auth::kFeatureAuth;
    welcome.proof = auth::ServerProof(secret, s.client_nonce, auth::Nonce(), identity_->cluster_id, hello.cluster_id);
    s.server_nonce = welcome.proof.substr(0, auth::kNonceBytes);
  }
  if (s.greeted == Greeted::kControl) {  // its link token, for its reverse channel to echo
    s.token = auth::Nonce();             // kLinkTokenBytes random bytes
    welcome.features |= wire::kFeatureToken;
    welcome.proof += s.token;
  } else {
    s.token = s.echoed;  // checked by RefuseReverse
  }
  if (secret.empty()) {
    if (s.greeted == Greeted::kReverse &&
        RefuseReverse(*this, c, ReverseRefusal(s.cluster), s.cluster, s.echoed, h.request_id))
      return Greeted::kRefused;
    s.last = wire::EncodeHello(wire::kWelcome, welcome, h.request_id);
    return s.greeted;
  }
  c.Queue(wire::EncodeHello(wire::kWelcome, welcome, h.request_id));
  return Greeted::kPending;  // the client's proof comes next (Auth)
}

Server::Greeted Server::Auth(PeerStream &c, Shake &s) {
  // Nothing but the client's proof is accepted until it checks out.
  const wire::Header &h = c.header();
  const std::vector<uint8_t> &payload = c.payload();
  bool ok = false;
  if (h.type == wire::kAuth) {
    std::string want =
        auth::ClientProof(identity_->secret, s.client_nonce, s.server_nonce, identity_->cluster_id, s.cluster);
    ok = auth::Same(want, wire::DecodeAuth(payload));
  }
  if (!ok) {
    c.Queue(wire::EncodeError({static_cast<int64_t>(llm_datadist::LLM_LINK_FAILED),
                               "cluster " + std::to_string(s.cluster) + " failed to prove the shared secret"},
                              h.request_id));
    return Greeted::kRefused;
  }
  if (s.greeted == Greeted::kReverse &&
      RefuseReverse(*this, c, ReverseRefusal(s.cluster), s.cluster, s.echoed, h.request_id))
    return Greeted::kRefused;
  s.last = wire::EncodeEmpty(wire::kOk, h.request_id);
  return s.greeted;
}

namespace {

/// A same-host read: the spans checked, the addresses granted, the lease held until RELEASE.
/// Only on the local channel, to a peer the kernel says may read us, within the limits.
void Grant(const ServeContext &ctx, Grants &grants, PeerStream &c, const wire::Request &req, uint32_t rid,
           Clock::time_point asked, ServeJob &job) {
  if (ctx.peer == nullptr || ctx.grants == nullptr)
    Invalid(
        "grants are served on the local channel only, to peers the kernel verified on this host; read without GRANT");
  const local::Cred &peer = *ctx.peer;
  if (!peer.MayReadUs())
    Invalid("pid " + std::to_string(peer.pid) + " (uid " + std::to_string(peer.uid) +
            ") may not read this process's memory: read without GRANT");
  if (grants.size() >= kMaxGrantsPerConnection)
    Fail(llm_datadist::LLM_LINK_BUSY,
         std::to_string(grants.size()) + " grants are still not released on this connection");
  std::unique_ptr<Lease> lease = ctx.registry->Open(req, false);  // every span checked here
  if (lease->bases.size() != req.tensors.size()) Invalid("this request cannot be granted");
  // SHM asked and the cache in shareable memory: where each tensor's unit lies in its memfd.
  const bool shm = (req.flags & wire::kFlagShm) && lease->entry().shm.shareable();
  const ServeContext *cx = &ctx;  // the connection's, alive as long as its job
  auto grant = [cx, tensors = req.tensors, shm, rid, asked](Grants &grants, PeerStream &c, std::unique_ptr<Lease> lease,
                                                            std::vector<uint8_t> checksum) {
    const pid_t pid = cx->peer->pid;
    cx->grants->Take(pid, !shm);
    const uint64_t id = next_lease_id++;
    const Entry &e = lease->entry();
    std::vector<uint8_t> frame;
    if (shm) {
      wire::ShmGrant g;
      g.lease_id = id;
      for (size_t i = 0; i < tensors.size(); ++i) {
        const uint32_t t = tensors[i];
        g.fds.push_back(e.shm.fds[t]);
        g.inos.push_back(e.shm.inos[t]);
        g.offsets.push_back(e.shm.offsets[t] + (lease->bases[i] - e.addrs[t]));
      }
      frame = wire::EncodeShmGrant(g, rid);
    } else {
      frame = wire::EncodeGrant({id, lease->bases}, rid);
    }
    grants.emplace(id, std::make_unique<Granted>(std::move(lease), cx->grants, pid, cx->cluster, asked));
    c.Queue(std::move(frame));
    if (!checksum.empty()) c.Queue(std::move(checksum));
  };
  if (!(req.flags & wire::kFlagChecksum)) {
    grant(grants, c, std::move(lease), {});
    return;
  }
  // Its CRC first, read fault-safely while the lease holds the memory (a hole is an error
  // frame), a share per step (Progress), then the grant.
  StartSum(job, std::move(lease), rid, ctx.cluster, asked, [grant](Grants &g, PeerStream &s, ServeJob &j) {
    try {
      grant(g, s, std::move(j.lease), wire::EncodeChecksum(j.sum_crc, j.sum_bytes, j.rid));
    } catch (const Error &e) {  // over the grants per peer (LLM_LINK_BUSY)
      metrics::RecordSince(metrics::Op::kServeRead, j.cluster, 0, j.asked, e.code());
      s.Queue(ErrorFrame(e, j.rid));
    }
  });
}

}  // namespace

namespace {

constexpr uint64_t kMaxGrantedRequestBytes = wire::kMaxPayload;  // NIXL grants' span arrays, per connection

bool IsNixl(uint8_t type) {
  return (type >= wire::kNixlMdRequest && type <= wire::kNixlWrite && type != wire::kNixlMd &&
          type != wire::kNixlGrant) ||
         type == wire::kNixlLease || type == wire::kNixlRevoke;
}

/// NIXL_READ / NIXL_WRITE (docs/protocol.md, "Pull and push over NIXL"): checked exactly as
/// READ / WRITE, then granted (NIXL_GRANT, and CHECKSUM for a read with that flag) and held
/// until RELEASE, as a same-host grant is. Refusals are ERROR frames; the connection stays.
void NixlGrantOne(const ServeContext &ctx, Grants &grants, PeerStream &c, uint8_t type,
                  const std::vector<uint8_t> &payload, uint32_t rid, ServeJob &job) {
  wire::Request req = wire::DecodeRequest(type, payload);
  const bool write = type == wire::kNixlWrite;
  const Clock::time_point asked = Clock::now();
  const metrics::Op op = write ? metrics::Op::kServeWrite : metrics::Op::kServeRead;
  std::vector<uint8_t> frame;
  try {
    uint64_t granted = 0;
    for (const auto &kv : grants) granted += kv.second->request_bytes();
    const uint64_t size = req.tensors.size() * 4 + req.offsets.size() * 16;
    if (grants.size() >= kMaxGrantsPerConnection || granted + size > kMaxGrantedRequestBytes)
      Fail(llm_datadist::LLM_LINK_BUSY, std::to_string(grants.size()) + " grants (" + std::to_string(granted) +
                                            " bytes of requests) are still not released on this connection");
    if (ctx.nixl == nullptr) Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED, "this owner does not serve NIXL");
    std::shared_ptr<nixl::Agent> agent = ctx.nixl->Serving();
    std::unique_ptr<Lease> lease = write ? ctx.registry->OpenWrite(req, false) : ctx.registry->Open(req, false);
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
    NixlGrantInfo info{agent, !grants.nixl_wired, write, size};
    if (!write && (req.flags & wire::kFlagChecksum)) {
      // Its CRC first (computed when granting: the source must not change while granted), a
      // share per step (Progress), then the grant filed and answered.
      StartSum(job, std::move(lease), rid, ctx.cluster, asked,
               [frame, info, id](Grants &gs, PeerStream &s, ServeJob &j) {
                 gs.emplace(id, std::make_unique<Granted>(std::move(j.lease), info, j.cluster, j.asked));
                 s.Queue(frame);
                 s.Queue(wire::EncodeChecksum(j.sum_crc, j.sum_bytes, j.rid));
               });
      return;
    }
    grants.emplace(id, std::make_unique<Granted>(std::move(lease), std::move(info), ctx.cluster, asked));
  } catch (const Error &e) {
    metrics::RecordSince(op, ctx.cluster, 0, asked, e.code());  // refused: nothing granted
    if (e.code() == kSuspectRemoteError) throw;
    c.Queue(ErrorFrame(e, rid));
    return;
  }
  c.Queue(std::move(frame));
}

/// The NIXL messages a peer may send (docs/protocol.md): on a link's reverse channel only
/// NIXL_REVOKE (answered once no read of ours is under the lease: the core holds none, so at
/// once), never anything that would hand the owner our agent, grants or leases; on any other
/// connection everything but NIXL_REVOKE. A misplaced one is refused (FEATURE_NOT_ENABLED),
/// the connection kept.
void DispatchNixl(const ServeContext &ctx, Grants &grants, ServeJob &job, PeerStream &c, const wire::Header &h,
                  const std::vector<uint8_t> &payload) {
  const uint32_t rid = h.request_id;
  if (ctx.reverse != (h.type == wire::kNixlRevoke)) {
    c.Queue(ErrorFrame(
        Error(llm_datadist::LLM_FEATURE_NOT_ENABLED, std::string(wire::TypeName(h.type)) + " is not served on " +
                                                         (ctx.reverse ? "a reverse channel" : "a client's connection")),
        rid));
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
    case wire::kNixlWrite: NixlGrantOne(ctx, grants, c, h.type, payload, rid, job); return;
    case wire::kNixlLease: {
      wire::NixlLease q = wire::DecodeNixlLease(payload);
      try {
        if (ctx.nixl == nullptr) Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED, "this owner does not serve NIXL");
        answer = wire::EncodeNixlLeased(ctx.nixl->OpenLease(&grants, c.conn(), ctx.cluster, ctx.token, q), rid);
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
    default: ProtocolViolation("unexpected message type " + std::to_string(h.type) + " from a client");
  }
  c.Queue(std::move(answer));
}

}  // namespace

// Registered user memory that its caller freed behind our back (their bug) must cost the peer
// an error frame, not a connection cut mid-answer by a send() that hits EFAULT: before this
// thread streams a request from or into such memory, the first and last byte of each tensor
// it names are probed (one call per 512 tensors): written into a pipe of the serving thread's
// own, which the kernel copies fault-safely (a hole fails the write; process_vm_readv on
// ourselves then says which probe), and which is emptied only when full. The pipe's write costs a third of what
// process_vm_readv on ourselves costs (0.4-0.8 against 1.5-2.8 us on the development VM: the latter takes the mm's
// ptrace check and pins the pages), once per streamed request; process_vm_readv is left for a thread that cannot make a
// pipe. Memory the core or the Python package allocated (pools, AllocateCache) is ours and is not probed. Throws
// LLM_DEVICE_MEM_ERROR naming the tensor (the lease then ends unsettled: nothing is consumed); a kernel that will not
// tell (EPERM, ENOSYS: seccomp, no CMA) lets it go on.
namespace {

// The calling thread's probe pipe (non-blocking, close-on-exec), made at its first probe and
// closed with the thread; WriteEnd() is -1 where no pipe can be made.
struct ProbePipe {
  int fds[2] = {-1, -1};
  bool tried = false;
  ~ProbePipe() {
    for (int fd : fds)
      if (fd >= 0) close(fd);
  }
  int WriteEnd() {
    if (!tried) {
      tried = true;
      if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) fds[0] = fds[1] = -1;
    }
    return fds[1];
  }
  // What the probes left in it, read out (a forked child shares it: whoever reads, empties).
  void Drain() {
    uint8_t sink[4096];
    while (read(fds[0], sink, sizeof sink) > 0) {
    }
  }
};

// Probes `n` (<= 1024) one-byte spans of our own memory: how many in a row were readable (n:
// all), or -1 with errno (EFAULT: the first was not; anything else: the kernel would not say).
// The pipe tells only whether every span was readable; where one was not (EFAULT, or a short
// write), or no pipe could be made, process_vm_readv says which.
ssize_t ProbeOwn(const iovec *probes, size_t n, pid_t (*self)()) {
  thread_local ProbePipe own;
  const int fd = own.WriteEnd();
  for (int attempt = 0; fd >= 0 && attempt < 2; ++attempt) {
    // at most PIPE_BUF bytes: written whole or not at all (EAGAIN: the pipe is full)
    const ssize_t put = writev(fd, probes, static_cast<int>(n));
    if (put == static_cast<ssize_t>(n)) return put;  // the common case: every byte readable
    if (put >= 0 || errno != EAGAIN) break;          // a hole: found below
    own.Drain();
  }
  uint8_t scratch[1024];
  iovec local{scratch, n};
  return process_vm_readv(self(), &local, 1, probes, n, 0);
}

// This process's id without a system call per request (glibc no longer caches getpid): taken
// once, and taken anew in a forked child (pthread_atfork), whose id differs from its parent's.
std::atomic<pid_t> self_pid{0};

pid_t SelfPid() {
  pid_t pid = self_pid.load(std::memory_order_relaxed);
  if (pid != 0) return pid;
  static const bool hooked = [] {
    (void)pthread_atfork(nullptr, nullptr, [] { self_pid.store(0, std::memory_order_relaxed); });
    return true;
  }();
  (void)hooked;
  pid = getpid();
  self_pid.store(pid, std::memory_order_relaxed);
  return pid;
}

}  // namespace

void CheckOwnMemory(const Entry &e, const std::vector<uint32_t> &tensors, const char *what) {
  if (e.opts.allocated || !e.owned.empty() || e.region || e.geo.tensor_bytes == 0) return;
  constexpr size_t kBatch = 1024;  // probes per call (<= IOV_MAX, and <= PIPE_BUF bytes)
  std::vector<iovec> probes;
  probes.reserve(2 * tensors.size());
  for (uint32_t t : tensors) {
    probes.push_back({reinterpret_cast<void *>(e.addrs[t]), 1});
    probes.push_back({reinterpret_cast<void *>(e.addrs[t] + e.geo.tensor_bytes - 1), 1});
  }
  for (size_t start = 0; start < probes.size(); start += kBatch) {
    const size_t n = std::min(kBatch, probes.size() - start);
    const ssize_t got = ProbeOwn(&probes[start], n, SelfPid);
    if (got == static_cast<ssize_t>(n)) continue;
    if (got < 0 && errno != EFAULT) return;  // cannot tell
    const size_t bad = start + static_cast<size_t>(got < 0 ? 0 : got);
    const uint32_t tensor = tensors[bad / 2];
    char at[32];
    std::snprintf(at, sizeof at, "%#llx",
                  static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(probes[bad].iov_base)));
    // Always told (a bug of the caller's, who may never see the peer's error), as link failures are.
    std::fprintf(stderr,
                 "[datadist] error: cache %lld: tensor %u's memory at %s is not mapped any more (freed after "
                 "it was registered?); a peer's %s of it is refused\n",
                 static_cast<long long>(e.id), tensor, at, what);
    Fail(kDeviceMemError, "the owner's memory of cache " + std::to_string(e.id) + " tensor " + std::to_string(tensor) +
                              " is not mapped any more (freed after it was registered)");
  }
}

bool Dispatch(const ServeContext &ctx, Grants &grants, ServeJob &job, PeerStream &c, const wire::Header &h,
              const std::vector<uint8_t> &payload) {
  Registry *registry_ = ctx.registry;
  const uint32_t rid = h.request_id;
  if (grants.verdict.Settle(h, payload)) return true;  // a checksummed read's verdict
  if (IsNixl(h.type)) {
    DispatchNixl(ctx, grants, job, c, h, payload);
    return true;
  }
  switch (h.type) {
    case wire::kRead: {
      wire::Request req = wire::DecodeRequest(h.type, payload);
      const Clock::time_point asked = Clock::now();  // counted as serve_read from here
      const size_t held = grants.size();
      std::unique_ptr<Lease> lease;
      try {
        if (req.flags & wire::kFlagGrant) {
          Grant(ctx, grants, c, req, rid, asked, job);  // SHM_GRANT for SHM on shareable memory
          return true;
        }
        lease = registry_->Open(req, false);  // its spans expanded a part at a time, as they go
        CheckOwnMemory(lease->entry(), req.tensors, "read");
      } catch (const Error &e) {
        // Refused (a grant given, then not sent, is counted when it ends: Granted).
        if (grants.size() == held) metrics::RecordSince(metrics::Op::kServeRead, ctx.cluster, 0, asked, e.code());
        if (e.code() == kSuspectRemoteError || c.conn()->closed()) throw;
        c.Queue(ErrorFrame(e, rid));
        return true;
      }
      // The answer is sent from the registered memory as the socket takes it (ServeStep),
      // the lease held across the connection's parks; then its CHECKSUM, if asked.
      job.kind = ServeJob::Kind::kRead;
      job.until = After(kServeTimeout);
      job.rid = rid;
      job.checksum = (req.flags & wire::kFlagChecksum) != 0;
      job.lease = std::move(lease);
      job.cluster = ctx.cluster;
      job.asked = asked;
      if (job.checksum) {
        // Before the bytes go, their CRC, read fault-safely, a step's share at a time
        // (Progress): a hole anywhere in the spans is an error frame then, not a cut
        // connection (or a SIGSEGV) after READ_DATA.
        job.summing = true;
        return true;
      }
      job.served = std::make_unique<metrics::Serving>(metrics::Op::kServeRead, ctx.cluster, asked);
      QueueReadData(job, c);  // with its first part of spans; the rest follow (Progress)
      return true;
    }
    case wire::kWrite: {
      // Undecodable spans (no known byte count: an eager WRITE's bytes cannot be skipped):
      // ERROR, then closed, by the caller.
      wire::Request req = wire::DecodeRequest(h.type, payload);
      const bool eager = req.flags & wire::kFlagEager;  // its bytes follow it now: no go-ahead
      const Clock::time_point asked = Clock::now();     // counted as serve_write from here
      std::unique_ptr<Lease> lease;
      try {
        lease = registry_->OpenWrite(req, false);  // its spans expanded a part at a time, as they come
        if (req.kind != wire::kAddress) CheckOwnMemory(lease->entry(), req.tensors, "write");
      } catch (const Error &e) {
        metrics::RecordSince(metrics::Op::kServeWrite, ctx.cluster, 0, asked, e.code());  // refused
        if (eager) {
          // Exactly its bytes (at most kEagerMax: the codec refuses more) dropped as they come,
          // parked in between as a WRITE's are, within the stalled writer's deadline; then the
          // ERROR, and the connection goes on.
          job.kind = ServeJob::Kind::kDrain;
          job.until = After(write_timeout.load());
          job.drain_left = wire::SpanBytes(req);
          job.refusal = ErrorFrame(e, rid);
          return true;
        }
        c.Queue(ErrorFrame(e, rid));
        return true;
      }
      // OK (not for an eager WRITE), then the data into the lease's memory as it arrives
      // (ServeStep), then OK.
      job.kind = ServeJob::Kind::kWrite;
      job.until = After(write_timeout.load());
      job.rid = rid;
      job.served = std::make_unique<metrics::Serving>(metrics::Op::kServeWrite, ctx.cluster, asked);
      job.lease = std::move(lease);
      (void)NextSpans(job, job.data.iov);
      if (!eager) c.Queue(wire::EncodeEmpty(wire::kOk, rid));
      return true;
    }
    case wire::kPing: c.Queue(wire::EncodeU64(wire::kPong, wire::DecodeU64(payload), rid)); return true;
    case wire::kBye:
      wire::DecodeEmpty(payload);
      c.Queue(wire::EncodeEmpty(wire::kOk, rid));  // sent if the socket takes it now (FlushOnce)
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
        wire::CacheLease l = registry_->LeaseCache(q);      // its memfds too, for SHM on shareable memory
        if (l.shm_fds.empty()) ctx.grants->AllowReaders();  // read by cross-memory attach
        answer = wire::EncodeCacheLease(l, rid);
        metrics::RecordSince(metrics::Op::kServeLease, ctx.cluster, 0, asked, llm_datadist::LLM_SUCCESS);
      } catch (const Error &e) {
        metrics::RecordSince(metrics::Op::kServeLease, ctx.cluster, 0, asked, e.code());
        if (e.code() == kSuspectRemoteError) throw;
        answer = ErrorFrame(e, rid);
      }
      c.Queue(std::move(answer));
      return true;
    }
    case wire::kStatsRequest: {
      // The peer's own series only (metrics.h's StatsJson; docs/protocol.md, STATS).
      wire::DecodeEmpty(payload);
      const std::vector<uint8_t> answer =
          ctx.stats ? wire::EncodeStats(ctx.stats(ctx.cluster, ctx.token), rid)
                    : ErrorFrame(Error(llm_datadist::LLM_FEATURE_NOT_ENABLED, "this peer serves no metrics"), rid);
      c.Queue(std::move(answer));
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
    default: ProtocolViolation("unexpected message type " + std::to_string(h.type) + " from a client");
  }
}

}  // namespace datadist
