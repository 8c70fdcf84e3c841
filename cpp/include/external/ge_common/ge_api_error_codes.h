// datadist's compatible definitions of the GE types that llm_datadist/llm_datadist.h uses:
// ge::Status (a uint32_t, printed with %u), ge::AscendString (built from const char*, usable as
// a std::map key) and ge::DataType with GE's DT_* values. Written for datadist; not CANN's code.
#ifndef DATADIST_EXTERNAL_GE_COMMON_GE_API_ERROR_CODES_H_
#define DATADIST_EXTERNAL_GE_COMMON_GE_API_ERROR_CODES_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace ge {

using Status = uint32_t;
constexpr Status SUCCESS = 0U;
constexpr Status FAILED = 0xFFFFFFFFU;

/// A string value type: the keys and values of llm_datadist's option maps.
class AscendString {
 public:
  AscendString() = default;
  AscendString(const char *name) : value_(name == nullptr ? "" : name) {}  // NOLINT: implicit, as GE's
  AscendString(const char *name, size_t length) : value_(name == nullptr ? "" : std::string(name, length)) {}

  const char *GetString() const { return value_.c_str(); }
  size_t GetLength() const { return value_.size(); }

  bool operator<(const AscendString &o) const { return value_ < o.value_; }
  bool operator>(const AscendString &o) const { return value_ > o.value_; }
  bool operator<=(const AscendString &o) const { return value_ <= o.value_; }
  bool operator>=(const AscendString &o) const { return value_ >= o.value_; }
  bool operator==(const AscendString &o) const { return value_ == o.value_; }
  bool operator!=(const AscendString &o) const { return value_ != o.value_; }

 private:
  std::string value_;
};

/// Element types, with GE's numeric values (datadist's Python DataType uses the same).
enum DataType {
  DT_FLOAT = 0,
  DT_FLOAT16 = 1,
  DT_INT8 = 2,
  DT_INT32 = 3,
  DT_UINT8 = 4,
  DT_INT16 = 6,
  DT_UINT16 = 7,
  DT_UINT32 = 8,
  DT_INT64 = 9,
  DT_UINT64 = 10,
  DT_DOUBLE = 11,
  DT_BOOL = 12,
  DT_STRING = 13,
  DT_DUAL_SUB_INT8 = 14,
  DT_DUAL_SUB_UINT8 = 15,
  DT_COMPLEX64 = 16,
  DT_COMPLEX128 = 17,
  DT_QINT8 = 18,
  DT_QINT16 = 19,
  DT_QINT32 = 20,
  DT_QUINT8 = 21,
  DT_QUINT16 = 22,
  DT_RESOURCE = 23,
  DT_STRING_REF = 24,
  DT_DUAL = 25,
  DT_VARIANT = 26,
  DT_BF16 = 27,
  DT_UNDEFINED = 28,
  DT_INT4 = 29,
  DT_UINT1 = 30,
  DT_INT2 = 31,
  DT_UINT2 = 32,
  DT_COMPLEX32 = 33,
  DT_HIFLOAT8 = 34,
  DT_FLOAT8_E5M2 = 35,
  DT_FLOAT8_E4M3FN = 36,
  DT_FLOAT8_E8M0 = 37,
  DT_FLOAT6_E3M2 = 38,
  DT_FLOAT6_E2M3 = 39,
  DT_FLOAT4_E2M1 = 40,
  DT_FLOAT4_E1M2 = 41,
  DT_MAX
};

}  // namespace ge

#endif  // DATADIST_EXTERNAL_GE_COMMON_GE_API_ERROR_CODES_H_
