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

std::vector<uint8_t> Frame(const std::vector<iovec> &src, uint32_t rid) {
  return wire::EncodeChecksum(crc::Crc32Iov(src), Bytes(src), rid);
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
