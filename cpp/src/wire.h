// The datadist peer protocol, version 1 (docs/protocol.md): framing, encoding and decoding.
// Pure: bytes in, messages out, and the reverse; no I/O here. The decoder trusts nothing: every
// length is checked against the payload, and any violation throws ProtocolViolation.
#ifndef DATADIST_CPP_WIRE_H_
#define DATADIST_CPP_WIRE_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace datadist {
namespace wire {

constexpr uint8_t kVersion = 1;
constexpr size_t kHeaderSize = 12;
constexpr uint32_t kMaxPayload = 64U << 20;

enum MsgType : uint8_t {
  kHello = 1,
  kWelcome = 2,
  kError = 3,
  kRead = 4,
  kReadData = 5,
  kGrant = 6,
  kRelease = 7,
  kPing = 8,
  kPong = 9,
  kBye = 10,
  kWrite = 11,
  kOk = 12,
  kShmGrant = 13,
  kAuth = 14,
  kChecksum = 15,
  // 16 to 20, 30 to 32: the NIXL data path (docs/protocol.md, "Pull and push over NIXL")
  kNixlMdRequest = 16,  // empty: the owner's NIXL agent metadata, please (answer: kNixlMd)
  kNixlMd = 17,
  kNixlRead = 18,  // READ's encoding; the bytes move by one NIXL READ (answer: kNixlGrant)
  kNixlGrant = 19,
  kNixlWrite = 20,     // WRITE's encoding; the bytes move by one NIXL WRITE (answer: kNixlGrant)
  kStatsRequest = 21,  // empty: the peer's transfer metrics, please (answer: kStats)
  kStats = 22,         // u32 n, then n bytes of UTF-8 JSON (docs/protocol.md, "Metrics")
  kLeaseRequest = 23,
  kCacheLease = 24,
  kNixlLease = 30,  // a read lease on a whole cache for NIXL reads (answer: kNixlLeased)
  kNixlLeased = 31,
  kNixlRevoke = 32,  // owner to reader, on the reader's reverse channel (answer: kOk)
};

constexpr uint8_t kMemDram = 0, kMemVram = 1;  // NIXL_GRANT / NIXL_LEASED mem: DRAM_SEG, VRAM_SEG

enum KeyKind : uint8_t { kCacheKey = 1, kCacheId = 2, kBlocksKey = 3, kAddress = 4 };

constexpr uint32_t kFlagGrant = 1, kFlagShm = 2, kFlagChecksum = 4;
// READ: the requester asked for every tensor (no layer range); the cache must have exactly as
// many tensors as the request names (CANN's GetSendTask), checked by the owner.
constexpr uint32_t kFlagWhole = 8;
// WRITE (its one flag): the spans' bytes follow the request at once, and one answer (OK or
// ERROR) comes after them (docs/protocol.md, "Push"). Sent only to an owner whose WELCOME set
// kFeatureEagerWrite, and only for at most kEagerMax bytes: an eager WRITE naming more is
// malformed (its owner would have to drain them all to refuse it).
constexpr uint32_t kFlagEager = 16;
constexpr uint64_t kEagerMax = 4 << 20;
// HELLO / WELCOME features (bit 0, FEATURE_AUTH, is in auth.h)
constexpr uint32_t kFeatureLocal = 2;    // WELCOME: the server also serves its local channel
constexpr uint32_t kFeatureReverse = 4;  // WELCOME: reverse channels accepted; HELLO: this is one
constexpr uint32_t kFeatureLease = 8;    // WELCOME, local channel: LEASE_REQUEST is answered
// The link token (docs/protocol.md, "Reverse channels"): a WELCOME answering a control HELLO
// ends its proof with kLinkTokenBytes random bytes; a reverse HELLO ends its proof with the
// token of its client's live control channel, and is adopted only with it.
constexpr uint32_t kFeatureToken = 16;
constexpr size_t kLinkTokenBytes = 16;
constexpr uint32_t kFeatureEagerWrite = 32;  // WELCOME: WRITE with kFlagEager is served
/// (the rest of `proof`, its link token) for a HELLO / WELCOME with `features` (token empty
/// without kFeatureToken, or when `proof` is too short to hold one).
std::pair<std::string, std::string> SplitToken(const std::string &proof, uint32_t features);
// LEASE_REQUEST flags: kFlagShm (the reader maps shareable memory), or a lease to write
constexpr uint32_t kLeaseWrite = 0x100;

struct Header {
  uint8_t type = 0;
  uint32_t request_id = 0;
  uint32_t length = 0;
};

struct Hello {  // also Welcome
  uint64_t cluster_id = 0;
  uint8_t role = 0;
  uint32_t pid = 0;
  uint64_t pid_ns = 0;
  std::array<uint8_t, 16> boot_id{};
  uint32_t features = 0;
  std::string proof;
};

struct ErrorMsg {
  int64_t code = 0;
  std::string message;
};

/// READ or WRITE: the key, and spans: for every tensor, for every (offset, length).
struct Request {
  uint8_t kind = 0;
  uint64_t a = 0, b = 0, c = 0;
  uint64_t unit_bytes = 0;
  uint64_t layout = 0;
  uint32_t flags = 0;
  std::vector<uint32_t> tensors;
  std::vector<uint64_t> offsets;
  std::vector<uint64_t> lengths;
};

/// GRANT: a lease on the owner's memory and, per requested tensor, its unit base address.
struct Grant {
  uint64_t lease_id = 0;
  std::vector<uint64_t> bases;
};

struct Release {
  uint64_t lease_id = 0;
  bool ok = false;
};

/// CHECKSUM: zlib's CRC-32 of a read's source spans, and their byte count.
struct Checksum {
  uint32_t crc = 0;
  uint64_t nbytes = 0;
};

/// SHM_GRANT: per requested tensor, the owner's memfd number, its inode and the offset of the
/// tensor's unit base in it (docs/protocol.md, "Pull on the same host"; shm.h).
struct ShmGrant {
  uint64_t lease_id = 0;
  std::vector<int32_t> fds;
  std::vector<uint64_t> inos, offsets;
};

/// LEASE_REQUEST: a lease on a whole cache, named by id (kCacheId, b ignored) or by
/// BlocksCacheKey (kBlocksKey); flags kFlagShm and / or kLeaseWrite.
struct LeaseRequest {
  uint8_t kind = 0;
  uint64_t a = 0, b = 0, c = 0;
  uint32_t flags = 0;
};

/// CACHE_LEASE (docs/protocol.md, "Cache leases"): the cache's geometry, every tensor's
/// address in the owner's address space, its memfds (or none) and the fence file.
struct CacheLease {
  uint64_t cache_id = 0;
  uint64_t tensor_bytes = 0;
  uint64_t units = 0;
  bool is_blocks = false;
  uint64_t layout = 0;
  int32_t fence_fd = -1;
  uint64_t fence_ino = 0;
  std::vector<uint64_t> addrs;
  std::vector<int32_t> shm_fds;
  std::vector<uint64_t> shm_inos, shm_offsets;
};

/// NIXL_MD: the owner's NIXL agent name, the generation of its registrations and its metadata.
struct NixlMd {
  std::string agent;
  uint64_t generation = 0;
  std::string metadata;
};

/// NIXL_GRANT: a NIXL_READ (NIXL_WRITE) accepted: per requested tensor its unit base, the agent
/// to read from (write into), its generation, and the memory kind and device of the spans.
struct NixlGrant {
  uint64_t lease_id = 0;
  std::string agent;
  uint64_t generation = 0;
  uint8_t mem = kMemDram;
  uint32_t device = 0;
  std::vector<uint64_t> bases;
};

/// NIXL_LEASE: a read lease on a whole cache named by id (kCacheId) or model id (kBlocksKey),
/// and for the latter the block size the reader assumes (0: any).
struct NixlLease {
  uint8_t kind = 0;
  uint64_t a = 0, b = 0, c = 0;
  uint64_t unit_bytes = 0;
};

/// NIXL_LEASED: the leased cache's geometry, every tensor's address, and the agent as in NixlGrant.
struct NixlLeased {
  uint64_t lease_id = 0;
  std::string agent;
  uint64_t generation = 0;
  uint8_t mem = kMemDram;
  uint32_t device = 0;
  bool blocks = false;
  uint64_t tensor_bytes = 0, unit_bytes = 0, units = 0, layout = 0;
  std::vector<uint64_t> addrs;
};

// ---- encoding: whole frames
std::vector<uint8_t> EncodeHello(uint8_t type, const Hello &h, uint32_t rid);
std::vector<uint8_t> EncodeError(const ErrorMsg &e, uint32_t rid);
std::vector<uint8_t> EncodeRequest(uint8_t type, const Request &r, uint32_t rid);
std::vector<uint8_t> EncodeU64(uint8_t type, uint64_t value, uint32_t rid);  // READ_DATA, PING, PONG
std::vector<uint8_t> EncodeEmpty(uint8_t type, uint32_t rid);                // OK, BYE
std::vector<uint8_t> EncodeChecksum(uint32_t crc, uint64_t nbytes, uint32_t rid);
std::vector<uint8_t> EncodeAuth(const std::string &proof, uint32_t rid);
std::vector<uint8_t> EncodeGrant(const Grant &g, uint32_t rid);
std::vector<uint8_t> EncodeShmGrant(const ShmGrant &g, uint32_t rid);
std::vector<uint8_t> EncodeRelease(const Release &r, uint32_t rid);
std::vector<uint8_t> EncodeLeaseRequest(const LeaseRequest &r, uint32_t rid);
std::vector<uint8_t> EncodeCacheLease(const CacheLease &l, uint32_t rid);
std::vector<uint8_t> EncodeStats(const std::string &json, uint32_t rid);  // STATS
std::vector<uint8_t> EncodeNixlMd(const NixlMd &m, uint32_t rid);
std::vector<uint8_t> EncodeNixlGrant(const NixlGrant &g, uint32_t rid);
std::vector<uint8_t> EncodeNixlLease(const NixlLease &l, uint32_t rid);
std::vector<uint8_t> EncodeNixlLeased(const NixlLeased &l, uint32_t rid);

// ---- decoding
Header DecodeHeader(const uint8_t *data);  // exactly kHeaderSize bytes
Hello DecodeHello(const std::vector<uint8_t> &payload);
/// The message comes back as UTF-8: ill-formed parts become U+FFFD, as in Python's codec.
ErrorMsg DecodeError(const std::vector<uint8_t> &payload);
Request DecodeRequest(uint8_t type, const std::vector<uint8_t> &payload);
/// The bytes a READ's or WRITE's spans name, sum(lengths) * tensors: what a WRITE's raw
/// bytes count (UINT64_MAX where that does not fit in 64 bits).
uint64_t SpanBytes(const Request &r);
uint64_t DecodeU64(const std::vector<uint8_t> &payload);
std::string DecodeAuth(const std::vector<uint8_t> &payload);
void DecodeEmpty(const std::vector<uint8_t> &payload);
Grant DecodeGrant(const std::vector<uint8_t> &payload);
Release DecodeRelease(const std::vector<uint8_t> &payload);
/// Key kinds other than kCacheId / kBlocksKey, and unknown flags, are malformed.
LeaseRequest DecodeLeaseRequest(const std::vector<uint8_t> &payload);
/// Malformed (as Python's decoder): is_blocks > 1, no tensors, units 0, tensor bytes not a
/// multiple of units, m neither 0 nor n.
CacheLease DecodeCacheLease(const std::vector<uint8_t> &payload);
Checksum DecodeChecksum(const std::vector<uint8_t> &payload);
ShmGrant DecodeShmGrant(const std::vector<uint8_t> &payload);
/// STATS: the JSON bytes as they came (the caller parses them); a count beyond the payload,
/// or bytes after the JSON, are malformed.
std::string DecodeStats(const std::vector<uint8_t> &payload);
NixlMd DecodeNixlMd(const std::vector<uint8_t> &payload);
/// A memory kind other than kMemDram / kMemVram is malformed.
NixlGrant DecodeNixlGrant(const std::vector<uint8_t> &payload);
/// Key kinds other than kCacheId / kBlocksKey are malformed.
NixlLease DecodeNixlLease(const std::vector<uint8_t> &payload);
/// Malformed: an unknown memory kind, blocks > 1.
NixlLeased DecodeNixlLeased(const std::vector<uint8_t> &payload);

/// The name docs/protocol.md gives a message type this codec speaks ("HELLO"), or nullptr for
/// a type it does not (reserved and unknown numbers): DecodeHeader refuses those.
const char *TypeName(uint8_t type);

// ---- helpers shared with Python's implementation
uint32_t Crc32(uint32_t crc, const void *data, size_t n);  // zlib's CRC-32
/// (dtype + 1) << 32 | crc32 of the per-unit shape joined by ",", as layout_tag() in Python.
uint64_t LayoutTag(int32_t dtype, const std::vector<int64_t> &unit_shape);

}  // namespace wire
}  // namespace datadist

#endif  // DATADIST_CPP_WIRE_H_
