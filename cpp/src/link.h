// Links: our client connections to remote clusters (LinkLlmClusters). One control connection
// per link, opened with HELLO / WELCOME; transfers on a link are serialised by its mutex and
// each carries a deadline. A connection a timeout or a dead peer broke is reopened, with a
// fresh handshake, on the next transfer.
#ifndef DATADIST_CPP_LINK_H_
#define DATADIST_CPP_LINK_H_

#include <sys/uio.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "net.h"
#include "wire.h"

namespace datadist {

class Link {
 public:
  /// `secret`: the shared secret to prove, and to require the peer to prove (empty: none).
  Link(uint64_t remote_cluster_id, std::string host, uint16_t port, wire::Hello hello, std::string secret)
      : remote_(remote_cluster_id), host_(std::move(host)), port_(port), hello_(std::move(hello)),
        secret_(std::move(secret)) {}

  /// Connects and shakes hands within the deadline. LLM_LINK_FAILED / LLM_TIMEOUT.
  void Open(Deadline deadline);
  /// Pull: READ answered by READ_DATA and exactly the bytes `local` names.
  void Read(const wire::Request &req, const std::vector<iovec> &local, Deadline deadline);
  /// Push: WRITE, go-ahead OK, the bytes, confirming OK.
  void Write(const wire::Request &req, const std::vector<iovec> &local, Deadline deadline);
  /// Tells the peer we leave (BYE), waiting for a transfer in flight up to the deadline:
  /// LLM_LINK_BUSY if it does not finish. With force, closes at once.
  void Close(Deadline deadline, bool force);
  uint64_t remote_cluster_id() const { return remote_; }

 private:
  void Prepare(Deadline deadline);  // busy held: reconnect a broken connection
  void Connect(Deadline deadline);  // busy held: a fresh connection and handshake
  wire::Header Call(const std::vector<uint8_t> &frame, std::vector<uint8_t> &payload, Deadline deadline);
  wire::Header Answer(std::vector<uint8_t> &payload, Deadline deadline);
  /// Held for one transfer; released by the guard's destructor.
  class Busy {
   public:
    explicit Busy(Link *link) : link_(link) {}
    ~Busy() { link_->Release(); }
    Busy(const Busy &) = delete;
    Busy &operator=(const Busy &) = delete;

   private:
    Link *link_;
  };
  /// Takes the link for one transfer by the deadline, else LLM_LINK_BUSY (as Python). A
  /// mutex and a flag rather than a timed mutex: ThreadSanitizer sees through these.
  std::unique_ptr<Busy> Acquire(Deadline deadline, bool timeout_if_late = true);
  bool TryAcquire();
  void Release();

  uint64_t remote_;
  std::string host_;
  uint16_t port_;
  wire::Hello hello_;
  std::string secret_;
  std::mutex mu_;  // guards busy_ only
  std::condition_variable idle_;
  bool busy_ = false;  // a transfer (or open / close) holds the fields below
  std::unique_ptr<Conn> conn_;
  uint32_t rid_ = 0;
  bool closing_ = false;
};

}  // namespace datadist

#endif  // DATADIST_CPP_LINK_H_
