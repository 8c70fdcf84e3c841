// The protocol codec: round trips, and a decoder that trusts nothing.
#include "wire.h"

#include <gtest/gtest.h>

#include <functional>

#include "errors.h"

namespace datadist {
namespace {

std::vector<uint8_t> Payload(const std::vector<uint8_t> &frame) {
  return std::vector<uint8_t>(frame.begin() + wire::kHeaderSize, frame.end());
}

TEST(Wire, HelloRoundTripAndHeader) {
  wire::Hello h;
  h.cluster_id = (uint64_t{0x7F000001} << 32) | 26000;  // xLLM-style 64-bit id
  h.role = 2;
  h.pid = 1234;
  h.proof = "abc";
  auto frame = wire::EncodeHello(wire::kHello, h, 77);
  ASSERT_EQ(frame.size(), wire::kHeaderSize + 8 + 1 + 4 + 8 + 16 + 4 + 2 + 3);
  wire::Header head = wire::DecodeHeader(frame.data());
  EXPECT_EQ(head.type, wire::kHello);
  EXPECT_EQ(head.request_id, 77U);
  EXPECT_EQ(head.length, frame.size() - wire::kHeaderSize);
  wire::Hello back = wire::DecodeHello(Payload(frame));
  EXPECT_EQ(back.cluster_id, h.cluster_id);
  EXPECT_EQ(back.role, 2);
  EXPECT_EQ(back.pid, 1234U);
  EXPECT_EQ(back.proof, "abc");
}

TEST(Wire, RequestRoundTrip) {
  wire::Request r;
  r.kind = wire::kCacheId;
  r.a = 1;
  r.b = 3;
  r.unit_bytes = 64;
  r.layout = 0x500000000ULL;
  r.tensors = {0, 5};
  r.offsets = {0, 128};
  r.lengths = {64, 64};
  auto frame = wire::EncodeRequest(wire::kRead, r, 2);
  wire::Request back = wire::DecodeRequest(wire::kRead, Payload(frame));
  EXPECT_EQ(back.a, 1U);
  EXPECT_EQ(back.b, 3U);
  EXPECT_EQ(back.layout, r.layout);
  EXPECT_EQ(back.tensors, r.tensors);
  EXPECT_EQ(back.offsets, r.offsets);
  EXPECT_EQ(back.lengths, r.lengths);
}

TEST(Wire, ARequestsBufferIsSizedOnceExactly) {
  // 100k spans over 3 tensors: grown push by push, the buffer passed through every power of two
  // and ended with up to twice the room it needs.
  wire::Request r;
  r.kind = wire::kBlocksKey;
  r.tensors = {0, 1, 2};
  for (uint64_t i = 0; i < 100000; ++i) {
    r.offsets.push_back(i * 128);
    r.lengths.push_back(64);
  }
  const auto frame = wire::EncodeRequest(wire::kRead, r, 9);
  EXPECT_EQ(frame.size(), wire::kHeaderSize + 1 + 5 * 8 + 3 * 4 + 3 * 4 + 100000 * 16);
  EXPECT_EQ(frame.capacity(), frame.size());
  EXPECT_EQ(wire::DecodeRequest(wire::kRead, Payload(frame)).offsets, r.offsets);
}

TEST(Wire, DecoderRefusesMalformedFrames) {
  auto frame = wire::EncodeEmpty(wire::kOk, 1);
  auto bad = frame;
  bad[0] = 'X';
  EXPECT_THROW(wire::DecodeHeader(bad.data()), Error);
  bad = frame;
  bad[2] = 2;  // another version
  EXPECT_THROW(wire::DecodeHeader(bad.data()), Error);
  bad = frame;
  bad[3] = 99;  // unknown type
  EXPECT_THROW(wire::DecodeHeader(bad.data()), Error);
  bad = frame;
  bad[11] = 0x10;  // 256 MiB payload
  EXPECT_THROW(wire::DecodeHeader(bad.data()), Error);

  wire::Request r;
  r.kind = wire::kCacheId;
  r.tensors = {0};
  r.offsets = {0};
  r.lengths = {8};
  auto p = Payload(wire::EncodeRequest(wire::kRead, r, 1));
  auto truncated = p;
  truncated.pop_back();
  EXPECT_THROW(wire::DecodeRequest(wire::kRead, truncated), Error);
  auto trailing = p;
  trailing.push_back(0);
  EXPECT_THROW(wire::DecodeRequest(wire::kRead, trailing), Error);
  auto huge_count = p;
  huge_count[1 + 24 + 8 + 8 + 4] = 0xFF;  // n_tensors far beyond the payload
  huge_count[1 + 24 + 8 + 8 + 4 + 3] = 0x7F;
  EXPECT_THROW(wire::DecodeRequest(wire::kRead, huge_count), Error);
  auto bad_kind = p;
  bad_kind[0] = 9;
  EXPECT_THROW(wire::DecodeRequest(wire::kRead, bad_kind), Error);
  // (patched by hand: the encoder refuses to say these)
  auto address = p;
  address[0] = wire::kAddress;  // raw addresses are for WRITE only
  EXPECT_THROW(wire::DecodeRequest(wire::kRead, address), Error);
  EXPECT_NO_THROW(wire::DecodeRequest(wire::kWrite, address));
  auto flagged = p;
  flagged[1 + 24 + 8 + 8] = 16;  // unknown read flag
  EXPECT_THROW(wire::DecodeRequest(wire::kRead, flagged), Error);
  flagged[1 + 24 + 8 + 8] = wire::kFlagChecksum;  // any flag on a WRITE
  EXPECT_NO_THROW(wire::DecodeRequest(wire::kRead, flagged));
  EXPECT_THROW(wire::DecodeRequest(wire::kWrite, flagged), Error);
}

// What the decoder refuses from a peer, the encoder refuses to say (one rule for both, as in
// Python's codec): a local error, where the peer would close the connection.
TEST(Wire, EncoderRefusesWhatTheDecoderRefuses) {
  wire::Request r;
  r.kind = wire::kCacheId;
  r.tensors = {0};
  r.offsets = {0};
  r.lengths = {8};
  auto refused = [](const std::function<void()> &f) {
    try {
      f();
    } catch (const Error &e) {
      return e.code() == llm_datadist::LLM_FAILED;
    }
    return false;
  };
  wire::Request bad = r;
  bad.kind = wire::kAddress;
  EXPECT_TRUE(refused([&] { wire::EncodeRequest(wire::kRead, bad, 1); }));
  EXPECT_FALSE(refused([&] { wire::EncodeRequest(wire::kWrite, bad, 1); }));
  bad.kind = 9;
  EXPECT_TRUE(refused([&] { wire::EncodeRequest(wire::kWrite, bad, 1); }));
  bad = r;
  bad.flags = 16;
  EXPECT_TRUE(refused([&] { wire::EncodeRequest(wire::kRead, bad, 1); }));
  bad.flags = wire::kFlagChecksum;
  EXPECT_FALSE(refused([&] { wire::EncodeRequest(wire::kRead, bad, 1); }));
  EXPECT_TRUE(refused([&] { wire::EncodeRequest(wire::kWrite, bad, 1); }));

  wire::LeaseRequest q;
  q.kind = wire::kCacheKey;
  EXPECT_TRUE(refused([&] { wire::EncodeLeaseRequest(q, 1); }));
  q.kind = wire::kCacheId;
  q.flags = wire::kFlagGrant;
  EXPECT_TRUE(refused([&] { wire::EncodeLeaseRequest(q, 1); }));
  q.flags = wire::kFlagShm | wire::kLeaseWrite;
  EXPECT_FALSE(refused([&] { wire::EncodeLeaseRequest(q, 1); }));

  wire::CacheLease l;
  l.tensor_bytes = 4096;
  l.units = 0;  // a geometry every later check would divide by
  l.addrs = {4096};
  EXPECT_TRUE(refused([&] { wire::EncodeCacheLease(l, 1); }));
  l.units = 2;
  EXPECT_FALSE(refused([&] { wire::EncodeCacheLease(l, 1); }));
}

// An ERROR's message is UTF-8 text (docs/protocol.md): a peer's ill-formed bytes are read as
// Python reads them (bytes.decode("utf-8", "replace")): each maximal ill-formed part is U+FFFD.
TEST(Wire, ErrorMessageIsReadAsUtf8LikePython) {
  const std::string r = "\xEF\xBF\xBD";
  const std::pair<std::string, std::string> cases[] = {
      {"caf\xC3\xA9 \xE2\x9C\x93", "caf\xC3\xA9 \xE2\x9C\x93"},  // well formed: unchanged
      {"caf\xA9", "caf" + r},                                    // a lone continuation byte
      {"a\xC3", "a" + r},                                        // cut short at the end
      {"\xE2\x9C"
       "b",
       r + "b"},                            // one U+FFFD for the part that fitted
      {"\xC0\xAF", r + r},                  // never a lead byte: one each
      {"\xED\xA0\x80", r + r + r},          // a surrogate: ED takes 80..9F only
      {"\xF4\x90\x80\x80", r + r + r + r},  // past U+10FFFF
      {"\xF0\x9F\x98\x80\xFF", "\xF0\x9F\x98\x80" + r},
  };
  for (const auto &c : cases) {
    wire::ErrorMsg e;
    e.code = -1;
    e.message = c.first;
    EXPECT_EQ(wire::DecodeError(Payload(wire::EncodeError(e, 1))).message, c.second);
  }
}

TEST(Wire, CacheLeaseFromALyingOwnerIsRefused) {
  wire::CacheLease l;
  l.cache_id = 1;
  l.tensor_bytes = 4096;
  l.units = 2;
  l.is_blocks = true;
  l.fence_fd = 3;
  l.addrs = {4096};
  EXPECT_EQ(wire::DecodeCacheLease(Payload(wire::EncodeCacheLease(l, 1))).tensor_bytes, 4096u);
  for (auto bad : {std::pair<uint64_t, uint64_t>{0, 2}, {4097, 2}, {4096, 0}}) {
    l.tensor_bytes = bad.first;  // no bytes at all: every later check would divide by nothing
    l.units = bad.second;
    EXPECT_THROW(wire::EncodeCacheLease(l, 1), Error);  // nor does the encoder say it
  }
}

TEST(Wire, Crc32AndLayoutTagMatchPython) {
  // zlib.crc32(b"123456789") == 0xCBF43926; layout_tag(4, [8, 4]) in Python:
  // (4 + 1) << 32 | zlib.crc32(b"8,4")
  EXPECT_EQ(wire::Crc32(0, "123456789", 9), 0xCBF43926U);
  EXPECT_EQ(wire::LayoutTag(4, {8, 4}), (uint64_t{5} << 32) | wire::Crc32(0, "8,4", 3));
  EXPECT_EQ(wire::LayoutTag(1, {}) >> 32, 2U);
}

}  // namespace
}  // namespace datadist

#include "auth.h"

namespace datadist {
namespace {

std::string Hex(const std::array<uint8_t, 32> &d) {
  static const char digits[] = "0123456789abcdef";
  std::string s;
  for (uint8_t b : d) {
    s.push_back(digits[b >> 4]);
    s.push_back(digits[b & 15]);
  }
  return s;
}

TEST(Auth, Sha256AndHmacMatchTheStandardVectors) {
  EXPECT_EQ(Hex(auth::Sha256("abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Hex(auth::Sha256("")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Hex(auth::Sha256(std::string(1000, 'a'))).substr(0, 16), "41edece42d63e8d9");
  // RFC 4231 test cases 2 and 6 (a key longer than the block)
  EXPECT_EQ(Hex(auth::HmacSha256("Jefe", "what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_EQ(Hex(auth::HmacSha256(std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First")),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

TEST(Auth, ProofsBindNoncesIdsAndDirection) {
  std::string cn = auth::Nonce(), sn = auth::Nonce();
  EXPECT_EQ(cn.size(), 16U);
  EXPECT_NE(cn, sn);
  std::string sp = auth::ServerProof("s3cret", cn, sn, 1, 2);
  ASSERT_EQ(sp.size(), 48U);
  EXPECT_EQ(sp.substr(0, 16), sn);
  std::string cp = auth::ClientProof("s3cret", cn, sn, 1, 2);
  EXPECT_NE(cp, sp.substr(16));  // direction labels: a server proof is no client proof
  EXPECT_NE(cp, auth::ClientProof("other", cn, sn, 1, 2));
  EXPECT_NE(cp, auth::ClientProof("s3cret", cn, sn, 1, 3));
  EXPECT_TRUE(auth::Same(cp, auth::ClientProof("s3cret", cn, sn, 1, 2)));
  EXPECT_FALSE(auth::Same(cp, cp.substr(1)));
}

}  // namespace
}  // namespace datadist
