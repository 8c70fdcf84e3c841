#include "net.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <memory>
#include <utility>

#include "addr.h"
#include "blocking.h"
#include "errors.h"
#include "tls.h"

namespace datadist {
namespace {

constexpr size_t kMaxIov = 1024;

// Liveness from the kernel: keepalive notices a peer
// host that vanished while the connection is idle (5 s idle, 3 probes 2 s apart), and
// TCP_USER_TIMEOUT one that stops acknowledging mid-transfer, a reader whose window stays
// shut included (15 s), so a stalled peer never pins a cache for the whole serve deadline.
constexpr int kKeepIdle = 5, kKeepInterval = 2, kKeepCount = 3;
constexpr int kUserTimeoutMs = 15000;

void Tune(int fd) {
  int one = 1;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  (void)setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  for (auto [opt, val] : {std::pair<int, int>{TCP_KEEPIDLE, kKeepIdle},
                          {TCP_KEEPINTVL, kKeepInterval},
                          {TCP_KEEPCNT, kKeepCount},
                          {TCP_USER_TIMEOUT, kUserTimeoutMs}})
    (void)setsockopt(fd, IPPROTO_TCP, opt, &val, sizeof(val));  // fails harmlessly on unix sockets
  int flags = fcntl(fd, F_GETFL, 0);
  (void)fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

// Bulk transfers wait in the kernel (a blocking socket, SO_RCVTIMEO / SO_SNDTIMEO kept inside the deadline): a transfer
// that the socket cannot take or give at once, with at least kBulkMin bytes left, turns O_NONBLOCK off for the rest of
// it. The receiver then asks recvmsg(MSG_WAITALL) for a whole batch of up to kMaxIov spans, and the kernel copies
// segments as they arrive without returning; the sender writes kSendChunk bytes a call, and the kernel waits for room
// inside the call. The non-blocking loop this replaces returned for a poll at every buffer-full or empty socket: per
// 256 MiB pull on loopback (one range, 8192 x 32 KiB, 65536 x 4 KiB) the owner made 180 to 290 system calls and the
// puller 190 to 820, against 70 to 80 and 6 to 80 for a loop that blocks in the kernel (the Python engine's, since
// removed); now about as many. Smaller transfers keep the non-blocking call: one does them. A Shutdown from another
// thread wakes a blocked call as it woke poll.
constexpr size_t kBulkMin = 256 << 10;
constexpr size_t kSendChunk = 4 << 20;  // the socket lock is held for a call's copy

size_t BytesFrom(const std::vector<iovec> &iov, size_t first) {
  size_t n = 0;
  for (size_t i = first; i < iov.size(); ++i) n += iov[i].iov_len;
  return n;
}

constexpr int64_t kArmSlackUs = 20000;  // a blocking call may run this far past its deadline

int MillisLeft(Deadline deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  if (left <= 0) return 0;
  return static_cast<int>(std::min<long long>(left + 1, INT_MAX));
}

// Advances an iovec array past `n` bytes; returns the index of the first unfinished entry.
size_t Advance(std::vector<iovec> &iov, size_t first, size_t n) {
  while (first < iov.size() && n >= iov[first].iov_len) {
    n -= iov[first].iov_len;
    ++first;
  }
  if (first < iov.size() && n) {
    iov[first].iov_base = static_cast<uint8_t *>(iov[first].iov_base) + n;
    iov[first].iov_len -= n;
  }
  while (first < iov.size() && iov[first].iov_len == 0) ++first;
  return first;
}

}  // namespace

Conn::Conn(int fd, std::string address) : fd_(fd), address_(std::move(address)) { Tune(fd); }

std::unique_ptr<Conn> Conn::Connect(const std::string &host, uint16_t port, Deadline deadline, bool was_listening) {
  const SockAddr addr = ToSockAddr(host, port);
  int fd = socket(addr.family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) Fail(llm_datadist::LLM_LINK_FAILED, std::string("socket: ") + std::strerror(errno));
  const std::string where = FormatHostPort(host, port);
  auto conn = std::make_unique<Conn>(fd, where);
  // A refused connection says what the caller can check: a peer that listened there before
  // has stopped (or restarted elsewhere); a first connection may also name the wrong port, or
  // a PROMPT without a listen address.
  auto refused = [&](int err) {
    std::string why = "cannot connect to " + where + ": " + std::strerror(err);
    if (err == ECONNREFUSED && was_listening)
      why +=
          ": nothing listens there any more (the peer that listened there stopped; the next call reconnects once "
          "it listens again)";
    else if (err == ECONNREFUSED)
      why +=
          ": nothing listens there (is the PROMPT running, and is this the port its LLMConfig.listen_ip_info "
          "names?)";
    Fail(llm_datadist::LLM_LINK_FAILED, why);
  };
  if (connect(fd, addr.get(), addr.len) != 0) {
    if (errno != EINPROGRESS) refused(errno);
    conn->Wait(POLLOUT, deadline);
    int err = 0;
    socklen_t len = sizeof(err);
    (void)getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err) refused(err);
  }
  return conn;
}

void Conn::Close() {
  std::lock_guard<std::mutex> lock(close_mu_);
  if (fd_ >= 0) {
    (void)::shutdown(fd_, SHUT_RDWR);
    (void)::close(fd_);
    fd_ = -1;
  }
}

void Conn::Shutdown() {
  std::lock_guard<std::mutex> lock(close_mu_);
  if (fd_ >= 0) (void)::shutdown(fd_, SHUT_RDWR);
}

void Conn::Broken(const std::string &what) {
  Close();
  Fail(llm_datadist::LLM_LINK_FAILED, "connection to " + address_ + ": " + what);
}

void Conn::Wait(short events, Deadline deadline) {
  // A caller holding something for a short call (blocking.h: the Python binding's GIL) waits
  // its budget out first, holding it; past that it lets go, and the wait is the same as ever.
  if (blocking::Pending()) {
    const auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now()).count();
    if (blocking::WaitBriefly(fd_, events, left)) return;
  }
  for (;;) {
    int ms = MillisLeft(deadline);
    if (ms <= 0) {
      Close();
      Fail(llm_datadist::LLM_TIMEOUT, "deadline passed on the connection to " + address_);
    }
    pollfd p{fd_, events, 0};
    int n = poll(&p, 1, ms);
    if (n > 0) return;  // ready, or an error the next call reports
    if (n < 0 && errno != EINTR) Broken(std::string("poll: ") + std::strerror(errno));
  }
}

void Conn::SendAll(const void *data, size_t n, Deadline deadline) {
  std::vector<iovec> iov{{const_cast<void *>(data), n}};
  SendV(std::move(iov), deadline);
}

void Conn::RecvAll(void *data, size_t n, Deadline deadline) {
  std::vector<iovec> iov{{data, n}};
  RecvV(std::move(iov), deadline);
}

size_t Conn::TakeAhead(void *data, size_t n) {
  const size_t k = std::min(n, ahead_end_ - ahead_at_);
  if (k == 0) return 0;
  std::memcpy(data, ahead_.get() + ahead_at_, k);
  ahead_at_ += k;
  if (ahead_at_ == ahead_end_) ahead_at_ = ahead_end_ = 0;
  return k;
}

size_t Conn::TakeAhead(std::vector<iovec> &iov, size_t first) {
  while (first < iov.size() && ahead_end_ > ahead_at_) {
    const size_t k = TakeAhead(iov[first].iov_base, iov[first].iov_len);
    first = Advance(iov, first, k);
  }
  return first;
}

size_t Conn::FillAhead() {
  if (!ahead_) ahead_.reset(new uint8_t[kAhead]);
  for (;;) {
    const ssize_t got = recv(fd_, ahead_.get(), kAhead, MSG_DONTWAIT);
    if (got > 0) {
      ahead_at_ = 0;
      ahead_end_ = static_cast<size_t>(got);
      return ahead_end_;
    }
    if (got == 0) Broken("closed by the peer");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    Broken(std::strerror(errno));
  }
}

bool Conn::Block(Deadline deadline, int opt) {
  blocking::AboutToBlock();  // a bulk rest waits in the kernel: no hold kept through it
  if (!blocking_) {
    const int flags = fcntl(fd_, F_GETFL, 0);
    if (flags < 0 || fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK) != 0) return false;  // poll instead
    blocking_ = true;
  }
  Arm(opt, deadline, false);
  return true;
}

// The timeout in force may be shorter than what is left (a call
// that times out early re-arms with all of it: `expired`), never longer by more than the
// slack; so successive calls under one deadline mostly reuse the setting, no setsockopt.
void Conn::Arm(int opt, Deadline deadline, bool expired) {
  const int64_t left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now()).count();
  if (left <= 0) TimedOut();
  int64_t &armed = armed_us_[opt == SO_SNDTIMEO ? 1 : 0];
  if (!expired && armed <= left + kArmSlackUs) return;
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(left / 1000000);
  tv.tv_usec = static_cast<suseconds_t>(left % 1000000);
  if (setsockopt(fd_, SOL_SOCKET, opt, &tv, sizeof(tv)) != 0)
    Broken(std::string("setsockopt: ") + std::strerror(errno));
  armed = left;
}

void Conn::Unblock() {
  if (!blocking_) return;
  blocking_ = false;
  if (fd_ < 0) return;  // closed (Broken, a deadline): its number may be another file's now
  const int flags = fcntl(fd_, F_GETFL, 0);
  if (flags >= 0) (void)fcntl(fd_, F_SETFL, flags | O_NONBLOCK);
}

void Conn::TimedOut() {
  Close();
  Fail(llm_datadist::LLM_TIMEOUT, "deadline passed on the connection to " + address_);
}

void Conn::SendV(std::vector<iovec> iov, Deadline deadline) {
  if (closed()) Fail(llm_datadist::LLM_LINK_FAILED, "connection to " + address_ + " is closed");
  if (tls_) return TlsSendV(iov, deadline);
  size_t first = Advance(iov, 0, 0);
  try {
    while (first < iov.size()) {
      msghdr msg{};
      msg.msg_iov = iov.data() + first;
      msg.msg_iovlen = std::min(kMaxIov, iov.size() - first);
      // Blocking: kSendChunk bytes a call (the last span of the batch cut short, restored after).
      size_t cut = msg.msg_iovlen, kept = 0;
      if (blocking_) {
        size_t total = 0;
        for (size_t i = 0; i < msg.msg_iovlen; ++i) {
          total += iov[first + i].iov_len;
          if (total > kSendChunk) {
            cut = first + i;
            kept = iov[cut].iov_len;
            iov[cut].iov_len -= total - kSendChunk;
            msg.msg_iovlen = i + 1;
            break;
          }
        }
      }
      ssize_t n = sendmsg(fd_, &msg, MSG_NOSIGNAL);
      const int err = errno;
      if (kept) iov[cut].iov_len = kept;
      if (n < 0) {
        if (err == EAGAIN || err == EWOULDBLOCK) {
          if (blocking_) {  // the call timed out: go on while time is left
            Arm(SO_SNDTIMEO, deadline, true);
            continue;
          }
          if (BytesFrom(iov, first) >= kBulkMin && Block(deadline, SO_SNDTIMEO)) continue;
          Wait(POLLOUT, deadline);
          continue;
        }
        if (err == EINTR) continue;
        Broken(std::strerror(err));
      }
      first = Advance(iov, first, static_cast<size_t>(n));
      if (first == iov.size()) break;
      // Blocking: the next call gets what is left of the deadline; not yet: a partial send
      // means a full buffer, so a bulk rest blocks from here.
      if (blocking_) Arm(SO_SNDTIMEO, deadline, false);
      if (!blocking_ && BytesFrom(iov, first) >= kBulkMin) Block(deadline, SO_SNDTIMEO);
    }
  } catch (...) {
    Unblock();
    throw;
  }
  Unblock();
}

void Conn::RecvV(std::vector<iovec> iov, Deadline deadline) {
  if (closed()) Fail(llm_datadist::LLM_LINK_FAILED, "connection to " + address_ + " is closed");
  if (tls_) return TlsRecvV(iov, deadline);
  size_t first = TakeAhead(iov, Advance(iov, 0, 0));
  try {
    while (first < iov.size()) {
      msghdr msg{};
      msg.msg_iov = iov.data() + first;
      msg.msg_iovlen = std::min(kMaxIov, iov.size() - first);
      ssize_t n = recvmsg(fd_, &msg, blocking_ ? MSG_WAITALL : 0);
      if (n < 0) {
        const int err = errno;
        if (err == EAGAIN || err == EWOULDBLOCK) {
          if (blocking_) {  // the call timed out: go on while time is left
            Arm(SO_RCVTIMEO, deadline, true);
            continue;
          }
          if (BytesFrom(iov, first) >= kBulkMin && Block(deadline, SO_RCVTIMEO)) continue;
          Wait(POLLIN, deadline);
          continue;
        }
        if (err == EINTR) continue;
        Broken(std::strerror(err));
      }
      if (n == 0) Broken("closed by the peer");
      first = Advance(iov, first, static_cast<size_t>(n));
      if (first == iov.size()) break;
      // Blocking: the next batch's call gets what is left of the deadline, not a fresh one;
      // not yet: the rest, if bulk, is waited for in the kernel from here.
      if (blocking_) Arm(SO_RCVTIMEO, deadline, false);
      if (!blocking_ && BytesFrom(iov, first) >= kBulkMin) Block(deadline, SO_RCVTIMEO);
    }
  } catch (...) {
    Unblock();
    throw;
  }
  Unblock();
}

wire::Header Conn::RecvFrame(std::vector<uint8_t> &payload, Deadline deadline, uint32_t max_payload) {
  uint8_t head[wire::kHeaderSize];
  // A plain socket: the header, a small payload and what follows (a READ_DATA's first data)
  // in one recv, read ahead (RecvAll takes from there first).
  if (!tls_ && ahead_end_ == ahead_at_) {
    if (closed()) Fail(llm_datadist::LLM_LINK_FAILED, "connection to " + address_ + " is closed");
    while (FillAhead() == 0) Wait(POLLIN, deadline);
  }
  RecvAll(head, sizeof(head), deadline);
  // A bad header throws with the connection still open: the caller may answer ERROR, then
  // closes (nothing after it on the stream can be trusted).
  wire::Header h = wire::DecodeHeader(head);
  if (h.length > max_payload)
    ProtocolViolation("a frame of " + std::to_string(h.length) + " bytes where at most " + std::to_string(max_payload) +
                      " are allowed");
  payload.resize(h.length);
  if (h.length) RecvAll(payload.data(), h.length, deadline);
  return h;
}

void Conn::AwaitAnswer(Deadline deadline) {
  if (tls_ || closed() || ahead_end_ != ahead_at_) return;
  Wait(POLLIN, deadline);
}

bool Conn::WaitReadable(int ms) {
  if (closed() || Buffered()) return true;
  pollfd p{fd_, POLLIN, 0};
  return poll(&p, 1, ms) > 0;
}

bool Conn::PeerGone() {
  if (!WaitReadable(0)) return false;
  // TLS: a readable socket may hold records that are not data (a Python server's session
  // tickets, a key update): those are taken, and the connection is still idle.
  return closed() || !tls_ || !tls_->IdleRecordsOnly();
}

// ---- TLS (tls.h): the same calls through the connection's session, waiting between its
// non-blocking steps within the same deadlines.

Conn::~Conn() { Close(); }

size_t Conn::Buffered() const { return tls_ ? tls_->Pending() : ahead_end_ - ahead_at_; }

void Conn::TlsConnect(const tls::Context &ctx, Deadline deadline) {
  try {
    tls_ = std::make_unique<tls::Session>(ctx, fd_, false);
  } catch (const Error &) {
    Close();
    throw;
  }
  while (!TlsAccept(deadline)) {
    pollfd p{fd_, POLLIN, 0};
    blocking::AboutToBlock();  // a handshake's round trips: no hold kept through them
    for (;;) {
      const int ms = MillisLeft(deadline);
      if (ms <= 0) {
        Close();
        Fail(llm_datadist::LLM_TIMEOUT, "TLS handshake with " + address_ + " timed out");
      }
      const int n = poll(&p, 1, ms);
      if (n > 0 || (n < 0 && errno != EINTR)) break;
    }
  }
}

void Conn::TlsServe(const tls::Context &ctx) { tls_ = std::make_unique<tls::Session>(ctx, fd_, true); }

bool Conn::TlsAccept(Deadline deadline) {
  if (closed()) Fail(llm_datadist::LLM_LINK_FAILED, "connection to " + address_ + " is closed");
  for (;;) {
    tls::Session::Want want = tls::Session::Want::kNothing;
    try {
      if (tls_->Handshake(address_, want)) return true;
    } catch (const Error &) {
      Close();
      throw;
    }
    if (want != tls::Session::Want::kWrite) return false;
    // Our flight does not fit the socket's buffer yet (a peer that does not read): bounded.
    const int ms = MillisLeft(deadline);
    if (ms <= 0) {
      Close();
      Fail(llm_datadist::LLM_TIMEOUT, "TLS handshake with " + address_ + " timed out");
    }
    pollfd p{fd_, POLLOUT, 0};
    blocking::AboutToBlock();
    (void)poll(&p, 1, ms);
  }
}

template <typename Byte, typename Step>
void Conn::TlsPump(Byte *p, size_t n, Deadline deadline, const char *what, Step &&step) {
  while (n) {
    tls::Session::Step s = step(p, n);
    if (s.bytes) {
      p += s.bytes;
      n -= s.bytes;
    } else if (s.want != tls::Session::Want::kNothing) {
      Wait(s.want == tls::Session::Want::kRead ? POLLIN : POLLOUT, deadline);
    } else {
      Broken(s.eof ? std::string("closed by the peer") : std::string("TLS ") + what + " failed: " + s.error);
    }
  }
}

void Conn::TlsSendV(std::vector<iovec> &iov, Deadline deadline) {
  // Spans up to a record's size are gathered into one write, so that a frame's header and
  // payload travel in one record (one record to decrypt, not two); larger spans go as they
  // are, a record per 16 KiB.
  constexpr size_t kRecord = 16384;
  std::vector<uint8_t> stage;
  auto put = [&](const uint8_t *p, size_t n) {
    TlsPump(p, n, deadline, "send", [&](const uint8_t *at, size_t left) { return tls_->Write(at, left); });
  };
  for (const iovec &v : iov) {
    const auto *base = static_cast<const uint8_t *>(v.iov_base);
    if (v.iov_len >= kRecord) {
      if (!stage.empty()) put(stage.data(), stage.size());
      stage.clear();
      put(base, v.iov_len);
      continue;
    }
    if (stage.size() + v.iov_len > kRecord) {
      put(stage.data(), stage.size());
      stage.clear();
    }
    stage.insert(stage.end(), base, base + v.iov_len);
  }
  if (!stage.empty()) put(stage.data(), stage.size());
}

void Conn::TlsRecvV(std::vector<iovec> &iov, Deadline deadline) {
  for (const iovec &v : iov) {
    TlsPump(static_cast<uint8_t *>(v.iov_base), v.iov_len, deadline, "receive",
            [&](uint8_t *at, size_t left) { return tls_->Read(at, left); });
  }
}

// ---- Non-blocking steps (net.h): for connections served parked; they never wait.

namespace {

constexpr size_t kRecord = 16384;  // TLS: spans under this are gathered into one record

}  // namespace

size_t Conn::ReadSome(void *data, size_t n, short &want) {
  if (closed()) Fail(llm_datadist::LLM_LINK_FAILED, "connection to " + address_ + " is closed");
  if (n == 0) return 0;
  if (tls_) {
    const tls::Session::Step s = tls_->Read(data, n);
    if (s.bytes) return s.bytes;
    if (s.want != tls::Session::Want::kNothing) {
      want = s.want == tls::Session::Want::kRead ? POLLIN : POLLOUT;
      return 0;
    }
    Broken(s.eof ? std::string("closed by the peer") : "TLS receive failed: " + s.error);
  }
  if (const size_t taken = TakeAhead(data, n)) return taken;
  if (n < kAhead) {  // a header, a small payload: what has arrived, in one call
    if (FillAhead() == 0) {
      want = POLLIN;
      return 0;
    }
    return TakeAhead(data, n);
  }
  for (;;) {
    const ssize_t got = recv(fd_, data, n, MSG_DONTWAIT);
    if (got > 0) return static_cast<size_t>(got);
    if (got == 0) Broken("closed by the peer");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      want = POLLIN;
      return 0;
    }
    Broken(std::strerror(errno));
  }
}

bool Conn::SendSome(Spans &out, short &want, size_t max_bytes) {
  if (closed()) Fail(llm_datadist::LLM_LINK_FAILED, "connection to " + address_ + " is closed");
  size_t moved = 0;
  if (tls_) {
    // As TlsSendV: a frame's small spans travel in one record. The session takes partial
    // writes and moved buffers (tls.cc), so a retry after a want may start anywhere.
    auto step = [&](const uint8_t *p, size_t n, size_t &took) {
      const tls::Session::Step s = tls_->Write(p, n);
      took = s.bytes;
      if (s.bytes) return true;
      if (s.want != tls::Session::Want::kNothing) {
        want = s.want == tls::Session::Want::kRead ? POLLIN : POLLOUT;
        return false;
      }
      Broken(s.eof ? std::string("closed by the peer") : "TLS send failed: " + s.error);
    };
    for (;;) {
      if (moved >= max_bytes) {
        want = POLLOUT;
        return false;
      }
      size_t took = 0;
      if (out.staged < out.stage.size()) {
        if (!step(out.stage.data() + out.staged, out.stage.size() - out.staged, took)) return false;
        out.staged += took;
        moved += took;
        continue;
      }
      out.stage.clear();
      out.staged = 0;
      out.first = Advance(out.iov, out.first, 0);
      if (out.first >= out.iov.size()) return true;
      iovec &v = out.iov[out.first];
      if (v.iov_len >= kRecord) {
        // At most a share a write (the same length again after a want: OpenSSL's retry rule).
        if (!step(static_cast<const uint8_t *>(v.iov_base), std::min(v.iov_len, max_bytes), took)) return false;
        out.first = Advance(out.iov, out.first, took);
        moved += took;
        continue;
      }
      while (out.first < out.iov.size() && out.iov[out.first].iov_len < kRecord &&
             out.stage.size() + out.iov[out.first].iov_len <= kRecord) {
        const auto *b = static_cast<const uint8_t *>(out.iov[out.first].iov_base);
        out.stage.insert(out.stage.end(), b, b + out.iov[out.first].iov_len);
        ++out.first;
      }
    }
  }
  for (;;) {
    out.first = Advance(out.iov, out.first, 0);
    if (out.first >= out.iov.size()) return true;
    if (moved >= max_bytes) {
      want = POLLOUT;
      return false;
    }
    msghdr msg{};
    msg.msg_iov = out.iov.data() + out.first;
    msg.msg_iovlen = std::min(kMaxIov, out.iov.size() - out.first);
    const ssize_t n = sendmsg(fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        want = POLLOUT;
        return false;
      }
      Broken(std::strerror(errno));
    }
    out.first = Advance(out.iov, out.first, static_cast<size_t>(n));
    moved += static_cast<size_t>(n);
  }
}

bool Conn::RecvSome(Spans &in, short &want, size_t max_bytes) {
  if (closed()) Fail(llm_datadist::LLM_LINK_FAILED, "connection to " + address_ + " is closed");
  size_t moved = 0;
  for (;;) {
    in.first = Advance(in.iov, in.first, 0);
    if (in.first >= in.iov.size()) return true;
    if (moved >= max_bytes) {
      want = POLLIN;
      return false;
    }
    size_t got = 0;
    if (ahead_end_ > ahead_at_) {  // read ahead with the frame before
      const size_t before = ahead_end_ - ahead_at_;
      in.first = TakeAhead(in.iov, in.first);
      moved += before - (ahead_end_ - ahead_at_);
      continue;
    }
    if (tls_) {
      iovec &v = in.iov[in.first];
      got = ReadSome(v.iov_base, v.iov_len, want);
      if (!got) return false;
    } else {
      msghdr msg{};
      msg.msg_iov = in.iov.data() + in.first;
      msg.msg_iovlen = std::min(kMaxIov, in.iov.size() - in.first);
      const ssize_t n = recvmsg(fd_, &msg, MSG_DONTWAIT);
      if (n == 0) Broken("closed by the peer");
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          want = POLLIN;
          return false;
        }
        Broken(std::strerror(errno));
      }
      got = static_cast<size_t>(n);
    }
    in.first = Advance(in.iov, in.first, got);
    moved += got;
  }
}

bool Conn::TlsAcceptStep(short &want) {
  if (closed()) Fail(llm_datadist::LLM_LINK_FAILED, "connection to " + address_ + " is closed");
  tls::Session::Want w = tls::Session::Want::kNothing;
  try {
    if (tls_->Handshake(address_, w)) return true;
  } catch (const Error &) {
    Close();
    throw;
  }
  want = w == tls::Session::Want::kWrite ? POLLOUT : POLLIN;
  return false;
}

}  // namespace datadist
