// For the unit tests of the core's internals (they see cpp/src; test_util.h, which the C++
// API's tests and tools share, sees only cpp/include): the status code a call fails with.
#ifndef DATADIST_CPP_TESTS_CODE_OF_H_
#define DATADIST_CPP_TESTS_CODE_OF_H_

#include <functional>

#include "errors.h"
#include "llm_datadist/llm_datadist.h"

namespace ddtest {

/// The status code `fn` fails with (datadist::Error), or LLM_SUCCESS when it returns.
inline llm_datadist::Status CodeOf(const std::function<void()> &fn) {
  try {
    fn();
    return llm_datadist::LLM_SUCCESS;
  } catch (const datadist::Error &e) {
    return e.code();
  }
}

}  // namespace ddtest

#endif  // DATADIST_CPP_TESTS_CODE_OF_H_
