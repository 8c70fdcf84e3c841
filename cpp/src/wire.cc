#include "wire.h"

#include <cstring>

#include "crc32.h"
#include "errors.h"

namespace datadist {
namespace wire {
namespace {

class Writer {
 public:
  explicit Writer(uint8_t type, uint32_t rid) {
    buf_.resize(kHeaderSize);
    buf_[0] = 'D';
    buf_[1] = 'D';
    buf_[2] = kVersion;
    buf_[3] = type;
    Put(4, rid, 4);
  }
  void Reserve(size_t payload) { buf_.reserve(kHeaderSize + payload); }  // the bytes still to come
  void U8(uint64_t v) { Append(v, 1); }
  void U16(uint64_t v) { Append(v, 2); }
  void U32(uint64_t v) { Append(v, 4); }
  void U64(uint64_t v) { Append(v, 8); }
  void Raw(const void *p, size_t n) {
    const auto *b = static_cast<const uint8_t *>(p);
    buf_.insert(buf_.end(), b, b + n);
  }
  void Blob(const std::string &s) {
    if (s.size() > 0xFFFF) Fail(llm_datadist::LLM_FAILED, "byte field longer than 65535");
    U16(s.size());
    Raw(s.data(), s.size());
  }
  std::vector<uint8_t> Finish() {
    size_t len = buf_.size() - kHeaderSize;
    if (len > kMaxPayload) Invalid("request too large for one frame (" + std::to_string(len) + " bytes)");
    Put(8, len, 4);
    return std::move(buf_);
  }

 private:
  void Append(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) buf_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  void Put(size_t at, uint64_t v, int n) {
    for (int i = 0; i < n; ++i) buf_[at + i] = static_cast<uint8_t>(v >> (8 * i));
  }
  std::vector<uint8_t> buf_;
};

class Reader {
 public:
  explicit Reader(const std::vector<uint8_t> &p) : p_(p) {}
  const uint8_t *Take(size_t n) {
    if (n > p_.size() - pos_) ProtocolViolation("payload truncated");
    const uint8_t *out = p_.data() + pos_;
    pos_ += n;
    return out;
  }
  uint64_t Uint(int n) {
    const uint8_t *b = Take(n);
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(b[i]) << (8 * i);
    return v;
  }
  std::string Blob() {
    size_t n = Uint(2);
    const uint8_t *b = Take(n);
    return std::string(reinterpret_cast<const char *>(b), n);
  }
  template <typename T>
  std::vector<T> Array(uint64_t count) {
    if (count > (p_.size() - pos_) / sizeof(T)) ProtocolViolation("array count beyond the payload");
    std::vector<T> out(count);
    for (auto &v : out) v = static_cast<T>(Uint(sizeof(T)));
    return out;
  }
  void Done() const {
    if (pos_ != p_.size()) ProtocolViolation(std::to_string(p_.size() - pos_) + " trailing bytes in payload");
  }

 private:
  const std::vector<uint8_t> &p_;
  size_t pos_ = 0;
};

// The message types this codec speaks, by number: docs/protocol.md's names ("Messages").
constexpr std::array<const char *, 256> kTypeNames = [] {
  std::array<const char *, 256> t{};
  t[kHello] = "HELLO";
  t[kWelcome] = "WELCOME";
  t[kError] = "ERROR";
  t[kRead] = "READ";
  t[kReadData] = "READ_DATA";
  t[kGrant] = "GRANT";
  t[kRelease] = "RELEASE";
  t[kPing] = "PING";
  t[kPong] = "PONG";
  t[kBye] = "BYE";
  t[kWrite] = "WRITE";
  t[kOk] = "OK";
  t[kShmGrant] = "SHM_GRANT";
  t[kAuth] = "AUTH";
  t[kChecksum] = "CHECKSUM";
  t[kLeaseRequest] = "LEASE_REQUEST";
  t[kCacheLease] = "CACHE_LEASE";
  t[kStatsRequest] = "STATS_REQUEST";
  t[kStats] = "STATS";
  t[kNixlMdRequest] = "NIXL_MD_REQUEST";
  t[kNixlMd] = "NIXL_MD";
  t[kNixlRead] = "NIXL_READ";
  t[kNixlGrant] = "NIXL_GRANT";
  t[kNixlWrite] = "NIXL_WRITE";
  t[kNixlLease] = "NIXL_LEASE";
  t[kNixlLeased] = "NIXL_LEASED";
  t[kNixlRevoke] = "NIXL_REVOKE";
  return t;
}();

// What a message may not carry, written once for the encoder (Refuse: LLM_FAILED, we were
// about to say it) and the decoder (Reject: the peer said it, the connection closes); as
// Python's codec does. Each returns why, or "".

std::string RequestFault(uint8_t type, uint8_t kind, uint32_t flags) {
  if (kind < kCacheKey || kind > kAddress) return "unknown key kind " + std::to_string(kind);
  if (type == kRead || type == kNixlRead) {
    if (kind == kAddress) return "raw addresses (key kind 4) are for WRITE only";
    if (type == kNixlRead) {
      if (flags & ~(kFlagChecksum | kFlagWhole)) return "unknown NIXL read flags " + std::to_string(flags);
    } else if (flags & ~(kFlagGrant | kFlagShm | kFlagChecksum | kFlagWhole)) {
      return "unknown read flags " + std::to_string(flags);
    }
  } else if (flags & ~(type == kWrite ? kFlagEager : 0U)) {
    return "unknown write flags " + std::to_string(flags);  // NIXL_WRITE: none
  }
  return "";
}

// The same, with what the spans say: an eager WRITE names at most kEagerMax bytes.
std::string RequestFault(uint8_t type, const Request &r) {
  std::string why = RequestFault(type, r.kind, r.flags);
  if (why.empty() && type == kWrite && (r.flags & kFlagEager) && SpanBytes(r) > kEagerMax)
    why = "an eager WRITE of more than " + std::to_string(kEagerMax) + " bytes";
  return why;
}

std::string LeaseKindFault(uint8_t kind) {
  if (kind != kCacheId && kind != kBlocksKey)
    return "a lease names a cache by id or BlocksCacheKey, not key kind " + std::to_string(kind);
  return "";
}

std::string NixlLeaseFault(uint8_t kind) {
  if (kind != kCacheId && kind != kBlocksKey)
    return "a NIXL lease names a cache id or a blocks key, not key kind " + std::to_string(kind);
  return "";
}

std::string NixlMemFault(uint64_t mem) {
  return mem == kMemDram || mem == kMemVram ? "" : "unknown NIXL memory kind " + std::to_string(mem);
}

std::string LeaseFlagsFault(uint32_t flags) {
  return flags & ~(kFlagShm | kLeaseWrite) ? "unknown lease flags " + std::to_string(flags) : "";
}

std::string CacheLeaseFault(uint64_t tensor_bytes, uint64_t units, uint64_t blocks, uint64_t n, uint64_t m) {
  if (blocks > 1 || (m != 0 && m != n) || n == 0 || units == 0 || tensor_bytes == 0 || tensor_bytes % units)
    return "malformed CACHE_LEASE";
  return "";
}

// ERROR's message as UTF-8: each maximal ill-formed part (Unicode 3.9, "U+FFFD substitution
// of maximal subparts") becomes U+FFFD, as Python's bytes.decode("utf-8", "replace") does, so
// that both implementations read a peer's bad text alike (docs/protocol.md, "Encodings").
std::string Utf8OrReplacement(const std::string &in) {
  static const char kReplacement[] = "\xEF\xBF\xBD";
  std::string out;
  out.reserve(in.size());
  const auto *p = reinterpret_cast<const uint8_t *>(in.data());
  const size_t n = in.size();
  size_t i = 0;
  while (i < n) {
    const uint8_t b = p[i];
    size_t need = 0;
    uint8_t lo = 0x80, hi = 0xBF;  // the range of the second byte; later ones are 80..BF
    if (b < 0x80) {
      out.push_back(static_cast<char>(b));
      ++i;
      continue;
    } else if (b >= 0xC2 && b <= 0xDF) {
      need = 1;
    } else if (b >= 0xE0 && b <= 0xEF) {
      need = 2;
      if (b == 0xE0) lo = 0xA0;
      if (b == 0xED) hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
      need = 3;
      if (b == 0xF0) lo = 0x90;
      if (b == 0xF4) hi = 0x8F;
    } else {
      out += kReplacement;  // 80..C1, F5..FF never start a character
      ++i;
      continue;
    }
    size_t j = 1;
    for (; j <= need && i + j < n; ++j) {
      const uint8_t c = p[i + j];
      if (c < (j == 1 ? lo : 0x80) || c > (j == 1 ? hi : 0xBF)) break;
    }
    if (j == need + 1) {
      out.append(in, i, j);
    } else {
      out += kReplacement;  // the lead and the continuation bytes that fitted
    }
    i += j;
  }
  return out;
}

void Refuse(const std::string &why) {
  if (!why.empty()) Fail(llm_datadist::LLM_FAILED, "cannot send: " + why);
}

void Reject(const std::string &why) {
  if (!why.empty()) ProtocolViolation(why);
}

}  // namespace

const char *TypeName(uint8_t type) { return kTypeNames[type]; }

std::vector<uint8_t> EncodeHello(uint8_t type, const Hello &h, uint32_t rid) {
  Writer w(type, rid);
  w.U64(h.cluster_id);
  w.U8(h.role);
  w.U32(h.pid);
  w.U64(h.pid_ns);
  w.Raw(h.boot_id.data(), h.boot_id.size());
  w.U32(h.features);
  w.Blob(h.proof);
  return w.Finish();
}

std::vector<uint8_t> EncodeError(const ErrorMsg &e, uint32_t rid) {
  Writer w(kError, rid);
  w.U64(static_cast<uint64_t>(e.code));
  w.Blob(e.message.substr(0, 4096));
  return w.Finish();
}

std::vector<uint8_t> EncodeRequest(uint8_t type, const Request &r, uint32_t rid) {
  if (r.offsets.size() != r.lengths.size()) Fail(llm_datadist::LLM_FAILED, "offsets and lengths differ");
  Refuse(RequestFault(type, r));
  Writer w(type, rid);
  // The exact size, once: a 100k-span request grew its buffer through every power of two.
  w.Reserve(1 + 5 * 8 + 3 * 4 + 4 * r.tensors.size() + 8 * (r.offsets.size() + r.lengths.size()));
  w.U8(r.kind);
  w.U64(r.a);
  w.U64(r.b);
  w.U64(r.c);
  w.U64(r.unit_bytes);
  w.U64(r.layout);
  w.U32(r.flags);
  w.U32(r.tensors.size());
  w.U32(r.offsets.size());
  for (uint32_t t : r.tensors) w.U32(t);
  for (uint64_t o : r.offsets) w.U64(o);
  for (uint64_t l : r.lengths) w.U64(l);
  return w.Finish();
}

std::vector<uint8_t> EncodeU64(uint8_t type, uint64_t value, uint32_t rid) {
  Writer w(type, rid);
  w.U64(value);
  return w.Finish();
}

std::vector<uint8_t> EncodeEmpty(uint8_t type, uint32_t rid) { return Writer(type, rid).Finish(); }

std::vector<uint8_t> EncodeChecksum(uint32_t crc, uint64_t nbytes, uint32_t rid) {
  Writer w(kChecksum, rid);
  w.U32(crc);
  w.U64(nbytes);
  return w.Finish();
}

std::vector<uint8_t> EncodeAuth(const std::string &proof, uint32_t rid) {
  Writer w(kAuth, rid);
  w.Blob(proof);
  return w.Finish();
}

std::vector<uint8_t> EncodeStats(const std::string &json, uint32_t rid) {
  Writer w(kStats, rid);
  w.U32(json.size());
  w.Raw(json.data(), json.size());
  return w.Finish();
}

std::vector<uint8_t> EncodeGrant(const Grant &g, uint32_t rid) {
  Writer w(kGrant, rid);
  w.U64(g.lease_id);
  w.U32(g.bases.size());
  for (uint64_t b : g.bases) w.U64(b);
  return w.Finish();
}

std::vector<uint8_t> EncodeShmGrant(const ShmGrant &g, uint32_t rid) {
  const size_t n = g.fds.size();
  if (g.inos.size() != n || g.offsets.size() != n) Fail(llm_datadist::LLM_FAILED, "SHM_GRANT arrays differ in length");
  Writer w(kShmGrant, rid);
  w.U64(g.lease_id);
  w.U32(n);
  for (int32_t fd : g.fds) w.U32(static_cast<uint32_t>(fd));
  for (uint64_t v : g.inos) w.U64(v);
  for (uint64_t v : g.offsets) w.U64(v);
  return w.Finish();
}

std::vector<uint8_t> EncodeRelease(const Release &r, uint32_t rid) {
  Writer w(kRelease, rid);
  w.U64(r.lease_id);
  w.U8(r.ok ? 1 : 0);
  return w.Finish();
}

std::vector<uint8_t> EncodeLeaseRequest(const LeaseRequest &r, uint32_t rid) {
  Refuse(LeaseKindFault(r.kind));
  Refuse(LeaseFlagsFault(r.flags));
  Writer w(kLeaseRequest, rid);
  w.U8(r.kind);
  w.U64(r.a);
  w.U64(r.b);
  w.U64(r.c);
  w.U32(r.flags);
  return w.Finish();
}

std::vector<uint8_t> EncodeCacheLease(const CacheLease &l, uint32_t rid) {
  const size_t m = l.shm_fds.size();
  if ((m && m != l.addrs.size()) || l.shm_inos.size() != m || l.shm_offsets.size() != m)
    Fail(llm_datadist::LLM_FAILED, "CACHE_LEASE arrays differ in length");
  Refuse(CacheLeaseFault(l.tensor_bytes, l.units, l.is_blocks ? 1 : 0, l.addrs.size(), m));
  Writer w(kCacheLease, rid);
  w.U64(l.cache_id);
  w.U64(l.tensor_bytes);
  w.U64(l.units);
  w.U8(l.is_blocks ? 1 : 0);
  w.U64(l.layout);
  w.U32(static_cast<uint32_t>(l.fence_fd));
  w.U64(l.fence_ino);
  w.U32(l.addrs.size());
  w.U32(m);
  for (uint64_t a : l.addrs) w.U64(a);
  for (int32_t fd : l.shm_fds) w.U32(static_cast<uint32_t>(fd));
  for (uint64_t v : l.shm_inos) w.U64(v);
  for (uint64_t v : l.shm_offsets) w.U64(v);
  return w.Finish();
}

std::vector<uint8_t> EncodeNixlMd(const NixlMd &m, uint32_t rid) {
  if (m.metadata.size() > kMaxPayload / 2) Fail(llm_datadist::LLM_FAILED, "NIXL metadata too large");
  Writer w(kNixlMd, rid);
  w.U64(m.generation);
  w.U32(m.metadata.size());
  w.Blob(m.agent);
  w.Raw(m.metadata.data(), m.metadata.size());
  return w.Finish();
}

std::vector<uint8_t> EncodeNixlGrant(const NixlGrant &g, uint32_t rid) {
  Refuse(NixlMemFault(g.mem));
  Writer w(kNixlGrant, rid);
  w.U64(g.lease_id);
  w.U64(g.generation);
  w.U8(g.mem);
  w.U32(g.device);
  w.U32(g.bases.size());
  w.Blob(g.agent);
  for (uint64_t b : g.bases) w.U64(b);
  return w.Finish();
}

std::vector<uint8_t> EncodeNixlLease(const NixlLease &l, uint32_t rid) {
  Refuse(NixlLeaseFault(l.kind));
  Writer w(kNixlLease, rid);
  w.U8(l.kind);
  w.U64(l.a);
  w.U64(l.b);
  w.U64(l.c);
  w.U64(l.unit_bytes);
  return w.Finish();
}

std::vector<uint8_t> EncodeNixlLeased(const NixlLeased &l, uint32_t rid) {
  Refuse(NixlMemFault(l.mem));
  Writer w(kNixlLeased, rid);
  w.U64(l.lease_id);
  w.U64(l.generation);
  w.U8(l.mem);
  w.U32(l.device);
  w.U8(l.blocks ? 1 : 0);
  w.U64(l.tensor_bytes);
  w.U64(l.unit_bytes);
  w.U64(l.units);
  w.U64(l.layout);
  w.U32(l.addrs.size());
  w.Blob(l.agent);
  for (uint64_t a : l.addrs) w.U64(a);
  return w.Finish();
}

NixlMd DecodeNixlMd(const std::vector<uint8_t> &payload) {
  Reader r(payload);
  NixlMd m;
  m.generation = r.Uint(8);
  const uint64_t n = r.Uint(4);
  m.agent = r.Blob();
  const uint8_t *b = r.Take(n);
  m.metadata.assign(reinterpret_cast<const char *>(b), n);
  r.Done();
  return m;
}

NixlGrant DecodeNixlGrant(const std::vector<uint8_t> &payload) {
  Reader r(payload);
  NixlGrant g;
  g.lease_id = r.Uint(8);
  g.generation = r.Uint(8);
  const uint64_t mem = r.Uint(1);
  g.device = static_cast<uint32_t>(r.Uint(4));
  const uint64_t count = r.Uint(4);
  Reject(NixlMemFault(mem));
  g.mem = static_cast<uint8_t>(mem);
  g.agent = r.Blob();
  g.bases = r.Array<uint64_t>(count);
  r.Done();
  return g;
}

NixlLease DecodeNixlLease(const std::vector<uint8_t> &payload) {
  Reader r(payload);
  NixlLease l;
  l.kind = static_cast<uint8_t>(r.Uint(1));
  l.a = r.Uint(8);
  l.b = r.Uint(8);
  l.c = r.Uint(8);
  Reject(NixlLeaseFault(l.kind));
  l.unit_bytes = r.Uint(8);
  r.Done();
  return l;
}

NixlLeased DecodeNixlLeased(const std::vector<uint8_t> &payload) {
  Reader r(payload);
  NixlLeased l;
  l.lease_id = r.Uint(8);
  l.generation = r.Uint(8);
  const uint64_t mem = r.Uint(1);
  l.device = static_cast<uint32_t>(r.Uint(4));
  const uint64_t blocks = r.Uint(1);
  l.tensor_bytes = r.Uint(8);
  l.unit_bytes = r.Uint(8);
  l.units = r.Uint(8);
  l.layout = r.Uint(8);
  const uint64_t count = r.Uint(4);
  Reject(NixlMemFault(mem));
  if (blocks > 1) ProtocolViolation("bad NIXL lease (blocks " + std::to_string(blocks) + ")");
  l.mem = static_cast<uint8_t>(mem);
  l.blocks = blocks == 1;
  l.agent = r.Blob();
  l.addrs = r.Array<uint64_t>(count);
  r.Done();
  return l;
}

LeaseRequest DecodeLeaseRequest(const std::vector<uint8_t> &payload) {
  Reader r(payload);
  LeaseRequest q;
  q.kind = static_cast<uint8_t>(r.Uint(1));
  Reject(LeaseKindFault(q.kind));
  q.a = r.Uint(8);
  q.b = r.Uint(8);
  q.c = r.Uint(8);
  q.flags = static_cast<uint32_t>(r.Uint(4));
  Reject(LeaseFlagsFault(q.flags));
  r.Done();
  return q;
}

CacheLease DecodeCacheLease(const std::vector<uint8_t> &payload) {
  Reader r(payload);
  CacheLease l;
  l.cache_id = r.Uint(8);
  l.tensor_bytes = r.Uint(8);
  l.units = r.Uint(8);
  const uint64_t blocks = r.Uint(1);
  l.is_blocks = blocks == 1;
  l.layout = r.Uint(8);
  l.fence_fd = static_cast<int32_t>(static_cast<uint32_t>(r.Uint(4)));
  l.fence_ino = r.Uint(8);
  const uint64_t n = r.Uint(4), m = r.Uint(4);
  Reject(CacheLeaseFault(l.tensor_bytes, l.units, blocks, n, m));
  l.addrs = r.Array<uint64_t>(n);
  std::vector<uint32_t> fds = r.Array<uint32_t>(m);
  for (uint32_t fd : fds) l.shm_fds.push_back(static_cast<int32_t>(fd));
  l.shm_inos = r.Array<uint64_t>(m);
  l.shm_offsets = r.Array<uint64_t>(m);
  r.Done();
  return l;
}

Grant DecodeGrant(const std::vector<uint8_t> &payload) {
  Reader r(payload);
  Grant g;
  g.lease_id = r.Uint(8);
  g.bases = r.Array<uint64_t>(r.Uint(4));
  r.Done();
  return g;
}

Release DecodeRelease(const std::vector<uint8_t> &payload) {
  Reader r(payload);
  Release rel;
  rel.lease_id = r.Uint(8);
  uint64_t ok = r.Uint(1);
  if (ok > 1) ProtocolViolation("bad release flag");
  rel.ok = ok == 1;
  r.Done();
  return rel;
}

std::string DecodeAuth(const std::vector<uint8_t> &payload) {
  Reader r(payload);
  std::string proof = r.Blob();
  r.Done();
  return proof;
}

std::string DecodeStats(const std::vector<uint8_t> &payload) {
  Reader r(payload);
  const uint64_t n = r.Uint(4);
  if (n > payload.size() - 4) ProtocolViolation("array count beyond the payload");
  const uint8_t *b = r.Take(n);
  r.Done();
  return std::string(reinterpret_cast<const char *>(b), n);
}

Header DecodeHeader(const uint8_t *d) {
  if (d[0] != 'D' || d[1] != 'D') ProtocolViolation("bad magic");
  if (d[2] != kVersion) ProtocolViolation("unsupported protocol version " + std::to_string(d[2]));
  Header h;
  h.type = d[3];
  if (TypeName(h.type) == nullptr) ProtocolViolation("unknown message type " + std::to_string(h.type));
  for (int i = 0; i < 4; ++i) h.request_id |= static_cast<uint32_t>(d[4 + i]) << (8 * i);
  for (int i = 0; i < 4; ++i) h.length |= static_cast<uint32_t>(d[8 + i]) << (8 * i);
  if (h.length > kMaxPayload) ProtocolViolation("frame exceeds 64 MiB");
  return h;
}

Hello DecodeHello(const std::vector<uint8_t> &payload) {
  Reader r(payload);
  Hello h;
  h.cluster_id = r.Uint(8);
  h.role = static_cast<uint8_t>(r.Uint(1));
  h.pid = static_cast<uint32_t>(r.Uint(4));
  h.pid_ns = r.Uint(8);
  std::memcpy(h.boot_id.data(), r.Take(16), 16);
  h.features = static_cast<uint32_t>(r.Uint(4));
  h.proof = r.Blob();
  r.Done();
  return h;
}

ErrorMsg DecodeError(const std::vector<uint8_t> &payload) {
  Reader r(payload);
  ErrorMsg e;
  e.code = static_cast<int64_t>(r.Uint(8));
  e.message = Utf8OrReplacement(r.Blob());
  r.Done();
  return e;
}

Request DecodeRequest(uint8_t type, const std::vector<uint8_t> &payload) {
  Reader r(payload);
  Request q;
  q.kind = static_cast<uint8_t>(r.Uint(1));
  if (q.kind < kCacheKey || q.kind > kAddress) Reject(RequestFault(type, q.kind, 0));  // before trusting counts
  q.a = r.Uint(8);
  q.b = r.Uint(8);
  q.c = r.Uint(8);
  q.unit_bytes = r.Uint(8);
  q.layout = r.Uint(8);
  q.flags = static_cast<uint32_t>(r.Uint(4));
  uint64_t ntensors = r.Uint(4);
  uint64_t nspans = r.Uint(4);
  q.tensors = r.Array<uint32_t>(ntensors);
  q.offsets = r.Array<uint64_t>(nspans);
  q.lengths = r.Array<uint64_t>(nspans);
  r.Done();
  Reject(RequestFault(type, q));
  return q;
}

uint64_t SpanBytes(const Request &r) {
  if (r.tensors.empty()) return 0;
  uint64_t sum = 0, total = 0;
  for (uint64_t l : r.lengths)
    if (__builtin_add_overflow(sum, l, &sum)) return UINT64_MAX;
  if (__builtin_mul_overflow(sum, static_cast<uint64_t>(r.tensors.size()), &total)) return UINT64_MAX;
  return total;
}

uint64_t DecodeU64(const std::vector<uint8_t> &payload) {
  Reader r(payload);
  uint64_t v = r.Uint(8);
  r.Done();
  return v;
}

void DecodeEmpty(const std::vector<uint8_t> &payload) { Reader(payload).Done(); }

Checksum DecodeChecksum(const std::vector<uint8_t> &payload) {
  Reader r(payload);
  Checksum c;
  c.crc = static_cast<uint32_t>(r.Uint(4));
  c.nbytes = r.Uint(8);
  r.Done();
  return c;
}

ShmGrant DecodeShmGrant(const std::vector<uint8_t> &payload) {
  Reader r(payload);
  ShmGrant g;
  g.lease_id = r.Uint(8);
  const uint64_t n = r.Uint(4);
  for (uint32_t fd : r.Array<uint32_t>(n)) g.fds.push_back(static_cast<int32_t>(fd));
  g.inos = r.Array<uint64_t>(n);
  g.offsets = r.Array<uint64_t>(n);
  r.Done();
  return g;
}

uint32_t Crc32(uint32_t crc, const void *data, size_t n) { return crc::Crc32(crc, data, n); }

uint64_t LayoutTag(int32_t dtype, const std::vector<int64_t> &unit_shape) {
  std::string text;
  for (size_t i = 0; i < unit_shape.size(); ++i) {
    if (i) text += ",";
    text += std::to_string(unit_shape[i]);
  }
  uint64_t hi = static_cast<uint32_t>(dtype + 1);
  return hi << 32 | Crc32(0, text.data(), text.size());
}

std::pair<std::string, std::string> SplitToken(const std::string &proof, uint32_t features) {
  if (!(features & kFeatureToken) || proof.size() < kLinkTokenBytes) return {proof, std::string()};
  const size_t rest = proof.size() - kLinkTokenBytes;
  return {proof.substr(0, rest), proof.substr(rest)};
}

}  // namespace wire
}  // namespace datadist
