// Checksummed pulls (docs/protocol.md, READ flag CHECKSUM), both sides, as Python's engine:
//
// * owner: after the answer to a READ with the flag (READ_DATA and the bytes, or a GRANT) a
//   CHECKSUM frame: zlib's CRC-32 (crc32.h) of the source spans in order, and their byte count,
//   computed before the bytes are sent (stream) or while the grant holds the memory, always
//   with a fault-safe read (Frame: a hole in the memory is an error frame, no CHECKSUM). A
//   streamed read's CacheKey is consumed only once the reader's verdict says the CRC matched (Pending);
//   a granted one at its RELEASE with ok, as without the flag;
// * reader: computes the CRC of what landed, compares it and the byte count, tells the owner
//   (stream: RELEASE with lease id 0 and the READ's request id; grant: its RELEASE's ok), and
//   fails a mismatch with LLM_SUSPECT_REMOTE_ERROR, its message starting with kMismatch.
//
// Who calls: the server's Dispatch (owner), Link::Read (reader), on the thread serving or
// making the request. Nothing here blocks but the frames' sends and receives, within their
// deadlines.
#ifndef DATADIST_CPP_VERIFY_H_
#define DATADIST_CPP_VERIFY_H_

#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "registry.h"
#include "wire.h"

namespace datadist {
namespace verify {

/// How a mismatch's message starts (for people: callers tell a mismatch by its kind,
/// ErrorKind::kChecksumMismatch, not by this text).
constexpr char kMismatch[] = "checksum mismatch";

/// Owner: the CHECKSUM frame over `src` (the read's source spans, in this process's memory),
/// answering request `rid`. The bytes are read fault-safely (crc::Crc32Own: a bounded scratch
/// copy per thread, never an in-process load): a span that is not mapped any more (the
/// caller freed registered memory behind our back) throws Error(LLM_DEVICE_MEM_ERROR) naming
/// `what` and the address, and the caller answers the peer an error frame instead of dying of
/// SIGSEGV. LLM_FAILED if no fault-safe read can be had (crc32.h). Blocks on nothing.
std::vector<uint8_t> Frame(const std::vector<iovec> &src, uint32_t rid, const std::string &what = "registered memory");
/// The same over a lease's spans (its iov), an error naming the cache and the tensor the
/// unreadable byte lies in, also told on stderr (the caller's bug, which the peer's error may
/// never reach): what the server's READ with CHECKSUM, GRANT and NIXL_GRANT call.
std::vector<uint8_t> Frame(const Lease &lease, uint32_t rid);
/// The same CRC, a part at a time: continued from `crc` (that of the lease's bytes before
/// `part`, 0 at the start) over `part`, spans inside the lease's, with Frame's errors. The
/// server's READ with CHECKSUM computes its CRC this way, a step's share per step, so that a
/// request naming terabytes (spans may repeat) never holds an I/O thread for long.
uint32_t Continue(const Lease &lease, const std::vector<iovec> &part, uint32_t crc);

/// Reader: the CHECKSUM frame's content, from the frame that came after the answer (`h`,
/// `payload`, already checked to answer the READ). Anything else: LLM_SUSPECT_REMOTE_ERROR
/// (the caller closes the connection).
wire::Checksum Expect(const wire::Header &h, const std::vector<uint8_t> &payload);

/// Reader: "" when `local` (what landed) has the owner's CRC and byte count, else why not
/// (the message a mismatch raises, starting with kMismatch).
std::string Compare(const wire::Checksum &owner, const std::vector<iovec> &local);

/// Reader: throws the mismatch `why` (from Compare) as LLM_SUSPECT_REMOTE_ERROR of kind
/// ErrorKind::kChecksumMismatch.
[[noreturn]] void Mismatch(const std::string &why);

/// Owner: the streamed read of a connection that awaits its reader's verdict (at most one: a
/// reader sends its verdict before its next request). The memory is free meanwhile; only the
/// key's reservation waits. Used by the thread serving the connection, one at a time.
class Pending {
 public:
  /// The read `rid` was sent with its CHECKSUM: its lease lets go of the memory, its
  /// reservation stays until Settle (or Drop).
  void Await(uint32_t rid, std::unique_ptr<Lease> lease);
  /// The frame after it settles it: a RELEASE with lease id 0 and that read's request id is
  /// the verdict (true: consumed here, the read committed if ok said so); anything else means
  /// no verdict, the read counts as failed, and the frame is served as usual (false). A
  /// malformed RELEASE throws (the connection ends; the read counts as failed).
  bool Settle(const wire::Header &h, const std::vector<uint8_t> &payload);
  /// The connection ended: a read still awaiting its verdict counts as failed.
  void Drop() { lease_.reset(); }

 private:
  uint32_t rid_ = 0;
  std::unique_ptr<Lease> lease_;
};

}  // namespace verify
}  // namespace datadist

#endif  // DATADIST_CPP_VERIFY_H_
