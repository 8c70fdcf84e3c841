// The C++ codec (src/wire.cc) against the protocol's golden frames: tests/vectors/frames.txt,
// made by tests/vectors/generate.py from docs/protocol.md's payload table written as data. The
// Python codec is tested against the same file (tests/protocol/test_wire_vectors.py).
//
// CMake passes the file's path (DATADIST_VECTORS_FILE); $DATADIST_VECTORS overrides it. For
// every vector: a frame to accept decodes to the expected fields (the generator's summary:
// "TYPE rid=N field=value ...", compared as a set of pairs) and re-encodes to the same bytes
// where this codec has an encoder for the type; a frame to refuse is refused with the protocol
// error (Error with kSuspectRemoteError), by DecodeHeader for "refuse header", else by the
// type's decoder. Types this codec does not speak (none: NIXL's are spoken since the core has
// the NIXL path) would be refused by DecodeHeader whatever their payload.
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
#include "wire_summary.h"

#ifndef DATADIST_VECTORS_FILE
#error "cpp/CMakeLists.txt defines DATADIST_VECTORS_FILE, the path of tests/vectors/frames.txt"
#endif

namespace datadist {
namespace {

using namespace wire_summary;  // NOLINT: the summary helpers are this test's vocabulary

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
  for (size_t i = 0; i + 1 < hex.size(); i += 2)
    out.push_back(static_cast<uint8_t>(std::stoul(hex.substr(i, 2), nullptr, 16)));
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
  EXPECT_EQ(not_spoken, 0);  // the codec speaks every type of docs/protocol.md, NIXL's too
  std::printf("vectors: %d decoded (%d re-encoded), %d refused, %d of types not spoken here\n", decoded, encoded,
              refused, not_spoken);
}

}  // namespace
}  // namespace datadist
