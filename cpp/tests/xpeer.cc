// A C++ peer for the cross-language tests (tests/cpp/): reads one command per line on stdin,
// calls the llm_datadist C++ API, and answers one line on stdout: "ok <status> [values]".
// Tensor contents travel as hex so the Python side can check every byte.
//
//   init <cluster_id> <role 1|2|3> <listen ip:port or -> <sync_ms or -> [secret]
//   reg <num_tensors> <dtype> <d0,d1,...>       -> ok <status> <cache_id>
//   alloc <num_tensors> <dtype> <d0,d1,...>     -> ok <status> <cache_id>
//   unreg <cache_id>                            (UnregisterKvCache)
//   write <cache_id> <tensor> <hex>             (sets the whole tensor)
//   read <cache_id> <tensor>                    -> ok 0 <hex>
//   link <cluster_id> <ip> <port> <timeout_ms>  -> ok <status>
//   unlink <cluster_id> <timeout_ms> <force 0|1>
//   pullc <cluster> <rcache> <rbatch> <lcache> <lbatch> <size> <sa> <sb> <da> <db> <n>
//   pullb <cluster> <rcache> <rbatch> <lcache> <src_blocks|-> <dst_blocks> <sa> <sb> <da> <db> <n>
//   pushc <lcache> <cluster> <rcache> <rbatch> <lbatch> <size> <sa> <sb> <da> <db> <n>
//   pushb <lcache> <cluster> <rcache> <src_blocks> <dst_blocks> <sa> <sb> <da> <db> <n>
//   setrole <role> <listen or ->
//   denycma                                     (the kernel refuses our process_vm_readv: seccomp)
//   quit
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstddef>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "llm_datadist/llm_datadist.h"

using namespace llm_datadist;

namespace {

struct Local {
  Cache cache;
  uint64_t tensor_bytes = 0;
  std::vector<std::unique_ptr<uint8_t[]>> mem;
};

std::vector<uint64_t> Csv(const std::string &s) {
  std::vector<uint64_t> out;
  if (s == "-") return out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::stoull(item));
  return out;
}

uint64_t ItemSize(int dt) {
  switch (dt) {
    case DT_FLOAT16:
    case DT_BF16:
    case DT_INT16: return 2;
    case DT_FLOAT:
    case DT_INT32: return 4;
    case DT_INT64:
    case DT_DOUBLE: return 8;
    default: return 1;
  }
}

KvCacheExtParam Ext(std::istringstream &in) {
  KvCacheExtParam ext{};
  int sa, sb, da, db, n;
  in >> sa >> sb >> da >> db >> n;
  ext.src_layer_range = {sa, sb};
  ext.dst_layer_range = {da, db};
  ext.tensor_num_per_layer = static_cast<uint8_t>(n);
  return ext;
}

CacheIndex Index(uint64_t cluster, int64_t cache_id, uint32_t batch) {
  CacheIndex idx{};
  idx.cluster_id = cluster;
  idx.cache_id = cache_id;
  idx.batch_index = batch;
  return idx;
}

std::map<AscendString, AscendString> Options(const std::string &listen, const std::string &sync_ms) {
  std::map<AscendString, AscendString> options;
  options[OPTION_DEVICE_ID] = "0";
  if (listen != "-") options[OPTION_LISTEN_IP_INFO] = listen.c_str();
  if (sync_ms != "-") options[OPTION_SYNC_CACHE_WAIT_TIME] = sync_ms.c_str();
  return options;
}

// From now on the kernel answers this process's process_vm_readv with EPERM, as it does for a
// reader that may not ptrace the owner (Yama, another user, no CAP_SYS_PTRACE): a seccomp
// filter on every thread. False where it cannot be installed.
bool DenyCma() {
#if defined(__x86_64__)
  constexpr uint32_t kArch = AUDIT_ARCH_X86_64;
#elif defined(__aarch64__)
  constexpr uint32_t kArch = AUDIT_ARCH_AARCH64;
#else
  return false;
#endif
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kArch, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_process_vm_readv, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return false;
  return syscall(__NR_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, &prog) == 0;
}

}  // namespace

int main() {
  std::unique_ptr<LlmDataDist> dd;
  std::map<int64_t, Local> caches;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    std::ostringstream out;
    Status st = LLM_SUCCESS;
    if (cmd == "init") {
      uint64_t cid;
      int role;
      std::string listen, sync_ms, secret;
      in >> cid >> role >> listen >> sync_ms >> secret;
      dd = std::make_unique<LlmDataDist>(cid, static_cast<LlmRole>(role));
      auto options = Options(listen, sync_ms);
      if (!secret.empty()) options["datadist.AuthSecret"] = secret.c_str();
      st = dd->Initialize(options);
    } else if (cmd == "reg" || cmd == "alloc") {
      uint32_t n;
      int dtype;
      std::string dims;
      in >> n >> dtype >> dims;
      CacheDesc desc{};
      desc.placement = CachePlacement::kHost;
      desc.num_tensors = n;
      desc.data_type = static_cast<DataType>(dtype);
      uint64_t bytes = ItemSize(dtype);
      for (uint64_t d : Csv(dims)) {
        desc.shape.push_back(static_cast<int64_t>(d));
        bytes *= d;
      }
      Local local;
      local.tensor_bytes = bytes;
      int64_t id = -1;
      if (cmd == "reg") {
        std::vector<uint64_t> addrs;
        for (uint32_t i = 0; i < n; ++i) {
          local.mem.emplace_back(new uint8_t[bytes]());
          addrs.push_back(reinterpret_cast<uint64_t>(local.mem.back().get()));
        }
        st = dd->RegisterKvCache(desc, addrs, {}, id);
        local.cache.cache_id = id;
        local.cache.cache_desc = desc;
        local.cache.tensor_addrs.assign(addrs.begin(), addrs.end());
      } else {
        st = dd->AllocateCache(desc, local.cache);
        id = local.cache.cache_id;
      }
      out << " " << id;
      if (st == LLM_SUCCESS) caches[id] = std::move(local);
    } else if (cmd == "unreg") {
      int64_t id;
      in >> id;
      st = dd->UnregisterKvCache(id);
      if (st == LLM_SUCCESS) caches.erase(id);
    } else if (cmd == "write" || cmd == "read") {
      int64_t id;
      uint32_t t;
      in >> id >> t;
      Local &local = caches.at(id);
      auto *p = reinterpret_cast<uint8_t *>(local.cache.tensor_addrs.at(t));
      if (cmd == "write") {
        std::string hex;
        in >> hex;
        for (uint64_t i = 0; i < local.tensor_bytes; ++i)
          p[i] = static_cast<uint8_t>(std::stoul(hex.substr(2 * i, 2), nullptr, 16));
      } else {
        static const char digits[] = "0123456789abcdef";
        std::string hex(2 * local.tensor_bytes, '0');
        for (uint64_t i = 0; i < local.tensor_bytes; ++i) {
          hex[2 * i] = digits[p[i] >> 4];
          hex[2 * i + 1] = digits[p[i] & 15];
        }
        out << " " << hex;
      }
    } else if (cmd == "link" || cmd == "unlink") {
      uint64_t cid;
      in >> cid;
      ClusterInfo ci{};
      ci.remote_cluster_id = cid;
      std::vector<Status> rets;
      if (cmd == "link") {
        std::string ip;
        uint16_t port;
        int32_t timeout;
        in >> ip >> port >> timeout;
        IpInfo info{};
        info.ip = ip.c_str();
        info.port = port;
        ci.remote_ip_infos.push_back(info);
        st = dd->LinkLlmClusters({ci}, rets, timeout);
      } else {
        int32_t timeout;
        int force;
        in >> timeout >> force;
        st = dd->UnlinkLlmClusters({ci}, rets, timeout, force != 0);
      }
    } else if (cmd == "pullc") {
      uint64_t cluster;
      int64_t rcache, lcache, size;
      uint32_t rbatch, lbatch;
      in >> cluster >> rcache >> rbatch >> lcache >> lbatch >> size;
      KvCacheExtParam ext = Ext(in);
      Cache dst{};
      dst.cache_id = lcache;  // a Cache may carry only its id
      st = dd->PullKvCache(Index(cluster, rcache, rbatch), dst, lbatch, size, ext);
    } else if (cmd == "pullb") {
      uint64_t cluster;
      int64_t rcache, lcache;
      uint32_t rbatch;
      std::string src, dst_b;
      in >> cluster >> rcache >> rbatch >> lcache >> src >> dst_b;
      KvCacheExtParam ext = Ext(in);
      Cache dst{};
      dst.cache_id = lcache;
      st = dd->PullKvBlocks(Index(cluster, rcache, rbatch), dst, Csv(src), Csv(dst_b), ext);
    } else if (cmd == "pushc") {
      uint64_t cluster;
      int64_t lcache, rcache, size;
      uint32_t rbatch, lbatch;
      in >> lcache >> cluster >> rcache >> rbatch >> lbatch >> size;
      KvCacheExtParam ext = Ext(in);
      Cache src{};
      src.cache_id = lcache;
      st = dd->PushKvCache(src, Index(cluster, rcache, rbatch), lbatch, size, ext);
    } else if (cmd == "pushb") {
      uint64_t cluster;
      int64_t lcache, rcache;
      std::string src_b, dst_b;
      in >> lcache >> cluster >> rcache >> src_b >> dst_b;
      KvCacheExtParam ext = Ext(in);
      Cache src{};
      src.cache_id = lcache;
      st = dd->PushKvBlocks(src, Index(cluster, rcache, 0), Csv(src_b), Csv(dst_b), ext);
    } else if (cmd == "setrole") {
      int role;
      std::string listen;
      in >> role >> listen;
      st = dd->SetRole(static_cast<LlmRole>(role), Options(listen, "-"));
    } else if (cmd == "denycma") {
      st = DenyCma() ? LLM_SUCCESS : LLM_FAILED;
    } else if (cmd == "quit") {
      if (dd) dd->Finalize();
      std::printf("ok 0\n");
      std::fflush(stdout);
      return 0;
    } else {
      std::printf("error unknown command %s\n", cmd.c_str());
      std::fflush(stdout);
      continue;
    }
    std::printf("ok %u%s\n", st, out.str().c_str());
    std::fflush(stdout);
  }
  if (dd) dd->Finalize();
  return 0;
}
