// libFuzzer target: the C++ frame decoder (wire.h), every Decode* behind a header.
//
// The input is one frame: a 12-byte header and its payload. The header's length field is set
// to the payload's true size before decoding (otherwise nearly every mutation would only be
// "incomplete"), so the fuzzer spends its time in the payload decoders. Each frame goes
// through wire_summary.h's Describe, as the protocol's golden frames and the differential
// test do. A finding is: a crash or sanitizer report; a decoder throwing anything but the
// protocol error (Describe's "crash ..."); or a frame that decodes, re-encodes and then reads
// back differently (the codec must round-trip what it accepts).
//
// Built with -DDATADIST_FUZZ=ON (clang); run by .ci/fuzz.sh. Seeds: tests/vectors/frames.txt
// (fuzz/seed_corpus.py), the kept corpus fuzz/corpus/wire/.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "wire_summary.h"

namespace ws = datadist::wire_summary;
namespace w = datadist::wire;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < w::kHeaderSize) {
    (void)ws::Describe(ws::Bytes(data, data + size));
    return 0;
  }
  ws::Bytes frame(data, data + size);
  const uint32_t n = static_cast<uint32_t>(size - w::kHeaderSize);
  for (int i = 0; i < 4; ++i) frame[8 + i] = static_cast<uint8_t>(n >> (8 * i));  // length, little-endian
  const std::string seen = ws::Describe(frame);
  if (seen.rfind("crash", 0) == 0) {
    std::fprintf(stderr, "decoder crash: %s\n", seen.c_str());
    std::abort();
  }
  if (seen == "refuse header" || seen == "refuse payload" || seen == "incomplete") return 0;
  // Accepted: encode what was decoded, and read that back.
  const w::Header h = w::DecodeHeader(frame.data());
  const auto codec = ws::Codecs().find(h.type);
  const ws::Bytes payload(frame.begin() + w::kHeaderSize, frame.end());
  if (!codec->second.reencode) return 0;  // a type this codec only decodes
  ws::Bytes again;
  const std::string how = ws::Outcome([&] { again = codec->second.reencode(payload, h.request_id); });
  if (!how.empty()) {
    std::fprintf(stderr, "re-encoding %s failed: %s\n", seen.c_str(), how.c_str());
    std::abort();
  }
  const std::string back = ws::Describe(again);
  if (back != seen) {
    std::fprintf(stderr, "round trip changed the frame:\n  %s\n  %s\n", seen.c_str(), back.c_str());
    std::abort();
  }
  return 0;
}
