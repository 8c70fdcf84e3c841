#include "verify.h"

#include <cstdio>

#include "crc32.h"
#include "errors.h"

namespace datadist {
namespace verify {
namespace {

uint64_t Bytes(const std::vector<iovec> &iov) {
  uint64_t n = 0;
  for (const iovec &v : iov) n += v.iov_len;
  return n;
}

std::string Hex(uint32_t crc) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", crc);
  return buf;
}

}  // namespace

namespace {

/// The CRC of `src`, read fault-safely; a hole throws LLM_DEVICE_MEM_ERROR with `what(bad)`.
template <typename Name>
uint32_t OwnCrc(const std::vector<iovec> &src, Name &&what) {
  const crc::OwnRead r = crc::Crc32Own(src);
  if (r.ok) return r.crc;
  if (r.refused != nullptr) throw Error(llm_datadist::LLM_FAILED, std::string("cannot checksum: ") + r.refused);
  throw Error(kDeviceMemError, what(r.bad));
}

std::string Address(uintptr_t a) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%#llx", static_cast<unsigned long long>(a));
  return buf;
}

}  // namespace

std::vector<uint8_t> Frame(const std::vector<iovec> &src, uint32_t rid, const std::string &what) {
  const uint32_t crc = OwnCrc(src, [&](uintptr_t bad) {
    return "the owner's " + what + " at " + Address(bad) +
           " is not mapped any more (freed after it was registered): "
           "no checksum";
  });
  return wire::EncodeChecksum(crc, Bytes(src), rid);
}

namespace {

/// Frame's and Continue's error for a byte of `lease` that cannot be read (told on stderr too).
std::string Hole(const Lease &lease, uintptr_t bad) {
  const Entry &e = lease.entry();
  std::string tensor;
  for (size_t t = 0; t < e.addrs.size(); ++t)
    if (bad >= e.addrs[t] && bad - e.addrs[t] < e.geo.tensor_bytes) {
      tensor = " tensor " + std::to_string(t);
      break;
    }
  // Always told (a bug of the caller's, who may never see the peer's error), as CheckOwnMemory does.
  std::fprintf(stderr,
               "[datadist] error: cache %lld%s: its memory at %s is not mapped any more (freed after it was "
               "registered?); a peer's checksummed read of it is refused\n",
               static_cast<long long>(e.id), tensor.c_str(), Address(bad).c_str());
  return "the owner's memory of cache " + std::to_string(e.id) + tensor + " at " + Address(bad) +
         " is not mapped any more (freed after it was registered): no checksum";
}

}  // namespace

uint32_t Continue(const Lease &lease, const std::vector<iovec> &part, uint32_t crc) {
  const crc::OwnRead r = crc::Crc32Own(part, crc);
  if (r.ok) return r.crc;
  if (r.refused != nullptr) throw Error(llm_datadist::LLM_FAILED, std::string("cannot checksum: ") + r.refused);
  throw Error(kDeviceMemError, Hole(lease, r.bad));
}

std::vector<uint8_t> Frame(const Lease &lease, uint32_t rid) {
  const uint32_t crc = OwnCrc(lease.iov, [&](uintptr_t bad) { return Hole(lease, bad); });
  return wire::EncodeChecksum(crc, Bytes(lease.iov), rid);
}

wire::Checksum Expect(const wire::Header &h, const std::vector<uint8_t> &payload) {
  if (h.type != wire::kChecksum) ProtocolViolation("expected CHECKSUM after a read that asked for it");
  return wire::DecodeChecksum(payload);
}

std::string Compare(const wire::Checksum &owner, const std::vector<iovec> &local) {
  const uint32_t got = crc::Crc32Iov(local);
  const uint64_t n = Bytes(local);
  if (got == owner.crc && n == owner.nbytes) return std::string();
  // Python's IntegrityError text, word for word.
  return std::string(kMismatch) + ": the owner sent crc " + Hex(owner.crc) + " over " + std::to_string(owner.nbytes) +
         " bytes, " + Hex(got) + " over " + std::to_string(n) +
         " bytes arrived (the source changed during the transfer, or the bytes were corrupted)";
}

void Mismatch(const std::string &why) { throw Error(kSuspectRemoteError, why, ErrorKind::kChecksumMismatch); }

void Pending::Await(uint32_t rid, std::unique_ptr<Lease> lease) {
  lease->Unpin();
  rid_ = rid;
  lease_ = std::move(lease);
}

bool Pending::Settle(const wire::Header &h, const std::vector<uint8_t> &payload) {
  if (!lease_) return false;
  std::unique_ptr<Lease> lease = std::move(lease_);  // settled either way (failed if this throws)
  if (h.type != wire::kRelease || h.request_id != rid_) {
    lease->Settle(false);
    return false;
  }
  const wire::Release rel = wire::DecodeRelease(payload);
  if (rel.lease_id != 0) {
    lease->Settle(false);
    return false;
  }
  lease->Settle(rel.ok);
  return true;
}

}  // namespace verify
}  // namespace datadist
