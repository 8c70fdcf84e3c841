// The DECODER side: links to the prompt, pulls slot 0 with PullKvCache and blocks 1..7 with
// PullKvBlocks (checking every byte), then pushes its whole cache back into the prompt's
// cache 2 layer by layer with PushKvBlocks and {l, l} layer ranges, unlinks and tells the
// prompt it is done.
//
//   dd_example_decoder <prompt ip> <prompt port> <control port>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common.h"

using namespace llm_datadist;

int main(int argc, char **argv) {
  if (argc != 4) {
    std::printf("usage: %s <prompt ip> <prompt port> <control port>\n", argv[0]);
    return 2;
  }
  const char *prompt_ip = argv[1];
  const auto prompt_port = static_cast<uint16_t>(std::atoi(argv[2]));
  const auto control_port = static_cast<uint16_t>(std::atoi(argv[3]));

  LlmDataDist llm_datadist(example::kDecoderClusterId, LlmRole::kDecoder);
  std::map<AscendString, AscendString> options;
  options[OPTION_DEVICE_ID] = "0";
  options[OPTION_SYNC_CACHE_WAIT_TIME] = "5000";
  Status ret = llm_datadist.Initialize(options);
  if (ret != LLM_SUCCESS) {
    std::printf("[ERROR] Initialize failed, ret = %u\n", ret);
    return 1;
  }
  std::vector<std::vector<int32_t>> tensors(example::kNumTensors);
  std::vector<uint64_t> addrs;
  for (auto &t : tensors) {
    t.assign(example::kTensorBytes / sizeof(int32_t), 0);
    addrs.push_back(reinterpret_cast<uint64_t>(t.data()));
  }
  int64_t cache_id = -1;
  if ((ret = llm_datadist.RegisterKvCache(example::Desc(), addrs, {}, cache_id)) != LLM_SUCCESS) {
    std::printf("[ERROR] RegisterKvCache failed, ret = %u\n", ret);
    return 1;
  }

  ClusterInfo cluster{};
  cluster.remote_cluster_id = example::kPromptClusterId;
  IpInfo remote{};
  remote.ip = prompt_ip;
  remote.port = prompt_port;
  cluster.remote_ip_infos.push_back(remote);
  std::vector<Status> rets;
  for (int attempt = 0; attempt < 50; ++attempt) {  // the prompt may still be starting
    ret = llm_datadist.LinkLlmClusters({cluster}, rets, 2000);
    if (ret == LLM_SUCCESS) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (ret != LLM_SUCCESS) {
    std::printf("[ERROR] LinkLlmClusters failed, ret = %u\n", ret);
    return 1;
  }

  Cache cache{};
  cache.cache_id = cache_id;
  CacheIndex remote_cache{};
  remote_cache.cluster_id = example::kPromptClusterId;
  remote_cache.cache_id = 1;  // the prompt's first registered cache
  remote_cache.batch_index = 0;
  if ((ret = llm_datadist.PullKvCache(remote_cache, cache, 0)) != LLM_SUCCESS) {
    std::printf("[ERROR] PullKvCache failed, ret = %u\n", ret);
    return 1;
  }
  if (example::CheckBlocks(tensors, {0})) return 1;
  std::printf("[INFO] PullKvCache: every byte of slot 0 is right\n");

  std::vector<uint64_t> rest = {1, 2, 3, 4, 5, 6, 7};
  if ((ret = llm_datadist.PullKvBlocks(remote_cache, cache, rest, rest)) != LLM_SUCCESS) {
    std::printf("[ERROR] PullKvBlocks failed, ret = %u\n", ret);
    return 1;
  }
  if (example::CheckBlocks(tensors, rest)) return 1;
  std::printf("[INFO] PullKvBlocks: every byte of blocks 1..7 is right\n");

  std::vector<uint64_t> all = {0, 1, 2, 3, 4, 5, 6, 7};
  CacheIndex landing{};
  landing.cluster_id = example::kPromptClusterId;
  landing.cache_id = 2;
  for (int32_t layer = 0; layer < static_cast<int32_t>(example::kLayers); ++layer) {
    KvCacheExtParam ext{};
    ext.src_layer_range = {layer, layer};
    ext.dst_layer_range = {layer, layer};
    ext.tensor_num_per_layer = 2;
    if ((ret = llm_datadist.PushKvBlocks(cache, landing, all, all, ext)) != LLM_SUCCESS) {
      std::printf("[ERROR] PushKvBlocks of layer %d failed, ret = %u\n", layer, ret);
      return 1;
    }
    std::printf("[INFO] PushKvBlocks: layer %d pushed\n", layer);
  }
  if ((ret = llm_datadist.UnlinkLlmClusters({cluster}, rets, 2000)) != LLM_SUCCESS) {
    std::printf("[ERROR] UnlinkLlmClusters failed, ret = %u\n", ret);
    return 1;
  }
  if (example::Notify(prompt_ip, control_port) != 0) {
    std::printf("[ERROR] cannot tell the prompt we are done\n");
    return 1;
  }
  llm_datadist.UnregisterKvCache(cache_id);
  llm_datadist.Finalize();
  std::printf("[INFO] decoder done\n");
  return 0;
}
