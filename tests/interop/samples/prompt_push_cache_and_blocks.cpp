// Port of CANN's examples/cpp/prompt_push_cache_and_blocks.cpp (hicann/hixl) to datadist: the
// prompt registers 4 int32 tensors of shape {8, 16} holding 0, 1, 2, ..., waits for the
// decoder, links to it (the prompt is the linking side here), pushes blocks 5..7 layer by
// layer with PushKvBlocks ({i, i}, one tensor a layer) and batch 4 of all tensors with
// PushKvCache ({0, 0}, four tensors a layer), unlinks, tells the decoder, and finalizes. Same
// API calls, options, order and checks as the original; acl calls go to acl_host_shim.h,
// ports come from the environment.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "acl_host_shim.h"
#include "llm_datadist/llm_datadist.h"

using namespace llm_datadist;

namespace {
const uint16_t kDecoderListenPort = PortFromEnv("DD_DECODER_PORT", 26001);
const uint16_t kPromptListenPort = PortFromEnv("DD_PROMPT_PORT", 26000);
const uint16_t kDecoderControlPort = PortFromEnv("DD_DECODER_CONTROL_PORT", 26003);
constexpr uint16_t kPromptClusterId = 0;
constexpr uint64_t kDecoderClusterId = 1;
constexpr uint32_t kNumTensors = 4U;
constexpr size_t kTensorSize = 8 * 16 * sizeof(int32_t);
const std::vector<int64_t> kTensorShape = {8, 16};
constexpr int kWaitSec = 5;
constexpr int kNotifyRetries = 600;
constexpr useconds_t kNotifyRetryUs = 100000U;
constexpr char kUnlinkDone = '1';
constexpr uint32_t kPushBatchIndex = 4;
constexpr uint8_t kPushTensorNumPerLayer = 4;

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

int Link(LlmDataDist &dd, const char *local_ip, const char *remote_ip) {
  std::vector<Status> rets;
  ClusterInfo cluster{};
  cluster.remote_cluster_id = kDecoderClusterId;
  IpInfo local{};
  local.ip = local_ip;
  local.port = kPromptListenPort;
  cluster.local_ip_infos.push_back(local);
  IpInfo remote{};
  remote.ip = remote_ip;
  remote.port = kDecoderListenPort;
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
  cluster.remote_cluster_id = kDecoderClusterId;
  IpInfo remote{};
  remote.ip = remote_ip;
  remote.port = kDecoderListenPort;
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
      printf("[INFO] Notify decoder unlink done success\n");
      return 0;
    }
    close(fd);
    usleep(kNotifyRetryUs);
  }
  printf("[ERROR] Notify decoder unlink done timeout\n");
  return -1;
}

int PushCache(LlmDataDist &dd, int64_t cache_id) {
  std::vector<uint64_t> prompt_blocks{5, 6, 7};
  std::vector<uint64_t> decoder_blocks{5, 6, 7};
  Cache cache{};
  cache.cache_id = cache_id;
  CacheIndex index{};
  index.cluster_id = kDecoderClusterId;
  index.cache_id = 1;  // the decoder's first registered cache
  for (uint32_t i = 0; i < kNumTensors; ++i) {
    KvCacheExtParam param{};
    param.src_layer_range = {static_cast<int32_t>(i), static_cast<int32_t>(i)};
    param.dst_layer_range = {static_cast<int32_t>(i), static_cast<int32_t>(i)};
    param.tensor_num_per_layer = 1;
    Status ret = dd.PushKvBlocks(cache, index, prompt_blocks, decoder_blocks, param);
    if (ret != LLM_SUCCESS) {
      printf("[ERROR] PushKvBlocks failed, ret = %u, errmsg: %s\n", ret, RecentErr());
      return -1;
    }
  }
  printf("[INFO] PushKvBlocks success\n");
  CacheIndex index2{};
  index2.cluster_id = kDecoderClusterId;
  index2.cache_id = 1;
  index2.batch_index = kPushBatchIndex;
  KvCacheExtParam param2{};
  param2.src_layer_range = {0, 0};
  param2.dst_layer_range = {0, 0};
  param2.tensor_num_per_layer = kPushTensorNumPerLayer;
  Status ret = dd.PushKvCache(cache, index2, kPushBatchIndex, -1, param2);
  if (ret != LLM_SUCCESS) {
    printf("[ERROR] PushKvCache failed, ret = %u, errmsg: %s\n", ret, RecentErr());
    return -1;
  }
  printf("[INFO] PushKvCache success\n");
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

int RunPromptSample(const char *device_id, const char *local_ip, const char *remote_ip,
                    const std::string &transfer_backend, const std::string &local_comm_res) {
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
  bool linked = false;
  Status ret = dd.RegisterKvCache(desc, addrs, {}, cache_id);
  if (ret != LLM_SUCCESS) {
    printf("[ERROR] RegisterKvCache failed, ret = %u, errmsg: %s\n", ret, RecentErr());
    Finalize(dd, cache_id, linked, remote_ip, buffers);
    return -1;
  }
  printf("[INFO] RegisterKvCache success, cache_id = %lld\n", static_cast<long long>(cache_id));
  for (size_t i = 0; i < addrs.size(); ++i) printf("[INFO] Tensor[%zu] addr = %p\n", i, buffers[i]);
  std::this_thread::sleep_for(std::chrono::seconds(kWaitSec));  // the decoder registers meanwhile
  if (Link(dd, local_ip, remote_ip) != 0) {
    Finalize(dd, cache_id, linked, remote_ip, buffers);
    return -1;
  }
  linked = true;
  if (PushCache(dd, cache_id) != 0) {
    Finalize(dd, cache_id, linked, remote_ip, buffers);
    return -1;
  }
  if (Unlink(dd, remote_ip) != 0) {
    Finalize(dd, cache_id, linked, remote_ip, buffers);
    return -1;
  }
  linked = false;
  if (NotifyUnlinkDone(remote_ip, kDecoderControlPort) != 0) {
    Finalize(dd, cache_id, linked, remote_ip, buffers);
    return -1;
  }
  Finalize(dd, cache_id, linked, remote_ip, buffers);
  printf("[INFO] Prompt Sample end\n");
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
  return RunPromptSample(argv[1], argv[2], argv[3], transfer_backend, local_comm_res);
}
