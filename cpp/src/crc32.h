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

}  // namespace crc
}  // namespace datadist

#endif  // DATADIST_CPP_CRC32_H_
