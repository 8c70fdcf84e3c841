// The C++ codec's account of one frame, in the form of the protocol's golden frames
// (tests/vectors/generate.py): the decoded fields as "name=value" text, or the refusal. Used
// by wire_vectors_test.cc (against tests/vectors/frames.txt) and by wire_decode.cc, the tool
// tests/protocol/test_wire_differential.py feeds mutated frames to, comparing with Python's codec.
#ifndef DATADIST_CPP_TESTS_WIRE_SUMMARY_H_
#define DATADIST_CPP_TESTS_WIRE_SUMMARY_H_

#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "errors.h"
#include "wire.h"

namespace datadist {
namespace wire_summary {

using Bytes = std::vector<uint8_t>;
using Fields = std::map<std::string, std::string>;

// ---- the summary of a decoded message, in the generator's value forms

inline std::string Hex(const uint8_t *p, size_t n) {
  static const char digits[] = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    s.push_back(digits[p[i] >> 4]);
    s.push_back(digits[p[i] & 15]);
  }
  return s;
}
inline std::string Hex(const std::string &b) { return Hex(reinterpret_cast<const uint8_t *>(b.data()), b.size()); }

template <typename T>
inline std::string List(const std::vector<T> &v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "]";
}

inline void PutKey(Fields &f, uint8_t kind, uint64_t a, uint64_t b, uint64_t c) {
  f["kind"] = std::to_string(kind);
  f["a"] = std::to_string(a);
  f["b"] = std::to_string(b);
  f["c"] = std::to_string(c);
}

inline Fields HelloFields(const wire::Hello &h) {
  return {{"cluster_id", std::to_string(h.cluster_id)},
          {"role", std::to_string(h.role)},
          {"pid", std::to_string(h.pid)},
          {"pid_ns", std::to_string(h.pid_ns)},
          {"boot_id", Hex(h.boot_id.data(), h.boot_id.size())},
          {"features", std::to_string(h.features)},
          {"proof", Hex(h.proof)}};
}

inline Fields RequestFields(const wire::Request &r) {
  Fields f{{"unit_bytes", std::to_string(r.unit_bytes)},
           {"layout", std::to_string(r.layout)},
           {"flags", std::to_string(r.flags)},
           {"tensors", List(r.tensors)},
           {"offsets", List(r.offsets)},
           {"lengths", List(r.lengths)}};
  PutKey(f, r.kind, r.a, r.b, r.c);
  return f;
}

/// How this codec decodes (to the summary's fields) and re-encodes one message type.
struct Codec {
  std::function<Fields(const Bytes &payload)> decode;
  /// Encodes what the payload decodes to; empty where this codec cannot encode the type.
  std::function<Bytes(const Bytes &payload, uint32_t rid)> reencode;
};

inline Codec U64Codec(uint8_t type, const char *field) {
  return {[field](const Bytes &p) {
            return Fields{{field, std::to_string(wire::DecodeU64(p))}};
          },
          [type](const Bytes &p, uint32_t rid) { return wire::EncodeU64(type, wire::DecodeU64(p), rid); }};
}

inline Codec EmptyCodec(uint8_t type) {
  return {[](const Bytes &p) {
            wire::DecodeEmpty(p);
            return Fields{};
          },
          [type](const Bytes &p, uint32_t rid) {
            wire::DecodeEmpty(p);
            return wire::EncodeEmpty(type, rid);
          }};
}

inline Codec HelloCodec(uint8_t type) {
  return {[](const Bytes &p) { return HelloFields(wire::DecodeHello(p)); },
          [type](const Bytes &p, uint32_t rid) { return wire::EncodeHello(type, wire::DecodeHello(p), rid); }};
}

inline Codec RequestCodec(uint8_t type) {
  return {
      [type](const Bytes &p) { return RequestFields(wire::DecodeRequest(type, p)); },
      [type](const Bytes &p, uint32_t rid) { return wire::EncodeRequest(type, wire::DecodeRequest(type, p), rid); }};
}

inline Fields NixlGrantFields(const wire::NixlGrant &g) {
  return {{"lease_id", std::to_string(g.lease_id)},     {"agent", Hex(g.agent)},
          {"generation", std::to_string(g.generation)}, {"mem", std::to_string(g.mem)},
          {"device", std::to_string(g.device)},         {"bases", List(g.bases)}};
}

inline Fields NixlLeasedFields(const wire::NixlLeased &l) {
  return {{"lease_id", std::to_string(l.lease_id)},
          {"agent", Hex(l.agent)},
          {"generation", std::to_string(l.generation)},
          {"mem", std::to_string(l.mem)},
          {"device", std::to_string(l.device)},
          {"blocks", l.blocks ? "1" : "0"},
          {"tensor_bytes", std::to_string(l.tensor_bytes)},
          {"unit_bytes", std::to_string(l.unit_bytes)},
          {"units", std::to_string(l.units)},
          {"layout", std::to_string(l.layout)},
          {"addrs", List(l.addrs)}};
}

/// Every type this codec speaks (docs/protocol.md's, NIXL's included).
inline const std::map<uint8_t, Codec> &Codecs() {
  static const std::map<uint8_t, Codec> codecs = {
      {wire::kHello, HelloCodec(wire::kHello)},
      {wire::kWelcome, HelloCodec(wire::kWelcome)},
      {wire::kError,
       {[](const Bytes &p) {
          wire::ErrorMsg e = wire::DecodeError(p);
          return Fields{{"code", std::to_string(e.code)}, {"message", Hex(e.message)}};
        },
        [](const Bytes &p, uint32_t rid) { return wire::EncodeError(wire::DecodeError(p), rid); }}},
      {wire::kRead, RequestCodec(wire::kRead)},
      {wire::kReadData, U64Codec(wire::kReadData, "nbytes")},
      {wire::kGrant,
       {[](const Bytes &p) {
          wire::Grant g = wire::DecodeGrant(p);
          return Fields{{"lease_id", std::to_string(g.lease_id)}, {"bases", List(g.bases)}};
        },
        [](const Bytes &p, uint32_t rid) { return wire::EncodeGrant(wire::DecodeGrant(p), rid); }}},
      {wire::kRelease,
       {[](const Bytes &p) {
          wire::Release r = wire::DecodeRelease(p);
          return Fields{{"lease_id", std::to_string(r.lease_id)}, {"ok", r.ok ? "1" : "0"}};
        },
        [](const Bytes &p, uint32_t rid) { return wire::EncodeRelease(wire::DecodeRelease(p), rid); }}},
      {wire::kPing, U64Codec(wire::kPing, "nonce")},
      {wire::kPong, U64Codec(wire::kPong, "nonce")},
      {wire::kBye, EmptyCodec(wire::kBye)},
      {wire::kWrite, RequestCodec(wire::kWrite)},
      {wire::kOk, EmptyCodec(wire::kOk)},
      {wire::kShmGrant,
       {[](const Bytes &p) {
          wire::ShmGrant g = wire::DecodeShmGrant(p);
          return Fields{{"lease_id", std::to_string(g.lease_id)},
                        {"fds", List(g.fds)},
                        {"inos", List(g.inos)},
                        {"offsets", List(g.offsets)}};
        },
        [](const Bytes &p, uint32_t rid) { return wire::EncodeShmGrant(wire::DecodeShmGrant(p), rid); }}},
      {wire::kAuth,
       {[](const Bytes &p) {
          return Fields{{"proof", Hex(wire::DecodeAuth(p))}};
        },
        [](const Bytes &p, uint32_t rid) { return wire::EncodeAuth(wire::DecodeAuth(p), rid); }}},
      {wire::kChecksum,
       {[](const Bytes &p) {
          wire::Checksum c = wire::DecodeChecksum(p);
          return Fields{{"crc", std::to_string(c.crc)}, {"nbytes", std::to_string(c.nbytes)}};
        },
        [](const Bytes &p, uint32_t rid) {
          wire::Checksum c = wire::DecodeChecksum(p);
          return wire::EncodeChecksum(c.crc, c.nbytes, rid);
        }}},
      {wire::kLeaseRequest,
       {[](const Bytes &p) {
          wire::LeaseRequest q = wire::DecodeLeaseRequest(p);
          Fields f{{"flags", std::to_string(q.flags)}};
          PutKey(f, q.kind, q.a, q.b, q.c);
          return f;
        },
        [](const Bytes &p, uint32_t rid) { return wire::EncodeLeaseRequest(wire::DecodeLeaseRequest(p), rid); }}},
      {wire::kCacheLease,
       {[](const Bytes &p) {
          wire::CacheLease l = wire::DecodeCacheLease(p);
          return Fields{{"cache_id", std::to_string(l.cache_id)},
                        {"tensor_bytes", std::to_string(l.tensor_bytes)},
                        {"units", std::to_string(l.units)},
                        {"is_blocks", l.is_blocks ? "1" : "0"},
                        {"layout", std::to_string(l.layout)},
                        {"fence_fd", std::to_string(l.fence_fd)},
                        {"fence_ino", std::to_string(l.fence_ino)},
                        {"addrs", List(l.addrs)},
                        {"shm_fds", List(l.shm_fds)},
                        {"shm_inos", List(l.shm_inos)},
                        {"shm_offsets", List(l.shm_offsets)}};
        },
        [](const Bytes &p, uint32_t rid) { return wire::EncodeCacheLease(wire::DecodeCacheLease(p), rid); }}},
      {wire::kStatsRequest, EmptyCodec(wire::kStatsRequest)},
      {wire::kNixlMdRequest, EmptyCodec(wire::kNixlMdRequest)},
      {wire::kNixlMd,
       {[](const Bytes &p) {
          wire::NixlMd m = wire::DecodeNixlMd(p);
          return Fields{
              {"agent", Hex(m.agent)}, {"generation", std::to_string(m.generation)}, {"metadata", Hex(m.metadata)}};
        },
        [](const Bytes &p, uint32_t rid) { return wire::EncodeNixlMd(wire::DecodeNixlMd(p), rid); }}},
      {wire::kNixlRead, RequestCodec(wire::kNixlRead)},
      {wire::kNixlWrite, RequestCodec(wire::kNixlWrite)},
      {wire::kNixlGrant,
       {[](const Bytes &p) { return NixlGrantFields(wire::DecodeNixlGrant(p)); },
        [](const Bytes &p, uint32_t rid) { return wire::EncodeNixlGrant(wire::DecodeNixlGrant(p), rid); }}},
      {wire::kNixlLease,
       {[](const Bytes &p) {
          wire::NixlLease l = wire::DecodeNixlLease(p);
          Fields f{{"unit_bytes", std::to_string(l.unit_bytes)}};
          PutKey(f, l.kind, l.a, l.b, l.c);
          return f;
        },
        [](const Bytes &p, uint32_t rid) { return wire::EncodeNixlLease(wire::DecodeNixlLease(p), rid); }}},
      {wire::kNixlLeased,
       {[](const Bytes &p) { return NixlLeasedFields(wire::DecodeNixlLeased(p)); },
        [](const Bytes &p, uint32_t rid) { return wire::EncodeNixlLeased(wire::DecodeNixlLeased(p), rid); }}},
      {wire::kNixlRevoke, U64Codec(wire::kNixlRevoke, "lease_id")},
      {wire::kStats,
       {[](const Bytes &p) {
          return Fields{{"json", Hex(wire::DecodeStats(p))}};
        },
        [](const Bytes &p, uint32_t rid) { return wire::EncodeStats(wire::DecodeStats(p), rid); }}},
  };
  return codecs;
}

/// The types of docs/protocol.md this codec does not speak, and must refuse at the header: none
/// since the core has the NIXL path (cpp/src/nixl.h).
inline const std::set<uint8_t> kNotSpoken = {};

/// "" if ``f`` returns; "protocol" if it throws the protocol error; else what it threw.
inline std::string Outcome(const std::function<void()> &f) {
  try {
    f();
  } catch (const Error &e) {
    if (e.code() == kSuspectRemoteError) return "protocol";
    return "Error " + std::to_string(e.code()) + ": " + e.what();
  } catch (const std::exception &e) {
    return std::string("std::exception: ") + e.what();
  } catch (...) {
    return "an unknown exception";
  }
  return "";
}

/// One whole frame (header and exactly its payload, else "incomplete") as this codec sees it:
/// "refuse header", "refuse payload", "TYPE name=value ..." (every field and rid, by name), or
/// "crash <what>" for anything but the protocol error.
inline std::string Describe(const Bytes &frame) {
  if (frame.size() < wire::kHeaderSize) return "incomplete";
  wire::Header h;
  std::string head = Outcome([&] { h = wire::DecodeHeader(frame.data()); });
  if (head == "protocol") return "refuse header";
  if (!head.empty()) return "crash " + head;
  if (h.length != frame.size() - wire::kHeaderSize) return "incomplete";
  auto codec = Codecs().find(h.type);
  if (codec == Codecs().end()) return "crash type " + std::to_string(h.type) + " passed the header, no decoder";
  const Bytes payload(frame.begin() + wire::kHeaderSize, frame.end());
  Fields f;
  std::string body = Outcome([&] { f = codec->second.decode(payload); });
  if (body == "protocol") return "refuse payload";
  if (!body.empty()) return "crash " + body;
  f["rid"] = std::to_string(h.request_id);
  std::string out = wire::TypeName(h.type);
  for (const auto &kv : f) out += " " + kv.first + "=" + kv.second;
  return out;
}

}  // namespace wire_summary
}  // namespace datadist

#endif  // DATADIST_CPP_TESTS_WIRE_SUMMARY_H_
