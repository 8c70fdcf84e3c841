// The PROMPT side: listens, registers a filled source cache (id 1) and an empty one (id 2),
// waits until the decoder says it is done, then checks that the decoder's layer-wise
// PushKvBlocks filled cache 2 with exactly cache 1's bytes.
//
//   dd_example_prompt <listen ip> <listen port> <control port>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common.h"

using namespace llm_datadist;

int main(int argc, char **argv) {
  if (argc != 4) {
    std::printf("usage: %s <listen ip> <listen port> <control port>\n", argv[0]);
    return 2;
  }
  const std::string ip = argv[1];
  const auto port = static_cast<uint16_t>(std::atoi(argv[2]));
  const auto control_port = static_cast<uint16_t>(std::atoi(argv[3]));

  // The port the decoder reports back on, taken before anything is announced.
  const int notice_fd = example::ListenForNotice(control_port);
  if (notice_fd < 0) {
    std::printf("[ERROR] cannot listen on control port %u\n", control_port);
    return 1;
  }

  LlmDataDist llm_datadist(example::kPromptClusterId, LlmRole::kPrompt);
  std::map<AscendString, AscendString> options;
  options[OPTION_DEVICE_ID] = "0";
  options[OPTION_LISTEN_IP_INFO] = (ip + ":" + std::to_string(port)).c_str();
  options[OPTION_SYNC_CACHE_WAIT_TIME] = "5000";
  Status ret = llm_datadist.Initialize(options);
  if (ret != LLM_SUCCESS) {
    std::printf("[ERROR] Initialize failed, ret = %u\n", ret);
    return 1;
  }

  // Host memory stands in for the NPU memory CANN's samples allocate with aclrtMalloc.
  std::vector<std::vector<int32_t>> source(example::kNumTensors), landing(example::kNumTensors);
  std::vector<uint64_t> source_addrs, landing_addrs;
  for (uint32_t t = 0; t < example::kNumTensors; ++t) {
    source[t].resize(example::kTensorBytes / sizeof(int32_t));
    landing[t].assign(example::kTensorBytes / sizeof(int32_t), -1);
    for (size_t i = 0; i < source[t].size(); ++i) source[t][i] = example::Expected(t, i);
    source_addrs.push_back(reinterpret_cast<uint64_t>(source[t].data()));
    landing_addrs.push_back(reinterpret_cast<uint64_t>(landing[t].data()));
  }
  int64_t source_id = -1, landing_id = -1;
  if (llm_datadist.RegisterKvCache(example::Desc(), source_addrs, {}, source_id) != LLM_SUCCESS ||
      llm_datadist.RegisterKvCache(example::Desc(), landing_addrs, {}, landing_id) != LLM_SUCCESS) {
    std::printf("[ERROR] RegisterKvCache failed\n");
    return 1;
  }
  std::printf("[INFO] prompt listening on %s:%u, caches %ld and %ld registered\n", ip.c_str(), port,
              static_cast<long>(source_id), static_cast<long>(landing_id));
  std::fflush(stdout);

  if (example::WaitNotified(notice_fd, 60) != 0) {
    std::printf("[ERROR] the decoder did not report back\n");
    return 1;
  }
  std::vector<uint64_t> all_blocks;
  for (int64_t b = 0; b < example::kBlocks; ++b) all_blocks.push_back(static_cast<uint64_t>(b));
  int bad = example::CheckBlocks(landing, all_blocks);
  if (bad) {
    std::printf("[ERROR] %d elements pushed by the decoder are wrong\n", bad);
    return 1;
  }
  std::printf("[INFO] every byte the decoder pushed is right\n");
  llm_datadist.UnregisterKvCache(source_id);
  llm_datadist.UnregisterKvCache(landing_id);
  llm_datadist.Finalize();
  return 0;
}
