// Port of CANN's examples/cpp/prompt_pull_cache_and_blocks.cpp (hicann/hixl) to datadist: the
// prompt registers 4 int32 tensors of shape {8, 16} holding 0, 1, 2, ..., listens, and keeps
// them registered until the decoder says (over a control socket) that it has pulled and
// unlinked. Same API calls, options, order and checks as the original; acl calls go to
// acl_host_shim.h, ports come from the environment.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <numeric>
#include <string>
#include <vector>

#include "acl_host_shim.h"
#include "llm_datadist/llm_datadist.h"

using namespace llm_datadist;

namespace {
const uint16_t kPromptListenPort = PortFromEnv("DD_PROMPT_PORT", 26000);
const uint16_t kPromptControlPort = PortFromEnv("DD_PROMPT_CONTROL_PORT", 26002);
constexpr uint16_t kPromptClusterId = 0;
constexpr uint32_t kNumTensors = 4U;
constexpr size_t kTensorSize = 8 * 16 * sizeof(int32_t);
const std::vector<int64_t> kTensorShape = {8, 16};
constexpr int kControlTimeoutSec = 60;
constexpr char kUnlinkDone = '1';

#define CHECK_ACL(expr)                                                              \
  do {                                                                               \
    aclError acl_ret_ = (expr);                                                      \
    if (acl_ret_ != ACL_ERROR_NONE) {                                                \
      std::cerr << __FILE__ << ":" << __LINE__ << " aclError:" << acl_ret_ << "\n"; \
    }                                                                                \
  } while (0)

const char *RecentErr() {
  const char *msg = aclGetRecentErrMsg();
  return msg == nullptr ? "no error" : msg;
}

// Listens on ip:port, waits up to kControlTimeoutSec for the decoder's one-byte "unlinked".
int WaitUnlinkDone(const char *ip) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  int one = 1;
  (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(kPromptControlPort);
  if (inet_pton(AF_INET, ip, &addr.sin_addr) != 1 || bind(fd, reinterpret_cast<sockaddr *>(&addr), sizeof(addr)) != 0 ||
      listen(fd, 1) != 0) {
    printf("[ERROR] control socket on %s:%u failed\n", ip, static_cast<unsigned>(kPromptControlPort));
    close(fd);
    return -1;
  }
  printf("[INFO] control listening\n");
  fflush(stdout);
  fd_set fds;
  FD_ZERO(&fds);
  FD_SET(fd, &fds);
  timeval tv{};
  tv.tv_sec = kControlTimeoutSec;
  if (select(fd + 1, &fds, nullptr, nullptr, &tv) <= 0) {
    printf("[ERROR] Wait decoder unlink done timeout or failed\n");
    close(fd);
    return -1;
  }
  int conn = accept(fd, nullptr, nullptr);
  char msg = 0;
  ssize_t got = conn >= 0 ? recv(conn, &msg, 1, 0) : -1;
  if (conn >= 0) close(conn);
  close(fd);
  if (got != 1 || msg != kUnlinkDone) {
    printf("[ERROR] Receive decoder unlink done failed\n");
    return -1;
  }
  printf("[INFO] Wait decoder unlink done success\n");
  return 0;
}
}  // namespace

int Initialize(LlmDataDist &dd, const std::string &device_id, const std::string &local_ip,
               const std::string &transfer_backend, const std::string &local_comm_res) {
  std::map<AscendString, AscendString> options;
  options[OPTION_DEVICE_ID] = device_id.c_str();
  options[OPTION_LISTEN_IP_INFO] = (local_ip + ":" + std::to_string(kPromptListenPort)).c_str();
  if (!transfer_backend.empty()) {
    if (transfer_backend != "hixl") {
      printf("[ERROR] unsupported transfer_backend: %s\n", transfer_backend.c_str());
      return -1;
    }
    options[OPTION_TRANSFER_BACKEND] = "hixl";
  }
  if (!local_comm_res.empty()) options[OPTION_LOCAL_COMM_RES] = local_comm_res.c_str();
  Status ret = dd.Initialize(options);
  if (ret != LLM_SUCCESS) {
    printf("[ERROR] Initialize failed, ret = %u, errmsg: %s\n", ret, RecentErr());
    return -1;
  }
  printf("[INFO] Initialize success\n");
  return 0;
}

void Finalize(LlmDataDist &dd, int64_t cache_id, const std::vector<void *> &buffers) {
  if (cache_id > 0) {
    Status ret = dd.UnregisterKvCache(cache_id);
    if (ret != LLM_SUCCESS) {
      printf("[ERROR] UnregisterKvCache failed, ret = %u, errmsg: %s\n", ret, RecentErr());
    } else {
      printf("[INFO] UnregisterKvCache success\n");
    }
  }
  for (void *b : buffers) aclrtFree(b);
  dd.Finalize();
}

int RunPromptSample(const char *device_id, const char *local_ip, const std::string &transfer_backend,
                    const std::string &local_comm_res) {
  printf("[INFO] Prompt Sample start\n");
  LlmDataDist dd(kPromptClusterId, LlmRole::kPrompt);
  if (Initialize(dd, device_id, local_ip, transfer_backend, local_comm_res) != 0) {
    printf("[ERROR] Initialize LlmDataDist failed\n");
    return -1;
  }
  CacheDesc desc{};
  desc.num_tensors = kNumTensors;
  desc.data_type = DT_INT32;
  desc.shape = kTensorShape;
  std::vector<uint64_t> addrs;
  std::vector<void *> buffers;
  for (uint32_t i = 0; i < kNumTensors; ++i) {
    void *buf = nullptr;
    CHECK_ACL(aclrtMalloc(&buf, kTensorSize, ACL_MEM_MALLOC_HUGE_ONLY));
    std::vector<int32_t> host(kTensorSize / sizeof(int32_t));
    std::iota(host.begin(), host.end(), 0);
    CHECK_ACL(aclrtMemcpy(buf, kTensorSize, host.data(), kTensorSize, ACL_MEMCPY_HOST_TO_DEVICE));
    addrs.push_back(reinterpret_cast<uint64_t>(buf));
    buffers.push_back(buf);
  }
  int64_t cache_id = -1;
  Status ret = dd.RegisterKvCache(desc, addrs, {}, cache_id);
  if (ret != LLM_SUCCESS) {
    printf("[ERROR] RegisterKvCache failed, ret = %u, errmsg: %s\n", ret, RecentErr());
    Finalize(dd, cache_id, buffers);
    return -1;
  }
  printf("[INFO] RegisterKvCache success, cache_id = %lld\n", static_cast<long long>(cache_id));
  for (size_t i = 0; i < addrs.size(); ++i) printf("[INFO] Tensor[%zu] addr = %p\n", i, buffers[i]);
  if (WaitUnlinkDone(local_ip) != 0) {
    Finalize(dd, cache_id, buffers);
    return -1;
  }
  Finalize(dd, cache_id, buffers);
  printf("[INFO] Prompt Sample end\n");
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 3 || argc > 5) {
    printf("[ERROR] expect args(device_id, localHostIp, [transfer_backend], [local_comm_res]), but got %d\n", argc - 1);
    return -1;
  }
  std::string transfer_backend = argc > 3 ? argv[3] : "";
  std::string local_comm_res = argc > 4 ? argv[4] : "";
  printf("[INFO] device_id = %s, local_ip = %s\n", argv[1], argv[2]);
  return RunPromptSample(argv[1], argv[2], transfer_backend, local_comm_res);
}
