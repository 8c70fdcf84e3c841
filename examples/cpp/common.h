// Shared by the two examples: the cache layout, the expected contents, and a one-byte
// "done" notification over a plain TCP socket (as CANN's samples do; a real service has its
// own way of telling the prompt a request is finished).
#ifndef DATADIST_EXAMPLES_CPP_COMMON_H_
#define DATADIST_EXAMPLES_CPP_COMMON_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>

#include "llm_datadist/llm_datadist.h"

namespace example {

constexpr uint64_t kPromptClusterId = 0;
constexpr uint64_t kDecoderClusterId = 1;
constexpr uint32_t kLayers = 2;
constexpr uint32_t kNumTensors = kLayers * 2;  // K and V of each layer
constexpr int64_t kBlocks = 8;                  // dim 0: blocks (or batch slots)
constexpr int64_t kBlockElems = 16;             // int32 per block
constexpr size_t kTensorBytes = kBlocks * kBlockElems * sizeof(int32_t);

/// What the prompt's source cache holds: every element distinct, per tensor.
inline int32_t Expected(uint32_t tensor, size_t index) { return static_cast<int32_t>(tensor * 100000 + index); }

inline llm_datadist::CacheDesc Desc() {
  llm_datadist::CacheDesc desc{};
  desc.placement = llm_datadist::CachePlacement::kHost;
  desc.num_tensors = kNumTensors;
  desc.data_type = llm_datadist::DT_INT32;
  desc.shape = {kBlocks, kBlockElems};
  return desc;
}

/// Checks every element of blocks `blocks` of every tensor; returns the mismatches.
inline int CheckBlocks(const std::vector<std::vector<int32_t>> &tensors, const std::vector<uint64_t> &blocks) {
  int bad = 0;
  for (uint32_t t = 0; t < tensors.size(); ++t)
    for (uint64_t b : blocks)
      for (int64_t i = 0; i < kBlockElems; ++i) {
        size_t at = b * kBlockElems + i;
        if (tensors[t][at] != Expected(t, at)) {
          if (bad++ < 5) std::printf("[ERROR] tensor %u element %zu: %d, expected %d\n", t, at, tensors[t][at], Expected(t, at));
        }
      }
  return bad;
}

inline int Notify(const char *ip, uint16_t port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  if (inet_pton(AF_INET, ip, &addr.sin_addr) != 1) return -1;
  for (int retry = 0; retry < 100; ++retry) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(fd, reinterpret_cast<sockaddr *>(&addr), sizeof(addr)) == 0) {
      char done = '1';
      ssize_t n = send(fd, &done, 1, MSG_NOSIGNAL);
      close(fd);
      return n == 1 ? 0 : -1;
    }
    close(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return -1;
}

/// Listens on `port` for the peer's notice (WaitNotified); -1 if the port cannot be had.
/// Taken before the data port is announced, so a port another process holds is found at once.
inline int ListenForNotice(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(port);
  if (bind(fd, reinterpret_cast<sockaddr *>(&addr), sizeof(addr)) != 0 || listen(fd, 1) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

/// Waits (up to timeout_s) for one connection on `fd` (ListenForNotice) and its byte; closes fd.
inline int WaitNotified(int fd, int timeout_s) {
  timeval tv{timeout_s, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  int c = accept(fd, nullptr, nullptr);
  close(fd);
  if (c < 0) return -1;
  setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char done = 0;
  ssize_t n = recv(c, &done, 1, 0);
  close(c);
  return n == 1 && done == '1' ? 0 : -1;
}

}  // namespace example

#endif  // DATADIST_EXAMPLES_CPP_COMMON_H_
