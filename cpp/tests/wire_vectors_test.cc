// The C++ codec (src/wire.cc) against the protocol's golden frames: tests/vectors/frames.txt,
// made by tests/vectors/generate.py from docs/protocol.md's payload table written as data. The
// Python codec is tested against the same file (tests/unit/test_wire_vectors.py).
//
// CMake passes the file's path (DATADIST_VECTORS_FILE); $DATADIST_VECTORS overrides it. For
// every vector: a frame to accept decodes to the expected fields (the generator's summary:
// "TYPE rid=N field=value ...", compared as a set of pairs) and re-encodes to the same bytes
// where this codec has an encoder for the type; a frame to refuse is refused with the protocol
// error (Error with kSuspectRemoteError), by DecodeHeader for "refuse header", else by the
// type's decoder. Types this codec does not speak (NIXL and STATS) are refused by DecodeHeader
// whatever their payload, as docs/protocol.md asks of a version-1 peer without them.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "errors.h"
#include "wire.h"

#ifndef DATADIST_VECTORS_FILE
#error "cpp/CMakeLists.txt defines DATADIST_VECTORS_FILE, the path of tests/vectors/frames.txt"
#endif

namespace datadist {
namespace {

using Bytes = std::vector<uint8_t>;
using Fields = std::map<std::string, std::string>;

struct Vector {
  std::string name;
  Bytes frame;
  std::string expect;  // a summary, or "refuse header ..." / "refuse payload ..."
};

std::string VectorsPath() {
  const char *env = std::getenv("DATADIST_VECTORS");
  return env != nullptr && *env ? env : DATADIST_VECTORS_FILE;
}

Bytes Unhex(const std::string &hex) {
  Bytes out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(static_cast<uint8_t>(std::stoul(hex.substr(i, 2), nullptr, 16)));
  return out;
}

std::vector<Vector> Load() {
  std::ifstream in(VectorsPath());
  std::vector<Vector> out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t a = line.find('\t'), b = line.find('\t', a + 1);
    if (a == std::string::npos || b == std::string::npos) {
      ADD_FAILURE() << "bad line in " << VectorsPath() << ": " << line;
      continue;
    }
    out.push_back({line.substr(0, a), Unhex(line.substr(a + 1, b - a - 1)), line.substr(b + 1)});
  }
  return out;
}

const std::vector<Vector> &Vectors() {
  static const std::vector<Vector> v = Load();
  return v;
}

/// "TYPE rid=1 a=2" -> {"type": "TYPE", "rid": "1", "a": "2"}
Fields ParseSummary(const std::string &s) {
  std::istringstream in(s);
  Fields f;
  std::string word;
  in >> word;
  f["type"] = word;
  while (in >> word) {
    const size_t eq = word.find('=');
    f[word.substr(0, eq)] = eq == std::string::npos ? "?" : word.substr(eq + 1);
  }
  return f;
}

// ---- the summary of a decoded message, in the generator's value forms

std::string Hex(const uint8_t *p, size_t n) {
  static const char digits[] = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    s.push_back(digits[p[i] >> 4]);
    s.push_back(digits[p[i] & 15]);
  }
  return s;
}
std::string Hex(const std::string &b) { return Hex(reinterpret_cast<const uint8_t *>(b.data()), b.size()); }

template <typename T>
std::string List(const std::vector<T> &v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "]";
}

void PutKey(Fields &f, uint8_t kind, uint64_t a, uint64_t b, uint64_t c) {
  f["kind"] = std::to_string(kind);
  f["a"] = std::to_string(a);
  f["b"] = std::to_string(b);
  f["c"] = std::to_string(c);
}

Fields HelloFields(const wire::Hello &h) {
  return {{"cluster_id", std::to_string(h.cluster_id)}, {"role", std::to_string(h.role)},
          {"pid", std::to_string(h.pid)},               {"pid_ns", std::to_string(h.pid_ns)},
          {"boot_id", Hex(h.boot_id.data(), h.boot_id.size())},
          {"features", std::to_string(h.features)},     {"proof", Hex(h.proof)}};
}

Fields RequestFields(const wire::Request &r) {
  Fields f{{"unit_bytes", std::to_string(r.unit_bytes)}, {"layout", std::to_string(r.layout)},
           {"flags", std::to_string(r.flags)},           {"tensors", List(r.tensors)},
           {"offsets", List(r.offsets)},                 {"lengths", List(r.lengths)}};
  PutKey(f, r.kind, r.a, r.b, r.c);
  return f;
}

/// How this codec decodes (to the summary's fields) and re-encodes one message type.
struct Codec {
  std::function<Fields(const Bytes &payload)> decode;
  /// Encodes what the payload decodes to; empty where this codec cannot encode the type.
  std::function<Bytes(const Bytes &payload, uint32_t rid)> reencode;
};

Codec U64Codec(uint8_t type, const char *field) {
  return {[field](const Bytes &p) { return Fields{{field, std::to_string(wire::DecodeU64(p))}}; },
          [type](const Bytes &p, uint32_t rid) { return wire::EncodeU64(type, wire::DecodeU64(p), rid); }};
}

Codec EmptyCodec(uint8_t type) {
  return {[](const Bytes &p) {
            wire::DecodeEmpty(p);
            return Fields{};
          },
          [type](const Bytes &p, uint32_t rid) {
            wire::DecodeEmpty(p);
            return wire::EncodeEmpty(type, rid);
          }};
}

Codec HelloCodec(uint8_t type) {
  return {[](const Bytes &p) { return HelloFields(wire::DecodeHello(p)); },
          [type](const Bytes &p, uint32_t rid) { return wire::EncodeHello(type, wire::DecodeHello(p), rid); }};
}

Codec RequestCodec(uint8_t type) {
  return {[type](const Bytes &p) { return RequestFields(wire::DecodeRequest(type, p)); },
          [type](const Bytes &p, uint32_t rid) { return wire::EncodeRequest(type, wire::DecodeRequest(type, p), rid); }};
}

/// Every type this codec speaks. Types 16 to 22 and 30 to 32 (NIXL, STATS) are missing on
/// purpose: the C++ core has no NIXL path and serves no metrics (docs/protocol.md's opening).
const std::map<uint8_t, Codec> &Codecs() {
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
      {wire::kShmGrant,  // decoded only: this library never grants shared memory
       {[](const Bytes &p) {
          wire::ShmGrant g = wire::DecodeShmGrant(p);
          return Fields{{"lease_id", std::to_string(g.lease_id)},
                        {"fds", List(g.fds)},
                        {"inos", List(g.inos)},
                        {"offsets", List(g.offsets)}};
        },
        nullptr}},
      {wire::kAuth,
       {[](const Bytes &p) { return Fields{{"proof", Hex(wire::DecodeAuth(p))}}; },
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
  };
  return codecs;
}

/// The types of docs/protocol.md this codec does not speak, and must refuse at the header.
const std::set<uint8_t> kNotSpoken = {16, 17, 18, 19, 20, 21, 22, 30, 31, 32};

/// "" if ``f`` returns; "protocol" if it throws the protocol error; else what it threw.
std::string Outcome(const std::function<void()> &f) {
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

TEST(WireVectors, FileHasEveryTypeOfTheCodecAndNoOtherUnlessNotSpoken) {
  ASSERT_GT(Vectors().size(), 100U) << "no vectors read from " << VectorsPath();
  std::set<uint8_t> valid_types;
  for (const Vector &v : Vectors())
    if (v.expect.rfind("refuse ", 0) != 0) valid_types.insert(v.frame.at(3));
  for (const auto &entry : Codecs()) EXPECT_TRUE(valid_types.count(entry.first)) << int(entry.first);
  for (uint8_t t : valid_types)  // a new message type is decided here: decode it, or say why not
    EXPECT_TRUE(Codecs().count(t) || kNotSpoken.count(t)) << "type " << int(t) << " has vectors";
}

TEST(WireVectors, HeaderAcceptsExactlyTheTypesTheCodecDecodes) {
  for (int t = 0; t < 256; ++t) {
    Bytes head = {'D', 'D', wire::kVersion, static_cast<uint8_t>(t), 0, 0, 0, 0, 0, 0, 0, 0};
    const bool spoken = Codecs().count(static_cast<uint8_t>(t)) != 0;
    EXPECT_EQ(Outcome([&] { wire::DecodeHeader(head.data()); }), spoken ? "" : "protocol") << "type " << t;
    EXPECT_EQ(wire::TypeName(static_cast<uint8_t>(t)) != nullptr, spoken) << "type " << t;
  }
}

TEST(WireVectors, EveryFrameDecodesRefusesAndEncodesAsTheVectorSays) {
  int decoded = 0, refused = 0, not_spoken = 0, encoded = 0;
  for (const Vector &v : Vectors()) {
    SCOPED_TRACE(v.name);
    ASSERT_GE(v.frame.size(), wire::kHeaderSize);
    const uint8_t type = v.frame[3];
    const bool refuse_header = v.expect.rfind("refuse header", 0) == 0;
    const bool refuse_payload = v.expect.rfind("refuse payload", 0) == 0;
    wire::Header h;
    const std::string head = Outcome([&] { h = wire::DecodeHeader(v.frame.data()); });
    if (refuse_header || (kNotSpoken.count(type) && !Codecs().count(type))) {
      EXPECT_EQ(head, "protocol") << "the header must be refused";
      (refuse_header ? refused : not_spoken) += 1;
      continue;
    }
    ASSERT_EQ(head, "");
    ASSERT_EQ(h.length, v.frame.size() - wire::kHeaderSize);
    ASSERT_TRUE(Codecs().count(type)) << "type " << int(type) << " accepted by DecodeHeader, not decoded";
    const Codec &codec = Codecs().at(type);
    const Bytes payload(v.frame.begin() + wire::kHeaderSize, v.frame.end());
    Fields got;
    const std::string outcome = Outcome([&] { got = codec.decode(payload); });
    if (refuse_payload) {
      EXPECT_EQ(outcome, "protocol") << "the payload must be refused (" << v.expect << ")";
      ++refused;
      continue;
    }
    ASSERT_EQ(outcome, "") << "the payload must decode";
    got["type"] = wire::TypeName(type);
    got["rid"] = std::to_string(h.request_id);
    EXPECT_EQ(got, ParseSummary(v.expect));
    ++decoded;
    if (codec.reencode) {
      const Bytes again = codec.reencode(payload, h.request_id);
      EXPECT_EQ(Hex(again.data(), again.size()), Hex(v.frame.data(), v.frame.size()));
      ++encoded;
    }
  }
  EXPECT_GT(decoded, 0);
  EXPECT_GT(refused, 0);
  EXPECT_GT(not_spoken, 0);
  std::printf("vectors: %d decoded (%d re-encoded), %d refused, %d of types not spoken here (NIXL, STATS)\n",
              decoded, encoded, refused, not_spoken);
}

}  // namespace
}  // namespace datadist
