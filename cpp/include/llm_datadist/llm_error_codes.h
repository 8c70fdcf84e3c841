// datadist's llm_datadist/llm_error_codes.h: the ge::LLM_* status codes, under the names and
// with the values of CANN's header of the same path (GE error numbers of system 8, module 11:
// 0x5010B000 + n). llm_datadist/llm_datadist.h takes its llm_datadist::LLM_* codes from here,
// so the two names of a code are one constant. Written for datadist; not CANN's code.
#ifndef DATADIST_LLM_DATADIST_LLM_ERROR_CODES_H_
#define DATADIST_LLM_DATADIST_LLM_ERROR_CODES_H_

#include "external/ge_common/ge_api_error_codes.h"

// CANN's header defines this macro too (code may test it). Here it does not hide the codes:
// llm_datadist.h needs them whatever a program defined before including it.
#ifndef LLM_ERROR_CODES
#define LLM_ERROR_CODES
#endif

namespace ge {
constexpr Status LLM_WAIT_PROC_TIMEOUT = 0x5010B001U;
constexpr Status LLM_KV_CACHE_NOT_EXIST = 0x5010B002U;
constexpr Status LLM_REPEAT_REQUEST = 0x5010B003U;
constexpr Status LLM_REQUEST_ALREADY_COMPLETED = 0x5010B004U;
constexpr Status LLM_PARAM_INVALID = 0x5010B005U;
constexpr Status LLM_ENGINE_FINALIZED = 0x5010B006U;
constexpr Status LLM_NOT_YET_LINK = 0x5010B007U;
constexpr Status LLM_ALREADY_LINK = 0x5010B008U;
constexpr Status LLM_LINK_FAILED = 0x5010B009U;
constexpr Status LLM_UNLINK_FAILED = 0x5010B00AU;
constexpr Status LLM_NOTIFY_PROMPT_UNLINK_FAILED = 0x5010B00BU;
constexpr Status LLM_CLUSTER_NUM_EXCEED_LIMIT = 0x5010B00CU;
constexpr Status LLM_PROCESSING_LINK = 0x5010B00DU;
constexpr Status LLM_DEVICE_OUT_OF_MEMORY = 0x5010B00EU;
constexpr Status LLM_PREFIX_ALREADY_EXIST = 0x5010B00FU;
constexpr Status LLM_PREFIX_NOT_EXIST = 0x5010B010U;
constexpr Status LLM_SEQ_LEN_OVER_LIMIT = 0x5010B011U;
constexpr Status LLM_NO_FREE_BLOCK = 0x5010B012U;
constexpr Status LLM_BLOCKS_OUT_OF_MEMORY = 0x5010B013U;
constexpr Status LLM_CACHE_INCOMPATIBLE = 0x5010B014U;
constexpr Status LLM_CACHE_KEY_ALREADY_EXIST = 0x5010B015U;
constexpr Status LLM_COPY_CACHE_FAILED = 0x5010B016U;
constexpr Status LLM_CACHE_ID_ALREADY_EXIST = 0x5010B017U;
constexpr Status LLM_EXIST_LINK = 0x5010B018U;
constexpr Status LLM_FEATURE_NOT_ENABLED = 0x5010B019U;
constexpr Status LLM_TIMEOUT = 0x5010B01AU;
constexpr Status LLM_LINK_BUSY = 0x5010B01BU;
constexpr Status LLM_OUT_OF_MEMORY = 0x5010B01CU;
}  // namespace ge

#endif  // DATADIST_LLM_DATADIST_LLM_ERROR_CODES_H_
