// Internal errors: every failure inside the library is an Error carrying its status code; the
// facade (llm_datadist.cc) turns it into the returned Status in one place.
#ifndef DATADIST_CPP_ERRORS_H_
#define DATADIST_CPP_ERRORS_H_

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "llm_datadist/llm_datadist.h"

namespace datadist {

using llm_datadist::Status;

/// What an error is beyond its status code, where a caller must tell it from others with the
/// same code: a checksum mismatch is LLM_SUSPECT_REMOTE_ERROR, as a peer that broke the
/// protocol is, but the Python package raises IntegrityError for it (cpp/python/module.cc).
enum class ErrorKind : uint8_t { kGeneral = 0, kChecksumMismatch = 1 };

class Error : public std::runtime_error {
 public:
  Error(Status code, const std::string &msg, ErrorKind kind = ErrorKind::kGeneral)
      : std::runtime_error(msg), code_(code), kind_(kind) {}
  Status code() const { return code_; }
  ErrorKind kind() const { return kind_; }

 private:
  Status code_;
  ErrorKind kind_;
};

// Codes the header does not name but the wire may carry (Python's LLMStatusCode).
constexpr Status kEngineFinalized = 0x5010B006U;
constexpr Status kSuspectRemoteError = 507057U;
// LLM_DEVICE_MEM_ERROR (Python's Code.DEVICE_MEM_ERROR): memory registered for a cache is not
// mapped any more (server.cc, CheckOwnMemory).
constexpr Status kDeviceMemError = 507053U;

[[noreturn]] inline void Fail(Status code, const std::string &msg) { throw Error(code, msg); }
[[noreturn]] inline void Invalid(const std::string &msg) { throw Error(llm_datadist::LLM_PARAM_INVALID, msg); }
/// The peer broke the protocol: the caller closes the connection.
[[noreturn]] inline void ProtocolViolation(const std::string &msg) { throw Error(kSuspectRemoteError, msg); }

/// DATADIST_CPP_LOG=1: failed calls and path choices are told on stderr.
inline bool LogEnabled() {
  static const bool on = std::getenv("DATADIST_CPP_LOG") != nullptr;
  return on;
}
inline void Log(const std::string &line) {
  if (LogEnabled()) std::fprintf(stderr, "[datadist] %s\n", line.c_str());
}

}  // namespace datadist

#endif  // DATADIST_CPP_ERRORS_H_
