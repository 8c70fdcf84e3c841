// dd_wire_decode: one frame per line on stdin (hex), the C++ codec's account of it per line on
// stdout (wire_summary.h's Describe: the fields, "refuse header", "refuse payload",
// "incomplete" or "crash ..."). tests/protocol/test_wire_differential.py feeds it mutations of the
// protocol's golden frames and compares every line with Python's codec.
#include <iostream>
#include <string>

#include "wire_summary.h"

int main() {
  std::ios::sync_with_stdio(false);
  std::string line;
  while (std::getline(std::cin, line)) {
    datadist::wire_summary::Bytes frame;
    bool ok = line.size() % 2 == 0;
    for (size_t i = 0; ok && i < line.size(); i += 2) {
      const std::string byte = line.substr(i, 2);
      ok = byte.find_first_not_of("0123456789abcdef") == std::string::npos;
      if (ok) frame.push_back(static_cast<uint8_t>(std::stoul(byte, nullptr, 16)));
    }
    std::cout << (ok ? datadist::wire_summary::Describe(frame) : "bad input line") << '\n';
  }
  return 0;
}
