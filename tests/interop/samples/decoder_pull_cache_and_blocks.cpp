// Port of CANN's examples/cpp/decoder_pull_cache_and_blocks.cpp (hicann/hixl) to datadist: the
// decoder registers 4 empty int32 tensors of shape {8, 16}, waits for the prompt, links to it,
// pulls blocks 1..3 with PullKvBlocks and batch 0 with PullKvCache (from the prompt's cache id
// 1), checks blocks 0..3 of every tensor, unlinks, tells the prompt, and finalizes (without
// unregistering, as the original). Same API calls, options, order and checks as the original;
// acl calls go to acl_host_shim.h, ports come from the environment.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "acl_host_shim.h"
#include "llm_datadist/llm_datadist.h"

using namespace llm_datadist;

namespace {
const uint16_t kPromptListenPort = PortFromEnv("DD_PROMPT_PORT", 26000);
const uint16_t kDecoderListenPort = PortFromEnv("DD_DECODER_PORT", 26001);
const uint16_t kPromptControlPort = PortFromEnv("DD_PROMPT_CONTROL_PORT", 26002);
constexpr uint16_t kPromptClusterId = 0;
constexpr uint16_t kDecoderClusterId = 1;
constexpr uint32_t kNumTensors = 4U;
constexpr size_t kTensorSize = 8 * 16 * sizeof(int32_t);
const std::vector<int64_t> kTensorShape = {8, 16};
constexpr size_t kBlockElems = 16;
constexpr int kWaitPromptSec = 5;
constexpr int kNotifyRetries = 600;
constexpr useconds_t kNotifyRetryUs = 100000U;
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
}  // namespace

int Initialize(LlmDataDist &dd, const std::string &device_id, const std::string &local_ip,
               const std::string &transfer_backend, const std::string &local_comm_res) {
  std::map<AscendString, AscendString> options;
  options[OPTION_DEVICE_ID] = device_id.c_str();
  options[OPTION_LISTEN_IP_INFO] = (local_ip + ":" + std::to_string(kDecoderListenPort)).c_str();
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

int Link(LlmDataDist &dd, const char *local_ip, const char *remote_ip) {
  std::vector<Status> rets;
  ClusterInfo cluster{};
  cluster.remote_cluster_id = kPromptClusterId;
  IpInfo local{};
  local.ip = local_ip;
  local.port = kDecoderListenPort;
  cluster.local_ip_infos.push_back(local);
  IpInfo remote{};
  remote.ip = remote_ip;
  remote.port = kPromptListenPort;
  cluster.remote_ip_infos.push_back(remote);
  Status ret = dd.LinkLlmClusters({cluster}, rets, 5000);
  if (ret != LLM_SUCCESS) {
    printf("[ERROR] LinkLlmClusters failed, ret = %u, errmsg: %s\n", ret, RecentErr());
    return -1;
  }
  printf("[INFO] LinkLlmClusters success\n");
  return 0;
}

int Unlink(LlmDataDist &dd, const char *remote_ip) {
  std::vector<Status> rets;
  ClusterInfo cluster{};
  cluster.remote_cluster_id = kPromptClusterId;  // no local ip infos, as the original
  IpInfo remote{};
  remote.ip = remote_ip;
  remote.port = kPromptListenPort;
  cluster.remote_ip_infos.push_back(remote);
  Status ret = dd.UnlinkLlmClusters({cluster}, rets, 5000);
  if (ret != LLM_SUCCESS) {
    printf("[ERROR] UnlinkLlmClusters failed, ret = %u, errmsg: %s\n", ret, RecentErr());
    return -1;
  }
  printf("[INFO] UnlinkLlmClusters success\n");
  return 0;
}

int NotifyUnlinkDone(const char *ip, uint16_t port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  if (inet_pton(AF_INET, ip, &addr.sin_addr) != 1) return -1;
  for (int i = 0; i < kNotifyRetries; ++i) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    if (connect(fd, reinterpret_cast<sockaddr *>(&addr), sizeof(addr)) == 0) {
      ssize_t sent = send(fd, &kUnlinkDone, 1, 0);
      close(fd);
      if (sent != 1) return -1;
      printf("[INFO] Notify prompt unlink done success\n");
      return 0;
    }
    close(fd);
    usleep(kNotifyRetryUs);
  }
  printf("[ERROR] Notify prompt unlink done timeout\n");
  return -1;
}

// Every element of the listed blocks of every tensor must equal its index (the prompt's iota).
int CheckBuffers(const std::vector<void *> &buffers, const std::vector<uint32_t> &blocks) {
  for (void *buf : buffers) {
    std::vector<int32_t> host(kTensorSize / sizeof(int32_t));
    CHECK_ACL(aclrtMemcpy(host.data(), kTensorSize, buf, kTensorSize, ACL_MEMCPY_DEVICE_TO_HOST));
    for (uint32_t b : blocks)
      for (size_t i = 0; i < kBlockElems; ++i) {
        size_t at = b * kBlockElems + i;
        if (static_cast<uint32_t>(host[at]) != at) {
          printf("[ERROR] Buffer check failed, index = %zu, val = %d, expect val = %zu\n", at, host[at], at);
          return -1;
        }
      }
  }
  printf("[INFO] CheckBuffers success\n");
  return 0;
}

int PullCache(LlmDataDist &dd, int64_t cache_id) {
  std::vector<uint64_t> prompt_blocks{1, 2, 3};
  std::vector<uint64_t> decoder_blocks{1, 2, 3};
  CacheIndex index{};
  index.cluster_id = kPromptClusterId;
  index.cache_id = 1;  // the prompt's first registered cache, hard-coded as in the original
  index.batch_index = 0;
  Cache cache{};
  cache.cache_id = cache_id;  // only the id, as the original
  Status ret = dd.PullKvBlocks(index, cache, prompt_blocks, decoder_blocks);
  if (ret != LLM_SUCCESS) {
    printf("[ERROR] PullKvBlocks failed, ret = %u, errmsg: %s\n", ret, RecentErr());
    return -1;
  }
  printf("[INFO] PullKvBlocks success\n");
  index.batch_index = 0;
  ret = dd.PullKvCache(index, cache, 0);
  if (ret != LLM_SUCCESS) {
    printf("[ERROR] PullKvCache failed, ret = %u, errmsg: %s\n", ret, RecentErr());
    return -1;
  }
  printf("[INFO] PullKvCache success\n");
  return 0;
}

void Finalize(LlmDataDist &dd, int64_t cache_id, bool linked, const char *remote_ip, const std::vector<void *> &buffers) {
  if (linked) {
    if (Unlink(dd, remote_ip) != 0) {
      printf("[ERROR] Unlink failed\n");
    } else {
      printf("[INFO] Unlink success\n");
    }
  }
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

int RegisterCache(LlmDataDist &dd, std::vector<void *> &buffers, int64_t &cache_id) {
  CacheDesc desc{};
  desc.num_tensors = kNumTensors;
  desc.data_type = DT_INT32;
  desc.shape = kTensorShape;
  std::vector<uint64_t> addrs;
  for (uint32_t i = 0; i < kNumTensors; ++i) {
    void *buf = nullptr;
    CHECK_ACL(aclrtMalloc(&buf, kTensorSize, ACL_MEM_MALLOC_HUGE_ONLY));
    addrs.push_back(reinterpret_cast<uint64_t>(buf));
    buffers.push_back(buf);
  }
  Status ret = dd.RegisterKvCache(desc, addrs, {}, cache_id);
  if (ret != LLM_SUCCESS) {
    printf("[ERROR] RegisterKvCache failed, ret = %u, errmsg: %s\n", ret, RecentErr());
    return -1;
  }
  printf("[INFO] RegisterKvCache success, cache_id = %lld\n", static_cast<long long>(cache_id));
  for (size_t i = 0; i < addrs.size(); ++i) printf("[INFO] Tensor[%zu] addr = %p\n", i, buffers[i]);
  return 0;
}

int RunDecoderSample(const char *device_id, const char *local_ip, const char *remote_ip,
                     const std::string &transfer_backend, const std::string &local_comm_res) {
  printf("[INFO] Decoder Sample start\n");
  LlmDataDist dd(kDecoderClusterId, LlmRole::kDecoder);
  if (Initialize(dd, device_id, local_ip, transfer_backend, local_comm_res) != 0) return -1;
  std::vector<void *> buffers;
  int64_t cache_id = -1;
  bool linked = false;
  if (RegisterCache(dd, buffers, cache_id) != 0) {
    Finalize(dd, cache_id, linked, remote_ip, buffers);
    return -1;
  }
  std::this_thread::sleep_for(std::chrono::seconds(kWaitPromptSec));  // the prompt registers meanwhile
  if (Link(dd, local_ip, remote_ip) != 0) {
    Finalize(dd, cache_id, linked, remote_ip, buffers);
    return -1;
  }
  linked = true;
  if (PullCache(dd, cache_id) != 0 || CheckBuffers(buffers, {0, 1, 2, 3}) != 0) {
    Finalize(dd, cache_id, linked, remote_ip, buffers);
    return -1;
  }
  if (Unlink(dd, remote_ip) != 0) {
    Finalize(dd, cache_id, linked, remote_ip, buffers);
    return -1;
  }
  linked = false;
  if (NotifyUnlinkDone(remote_ip, kPromptControlPort) != 0) {
    Finalize(dd, cache_id, linked, remote_ip, buffers);
    return -1;
  }
  dd.Finalize();  // the original finalizes with the cache still registered and never frees its buffers
  printf("[INFO] Decoder Sample end\n");
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 4 || argc > 6) {
    printf("[ERROR] expect args(device_id, localHostIp, remoteHostIp, [transfer_backend], [local_comm_res]), but got %d\n",
           argc - 1);
    return -1;
  }
  std::string transfer_backend = argc > 4 ? argv[4] : "";
  std::string local_comm_res = argc > 5 ? argv[5] : "";
  printf("[INFO] device_id = %s, local_ip = %s, remote_ip = %s\n", argv[1], argv[2], argv[3]);
  return RunDecoderSample(argv[1], argv[2], argv[3], transfer_backend, local_comm_res);
}
