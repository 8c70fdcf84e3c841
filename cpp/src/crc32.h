// CRC-32 as zlib (and Python's zlib.crc32) computes it: the reflected polynomial 0xEDB88320,
// the running value inverted before and after. It is the checksum of a checksummed pull
// (docs/protocol.md, flag CHECKSUM: the owner's over the source spans, the reader's over what
// landed) and the hash in a cache's layout tag, so it must give exactly Python's numbers.
//
// Speed: on x86-64 with PCLMULQDQ (checked once at run time) 64-byte blocks are folded with
// carry-less multiplies (the folding method of Intel's "Fast CRC Computation for Generic
// Polynomials Using PCLMULQDQ"); elsewhere, and for the few bytes around the blocks, a
// slicing-by-8 table. docs/cpp.md ("Speed") has the figures against memcpy.
//
// Thread-safety: pure functions; the tables are built once, thread-safely, on first use.
// Crc32Own uses a scratch buffer (and, in its fallback, a pipe) per calling thread.
#ifndef DATADIST_CPP_CRC32_H_
#define DATADIST_CPP_CRC32_H_

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace datadist {
namespace crc {

/// zlib's crc32(crc, data, n): `crc` the value so far (0 to start). The fastest form here.
uint32_t Crc32(uint32_t crc, const void *data, size_t n);
/// The same value with the slicing-by-8 table only (the fallback; tests compare the two).
uint32_t Crc32Table(uint32_t crc, const void *data, size_t n);
/// The CRC-32 of the bytes `iov` names, in order (the spans of a read, as one stream).
uint32_t Crc32Iov(const std::vector<iovec> &iov);
/// Does Crc32 use carry-less multiplies on this CPU (for logs and the benchmark)?
bool Accelerated();

/// What Crc32Own found: `ok` and the CRC, or not `ok` and the address of the first byte it
/// could not read (`bad`; not mapped, or not readable), or `refused` (no fault-safe read to be
/// had: the kernel forbids both ways below; the message says why).
struct OwnRead {
  bool ok = false;
  uint32_t crc = 0;
  uintptr_t bad = 0;
  const char *refused = nullptr;
};

/// The CRC-32 of the bytes `iov` names in this process's memory, as Crc32Iov, read without
/// ever touching them in-process: a memory hole (the caller unmapped registered memory) is an
/// answer here, never a SIGSEGV. The owner's checksum over registered memory, computed on a
/// peer's behalf (verify::Frame), is this.
///
/// How: the spans are copied, up to 256 KiB and 1024 spans at a time, into a scratch buffer of
/// the calling thread with process_vm_readv on our own pid (the kernel answers EFAULT where a
/// byte is not mapped or readable) and the CRC runs over the copy, which is still in the cache.
/// Where the kernel refuses that call (EPERM or ENOSYS: a seccomp filter, a kernel without
/// cross-memory attach; remembered for the process), the bytes go through a pipe of the thread
/// instead (write answers EFAULT the same way; one copy more). Only when neither can be had
/// (no pipe: out of descriptors) is the CRC refused. Blocks on nothing but these syscalls.
/// Called by the thread serving a checksummed read (verify::Frame, verify::Continue). `crc`:
/// the CRC of the bytes before these (0: none), to compute one CRC over spans taken in parts.
OwnRead Crc32Own(const std::vector<iovec> &iov, uint32_t crc = 0);

/// Tests: make Crc32Own take its pipe fallback (true) or choose as usual (false).
void ForcePipeForTests(bool on);

}  // namespace crc
}  // namespace datadist

#endif  // DATADIST_CPP_CRC32_H_
