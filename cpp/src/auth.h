// Shared-secret mutual authentication of a link (docs/protocol.md, "Authentication"): the
// same challenge and response as the protocol's reference, src/datadist/wire/auth.py: HMAC-SHA256 over both nonces and
// both cluster ids with direction labels. Pure functions; Nonce() reads the kernel's randomness.
#ifndef DATADIST_CPP_AUTH_H_
#define DATADIST_CPP_AUTH_H_

#include <array>
#include <cstdint>
#include <string>

namespace datadist {
namespace auth {

constexpr size_t kNonceBytes = 16;
constexpr size_t kMacBytes = 32;
constexpr uint32_t kFeatureAuth = 1;

std::array<uint8_t, 32> Sha256(const std::string &data);
std::array<uint8_t, 32> HmacSha256(const std::string &key, const std::string &msg);
/// 16 fresh random bytes (getrandom); throws LLM_FAILED if the kernel has none.
std::string Nonce();
/// What the server puts in WELCOME.proof: its nonce, then its MAC.
std::string ServerProof(const std::string &secret, const std::string &client_nonce, const std::string &server_nonce,
                        uint64_t server_id, uint64_t client_id);
/// What the client sends in AUTH.
std::string ClientProof(const std::string &secret, const std::string &client_nonce, const std::string &server_nonce,
                        uint64_t server_id, uint64_t client_id);
/// Constant-time comparison.
bool Same(const std::string &a, const std::string &b);

}  // namespace auth
}  // namespace datadist

#endif  // DATADIST_CPP_AUTH_H_
