// One TCP connection with deadlines: every blocking call takes an absolute deadline and fails
// with LLM_TIMEOUT past it (the socket is non-blocking; waits are poll()s bounded by the time
// left), or with LLM_LINK_FAILED when the peer closes or the socket breaks. After either, the
// connection is closed: a half-read stream cannot be resynchronised. A served connection
// (server.cc) uses the non-blocking steps instead (ReadSome, SendSome, RecvSome), which never
// wait: an I/O pool thread never waits on a peer. Not thread-safe: its owner serialises calls
// (a link's mutex, or the one pool thread running its task); Shutdown() alone may be called
// from another thread, to wake a blocked user.
#ifndef DATADIST_CPP_NET_H_
#define DATADIST_CPP_NET_H_

#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "wire.h"

namespace datadist {

namespace tls {
class Context;
class Session;
}  // namespace tls

/// A transfer in progress that must not wait (a connection served parked, server.cc): the
/// spans still to send or fill, advanced as the socket takes or gives bytes. `stage` and
/// `staged` are TLS's: spans under a record's size are gathered there into one write.
struct Spans {
  std::vector<iovec> iov;
  size_t first = 0;            // the first entry not finished
  std::vector<uint8_t> stage;  // TLS sends: small spans gathered into one record
  size_t staged = 0;           // of which sent
  bool done() const { return first >= iov.size() && staged >= stage.size(); }
  void clear() {
    iov.clear();
    first = 0;
    stage.clear();
    staged = 0;
  }
};

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

inline Deadline After(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

class Conn {
 public:
  explicit Conn(int fd, std::string address);
  ~Conn();
  Conn(const Conn &) = delete;
  Conn &operator=(const Conn &) = delete;

  /// Connects within the deadline. LLM_LINK_FAILED (refused, unreachable) or LLM_TIMEOUT.
  /// `was_listening`: a peer that listened there before (a link reconnecting), so a refusal
  /// says it stopped, not that it may lack a listen address.
  static std::unique_ptr<Conn> Connect(const std::string &host, uint16_t port, Deadline deadline,
                                       bool was_listening = false);

  void SendAll(const void *data, size_t n, Deadline deadline);
  void SendFrame(const std::vector<uint8_t> &frame, Deadline deadline) {
    SendAll(frame.data(), frame.size(), deadline);
  }
  /// Sends / receives exactly the bytes the iovecs name (zero-length entries allowed).
  void SendV(std::vector<iovec> iov, Deadline deadline);
  void RecvV(std::vector<iovec> iov, Deadline deadline);
  void RecvAll(void *data, size_t n, Deadline deadline);
  /// One frame: header, then its payload. A header announcing more than `max_payload` bytes
  /// is a protocol violation (the connection is closed before the payload is read).
  wire::Header RecvFrame(std::vector<uint8_t> &payload, Deadline deadline, uint32_t max_payload = wire::kMaxPayload);

  // ---- Non-blocking steps, for a connection served parked (server.cc, iopool.h): each does
  // what the socket allows now and never waits. Where one cannot go on, it says what to wait
  // for in `want` (POLLIN, or POLLOUT; TLS may want either way round). The peer closing, or
  // the socket breaking: LLM_LINK_FAILED, the connection closed, as the blocking calls.
  /// Up to `n` bytes of what has arrived: how many (> 0), or 0 when nothing is there yet.
  size_t ReadSome(void *data, size_t n, short &want);
  /// Sends what the socket takes now of `out`, at most `max_bytes` this call (a step's share
  /// of a thread): true once all is sent; false with `want` set (POLLOUT at the share's end).
  bool SendSome(Spans &out, short &want, size_t max_bytes = SIZE_MAX);
  /// Fills `in`'s iovecs with what has arrived, at most `max_bytes` this call: true once full.
  bool RecvSome(Spans &in, short &want, size_t max_bytes = SIZE_MAX);
  /// One non-blocking step of the server's TLS handshake (after TlsServe): true once
  /// complete; false with `want` set. LLM_LINK_FAILED, the connection closed.
  bool TlsAcceptStep(short &want);

  /// Waits up to `ms` for something to read (or the peer closing). No error on timeout.
  bool WaitReadable(int ms);
  /// Right after a request went (Link::Read): waits, as every read waits (the caller's
  /// blocking hook included), until the answer's first bytes are there, without first trying
  /// a receive that would find nothing: a peer answers after a wake-up at the soonest. Returns
  /// at once with bytes read ahead, on TLS or closed (the read that follows handles those);
  /// throws LLM_TIMEOUT at `deadline` (the connection closed), as RecvFrame would.
  void AwaitAnswer(Deadline deadline);
  /// True when an idle connection has something to read: between requests the peer sends
  /// nothing, so readable means it closed or broke the protocol. Never blocks.
  bool PeerGone();

  /// TLS on this connection (tls.h), as the client: the handshake runs here, bounded by the
  /// deadline. LLM_LINK_FAILED "TLS handshake with <address> failed: <why>" (a certificate
  /// refused either way, a peer that does not speak TLS), LLM_TIMEOUT "TLS handshake with
  /// <address> timed out"; the connection is closed after either.
  void TlsConnect(const tls::Context &ctx, Deadline deadline);
  /// TLS on this connection, as the server: set up only; TlsAccept steps run the handshake.
  void TlsServe(const tls::Context &ctx);
  /// One non-blocking step of the server's handshake (after TlsServe): true once complete,
  /// false when the client's next bytes are needed (park and call again when readable). A
  /// write the socket cannot take yet is waited for, within `deadline`. LLM_LINK_FAILED or
  /// LLM_TIMEOUT; the connection is closed after either.
  bool TlsAccept(Deadline deadline);
  bool tls() const { return tls_ != nullptr; }
  /// Bytes taken from the socket and not by a caller yet: TLS's decrypted ones, or a plain
  /// socket's read ahead (below). A connection with some has something to read whatever
  /// poll or epoll says of its socket.
  size_t Buffered() const;
  /// The memory its read-ahead holds (0 or kAhead): counted in a server's per-connection
  /// buffers (Server::buffered).
  size_t ahead_held() const { return ahead_ ? kAhead : 0; }

  void Close();
  void Shutdown();  // thread-safe: wakes a blocked user, who then closes
  bool closed() const { return fd_ < 0; }
  int fd() const { return fd_; }  // for getsockopt (SO_PEERCRED); the owner's thread only
  const std::string &address() const { return address_; }

 private:
  void Wait(short events, Deadline deadline);
  [[noreturn]] void Broken(const std::string &what);
  [[noreturn]] void TimedOut();  // closes; LLM_TIMEOUT
  /// Bulk transfers (net.cc, kBulkMin): O_NONBLOCK off until Unblock, the socket's `opt`
  /// (SO_RCVTIMEO / SO_SNDTIMEO) armed with what is left of `deadline`. False (still
  /// non-blocking: poll as before) if fcntl fails; TimedOut when no time is left.
  bool Block(Deadline deadline, int opt);
  void Unblock();  // O_NONBLOCK on again, unless the connection closed meanwhile
  /// The socket's `opt` timeout kept within `deadline` for the next blocking call (after
  /// one timed out, `expired`: all the time left); TimedOut when none is left.
  void Arm(int opt, Deadline deadline, bool expired);
  void TlsSendV(std::vector<iovec> &iov, Deadline deadline);
  void TlsRecvV(std::vector<iovec> &iov, Deadline deadline);
  /// Moves n bytes at p through `step` (the session's Read or Write), waiting on the socket
  /// for what TLS wants until `deadline`; EOF or an error breaks the connection.
  template <typename Byte, typename Step>
  void TlsPump(Byte *p, size_t n, Deadline deadline, const char *what, Step &&step);
  /// Read-ahead (plain sockets): a read of a few bytes (a frame's header) takes what has
  /// arrived, up to kAhead, in one call, so that a small frame's header and payload (and a
  /// READ_DATA's first data) cost one recv, not one each. What a caller did not ask for yet
  /// stays here and every read takes it first (Buffered() counts it). At most kAhead bytes
  /// a connection, allocated at its first small read.
  static constexpr size_t kAhead = 2048;
  /// Copies up to `n` read-ahead bytes to `data`: how many.
  size_t TakeAhead(void *data, size_t n);
  /// Fills `iov` from index `first` with read-ahead bytes: the first unfinished entry after.
  size_t TakeAhead(std::vector<iovec> &iov, size_t first);
  /// One non-blocking recv into the empty read-ahead buffer: bytes read (> 0), or 0 (EAGAIN).
  /// EOF or an error breaks the connection.
  size_t FillAhead();
  std::unique_ptr<uint8_t[]> ahead_;
  size_t ahead_at_ = 0, ahead_end_ = 0;  // the bytes not taken: [ahead_at_, ahead_end_)
  int fd_;
  bool blocking_ = false;  // inside a bulk SendV / RecvV, O_NONBLOCK off (the owner's thread only)
  int64_t armed_us_[2] = {INT64_MAX, INT64_MAX};  // SO_RCVTIMEO, SO_SNDTIMEO in force (none yet: forever)
  std::unique_ptr<tls::Session> tls_;             // the owner's only
  std::mutex close_mu_;                           // Close (owner) vs Shutdown (any thread)
  std::string address_;
};

}  // namespace datadist

#endif  // DATADIST_CPP_NET_H_
