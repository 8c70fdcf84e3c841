"""datadist's public surface against llm_datadist's, name for name and signature for signature.

The table below was written by reading the original's source, file by file:

* hixl = GitHub hicann/hixl, src/python/llm_datadist/llm_datadist/ (the package ``llm_datadist``)
* GE = GitHub mirror-cann/ge, api/python/llm_datadist_v1/ (``TensorDesc``, ``Tensor``,
  ``KvCacheManager``, which llm_datadist loads lazily from ``llm_datadist_v1``)

Every row cites the file and the definition it comes from. Signatures are compared without
annotations: parameter names, kinds, order and defaults. Three checks:

1. every name of the table exists in datadist with that kind and signature;
2. datadist's classes have no public member beyond the table but the datadist extras listed
   here (each documented in README / docs/compatibility.md);
3. every name of the original that datadist leaves out is listed in ABSENT and explained in
   docs/compatibility.md.
"""

from __future__ import annotations

import enum
import importlib
import inspect
from pathlib import Path

import pytest

import datadist

DOC = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"

# (where, name, kind, signature, source). where: "" is the package, else a module path under
# it. kind: class (signature: the constructor's; None: an internal constructor, not compared,
# see INTERNAL_CTORS), method, static, classmethod, ro (read-only property), rw (property with
# setter), function, value (any other object), attr (a class attribute).
T = [
    # ---- hixl __init__.py
    ("", "v2_list", "value", None, "hixl __init__.py v2_list"),
    # ---- hixl configs.py
    ("configs", "trans_str_ip", "function", "(ip)", "hixl configs.py trans_str_ip"),
    ("", "LLMClusterInfo", "class", "()", "hixl configs.py LLMClusterInfo.__init__"),
    ("", "LLMClusterInfo.remote_role_type", "rw", None, "hixl configs.py LLMClusterInfo"),
    ("", "LLMClusterInfo.remote_cluster_id", "rw", None, "hixl configs.py LLMClusterInfo"),
    ("", "LLMClusterInfo.local_ip_info_list", "ro", None, "hixl configs.py LLMClusterInfo"),
    ("", "LLMClusterInfo.remote_ip_info_list", "ro", None, "hixl configs.py LLMClusterInfo"),
    ("", "LLMClusterInfo.append_local_ip_info", "method", "(self, ip, port)",
     "hixl configs.py LLMClusterInfo.append_local_ip_info"),
    ("", "LLMClusterInfo.append_remote_ip_info", "method", "(self, ip, port)",
     "hixl configs.py LLMClusterInfo.append_remote_ip_info"),
    ("", "LLMConfig", "class", "()", "hixl configs.py LlmConfig.__init__"),
    ("", "LLMConfig.generate_options", "method", "(self)", "hixl configs.py LlmConfig"),
    ("", "LLMConfig.gen_options", "method", "(self)", "hixl configs.py LlmConfig"),
    ("", "LLMConfig.options", "ro", None, "hixl configs.py LlmConfig.options"),
    *[("", f"LLMConfig.{p}", "rw", None, f"hixl configs.py LlmConfig.{p}") for p in (
        "ge_options", "device_id", "listen_ip_info", "deploy_res_path", "buf_pool_cfg",
        "output_max_size", "mem_utilization", "cluster_info", "sync_kv_timeout",
        "enable_switch_role", "link_total_time", "link_retry_count", "enable_cache_manager",
        "enable_remote_cache_accessible", "mem_pool_cfg", "host_mem_pool_cfg",
        "rdma_traffic_class", "rdma_service_level", "local_comm_res", "transfer_backend",
        "global_resource_config")],
    # ---- hixl status.py
    ("", "LLMException", "class", "(*args, status_code=<LLMStatusCode.LLM_SUCCESS: 0>)",
     "hixl status.py LLMException.__init__"),
    ("", "LLMException.status_code", "ro", None, "hixl status.py LLMException.status_code"),
    ("", "Status", "class", "(status)", "hixl status.py Status.__init__"),
    ("", "Status.is_ok", "method", "(self)", "hixl status.py Status.is_ok"),
    ("", "Status.status_code", "ro", None, "hixl status.py Status.status_code"),
    ("status", "code_2_status", "function", "(status)", "hixl status.py code_2_status"),
    ("status", "handle_llm_status", "function", "(status, func_name, other_info)",
     "hixl status.py handle_llm_status"),
    ("status", "raise_if_false", "function",
     "(pred, fmt, *args, status_code=<LLMStatusCode.LLM_PARAM_INVALID: 1343270917>, **kwargs)",
     "hixl status.py raise_if_false"),
    ("status", "raise_if_true", "function",
     "(pred, fmt, *args, status_code=<LLMStatusCode.LLM_PARAM_INVALID: 1343270917>, **kwargs)",
     "hixl status.py raise_if_true"),
    # ---- hixl data_type.py
    ("data_type", "get_python_dtype_from_wrapper_dtype", "function", "(wrapper_dtype)",
     "hixl data_type.py get_python_dtype_from_wrapper_dtype"),
    *[("data_type", n, "value", None, f"hixl data_type.py {n}") for n in (
        "python_dtype_2_dwrapper_dtype", "dtype_to_np_dtype", "valid_np_dtypes",
        "np_dtype_to_dtype")],
    # ---- hixl utils/log.py
    ("utils.log", "get_logger", "function", "()", "hixl utils/log.py get_logger"),
    *[("utils.log", n, "function", "(msg, *args, **kwargs)", f"hixl utils/log.py {n}")
      for n in ("info", "warn", "error")],
    # ---- hixl utils/utils.py
    ("utils.utils", "check_inner", "function", "(arg_name, arg_value, inner_class)",
     "hixl utils/utils.py check_inner"),
    ("utils.utils", "check_dict", "function",
     "(arg_name, arg_value, k_class, v_class, v_inner_class=None)",
     "hixl utils/utils.py check_dict"),
    ("utils.utils", "check_isinstance", "function",
     "(arg_name, arg_value, classes, inner_class=None, extra_fmt='', allow_none=True)",
     "hixl utils/utils.py check_isinstance"),
    ("utils.utils", "check_positive_or_set_default", "function",
     "(arg_name, arg_value, default=-1)", "hixl utils/utils.py check_positive_or_set_default"),
    *[("utils.utils", n, "function", "(arg_name, arg_value)", f"hixl utils/utils.py {n}")
      for n in ("check_uint64", "check_int64", "check_int32", "check_uint32", "check_list_int32",
                "check_list_int64", "check_list_uint64", "check_uint16", "check_uint8")],
    # ---- hixl v2/llm_types.py
    ("", "MemInfo", "class", "(mem_type, addr, size)", "hixl v2/llm_types.py MemInfo.__init__"),
    *[("", f"MemInfo.{p}", "ro", None, "hixl v2/llm_types.py MemInfo")
      for p in ("mem_type", "addr", "size")],
    ("", "CacheDesc", "class",
     "(num_tensors, shape, data_type, placement=<Placement.DEVICE: 1>, batch_dim_index=0, "
     "seq_len_dim_index=-1, kv_tensor_format=None)", "hixl v2/llm_types.py CacheDesc.__init__"),
    *[("", f"CacheDesc.{p}", "ro", None, "hixl v2/llm_types.py CacheDesc") for p in (
        "num_tensors", "shape", "data_type", "batch_dim", "batch_size", "seq_len_dim_index",
        "size", "kv_tensor_format", "placement")],
    ("", "CacheDesc.update_dim", "method", "(self, dim_index, dim_value)",
     "hixl v2/llm_types.py CacheDesc.update_dim"),
    ("", "Cache", "class",
     "(cache_id, cache_desc, tensor_addrs, cache_manager, is_registered, is_blocks_cache)",
     "hixl v2/llm_types.py Cache.__init__"),
    *[("", f"Cache.{p}", "ro", None, "hixl v2/llm_types.py Cache")
      for p in ("cache_id", "cache_desc", "tensor_addrs", "is_blocks_cache")],
    ("", "Cache.create_cpu_cache", "classmethod", "(cache_desc, addrs)",
     "hixl v2/llm_types.py Cache.create_cpu_cache"),
    ("", "BlocksCacheKey", "class", "(*args, **kwargs)",
     "hixl v2/llm_types.py BlocksCacheKey.__init__"),
    *[("", f"BlocksCacheKey.{p}", "ro", None, "hixl v2/llm_types.py BlocksCacheKey")
      for p in ("prompt_cluster_id", "cluster_id", "model_id")],
    ("", "CacheKey", "class", "(*args, **kwargs)", "hixl v2/llm_types.py CacheKey.__init__"),
    *[("", f"CacheKey.{p}", "ro", None, "hixl v2/llm_types.py CacheKey")
      for p in ("prompt_cluster_id", "cluster_id", "req_id", "prefix_id", "model_id")],
    ("", "CacheKeyByIdAndIndex", "class", "(cluster_id, cache_id, batch_index=0)",
     "hixl v2/llm_types.py CacheKeyByIdAndIndex.__init__"),
    *[("", f"CacheKeyByIdAndIndex.{p}", "ro", None, "hixl v2/llm_types.py CacheKeyByIdAndIndex")
      for p in ("cluster_id", "cache_id", "batch_index")],
    ("", "KvCache", "class", "(cache_id, cache_desc, per_device_tensor_addrs, kv_cache_manager)",
     "hixl v2/llm_types.py KvCache.__init__"),
    *[("", f"KvCache.{p}", "ro", None, "hixl v2/llm_types.py KvCache")
      for p in ("cache_id", "cache_desc", "per_device_tensor_addrs")],
    ("", "KvCache.create_cpu_cache", "classmethod", "(cache_desc, addrs)",
     "hixl v2/llm_types.py KvCache.create_cpu_cache"),
    ("", "LayerSynchronizer", "class", "()", "hixl v2/llm_types.py LayerSynchronizer"),
    ("", "LayerSynchronizer.synchronize_layer", "method", "(self, layer_index, timeout_in_millis)",
     "hixl v2/llm_types.py LayerSynchronizer.synchronize_layer"),
    ("v2.llm_types", "check_layer_range", "function", "(name, layer_range, allow_none=True)",
     "hixl v2/llm_types.py check_layer_range"),
    ("", "TransferWithCacheKeyConfig", "class",
     "(cache_key, src_layer_range=None, dst_layer_range=None, src_batch_index=0)",
     "hixl v2/llm_types.py TransferWithCacheKeyConfig.__init__"),
    *[("", f"TransferWithCacheKeyConfig.{p}", "rw", None,
       "hixl v2/llm_types.py TransferWithCacheKeyConfig")
      for p in ("cache_key", "src_layer_range", "dst_layer_range", "src_batch_index")],
    ("", "TransferConfig", "class",
     "(dst_cluster_id, dst_addrs, src_layer_range=None, src_batch_index=0)",
     "hixl v2/llm_types.py TransferConfig.__init__"),
    *[("", f"TransferConfig.{p}", "rw", None, "hixl v2/llm_types.py TransferConfig")
      for p in ("dst_cluster_id", "dst_addrs", "src_layer_range", "src_batch_index")],
    ("", "CacheTask", "class", None, "hixl v2/llm_types.py CacheTask.__init__"),
    ("", "CacheTask.synchronize", "method", "(self, timeout_in_millis=None)",
     "hixl v2/llm_types.py CacheTask.synchronize"),
    ("", "CacheTask.get_results", "method", "(self, timeout_in_millis=None)",
     "hixl v2/llm_types.py CacheTask.get_results"),
    # ---- hixl v2/llm_utils.py (the helpers that need no native wrapper)
    ("v2.llm_utils", "clone_cache_desc", "function", "(cache_desc)",
     "hixl v2/llm_utils.py clone_cache_desc"),
    ("v2.llm_utils", "verify_cache_shape", "function", "(shape)",
     "hixl v2/llm_utils.py verify_cache_shape"),
    ("v2.llm_utils", "to_data_type", "function", "(data_type_str)",
     "hixl v2/llm_utils.py to_data_type"),
    ("v2.llm_utils", "is_invalid_id", "function", "(req_id_or_prefix_id)",
     "hixl v2/llm_utils.py is_invalid_id"),
    ("v2.llm_utils", "is_valid_id", "function", "(req_id_or_prefix_id)",
     "hixl v2/llm_utils.py is_valid_id"),
    ("v2.llm_utils", "calc_tensor_size", "function", "(shape, data_type)",
     "hixl v2/llm_utils.py calc_tensor_size"),
    ("v2.llm_utils", "parse_listen_ip_info", "function", "(listen_ip_info)",
     "hixl v2/llm_utils.py parse_listen_ip_info"),
    # ---- hixl v2/llm_datadist.py
    ("", "LLMDataDist", "class", "(role, cluster_id)", "hixl v2/llm_datadist.py LLMDataDist"),
    ("", "LLMDataDist.llm_engine_instance", "attr", None,
     "hixl v2/llm_datadist.py LLMDataDist.llm_engine_instance"),
    ("", "LLMDataDist.init", "method", "(self, options)", "hixl v2/llm_datadist.py init"),
    ("", "LLMDataDist.link", "method", "(self, comm_name, cluster_rank_info, rank_table)",
     "hixl v2/llm_datadist.py link"),
    ("", "LLMDataDist.unlink", "method", "(self, comm_id)", "hixl v2/llm_datadist.py unlink"),
    ("", "LLMDataDist.query_register_mem_status", "method", "(self, comm_id)",
     "hixl v2/llm_datadist.py query_register_mem_status"),
    ("", "LLMDataDist.finalize", "method", "(self)", "hixl v2/llm_datadist.py finalize"),
    ("", "LLMDataDist.check_link_status", "method", "(self, remote_cluster_id)",
     "hixl v2/llm_datadist.py check_link_status"),
    ("", "LLMDataDist.link_clusters", "method", "(self, clusters, timeout=3000)",
     "hixl v2/llm_datadist.py link_clusters"),
    ("", "LLMDataDist.unlink_clusters", "method", "(self, clusters, timeout=3000, force=False)",
     "hixl v2/llm_datadist.py unlink_clusters"),
    ("", "LLMDataDist.switch_role", "method", "(self, role, switch_options=None)",
     "hixl v2/llm_datadist.py switch_role"),
    *[("", f"LLMDataDist.{p}", "ro", None, f"hixl v2/llm_datadist.py LLMDataDist.{p}")
      for p in ("cache_manager", "kv_cache_manager", "cluster_id")],
    # ---- hixl v2/cache_manager.py
    ("v2.cache_manager", "CacheManager", "class", None, "hixl v2/cache_manager.py CacheManager"),
    ("v2.cache_manager", "CacheManager.check_cache_key", "static", "(cache_key)",
     "hixl v2/cache_manager.py CacheManager.check_cache_key"),
    *[("v2.cache_manager", f"CacheManager.{m}", "method", sig,
       f"hixl v2/cache_manager.py CacheManager.{m}") for m, sig in (
        ("allocate_blocks_cache", "(self, cache_desc, blocks_cache_key=None)"),
        ("allocate_cache", "(self, cache_desc, cache_keys=())"),
        ("copy_blocks", "(self, cache, copy_block_info)"),
        ("copy_cache", "(self, dst, src, dst_batch_index=0, src_batch_index=0, offset=0, "
                       "size=-1, req_id=None)"),
        ("deallocate_blocks_cache", "(self, cache)"),
        ("deallocate_cache", "(self, cache)"),
        ("pull_blocks", "(self, src_cache_key, dst_cache, src_blocks=(), dst_blocks=(), "
                        "**kwargs)"),
        ("pull_cache", "(self, cache_key, cache, batch_index=0, size=-1, **kwargs)"),
        ("register_cache", "(self, cache_desc, addrs, cache_keys=(), remote_accessible=None)"),
        ("register_blocks_cache", "(self, cache_desc, addrs, blocks_cache_key=None, "
                                  "remote_accessible=None)"),
        ("unregister_cache", "(self, cache_id)"),
        ("remove_cache_key", "(self, cache_key)"),
        ("remap_registered_memory", "(self, mem_infos)"),
        ("set_is_call_linked", "(self)"),
        ("swap_blocks", "(self, src_cache, dst_cache, src_to_dst)"),
        ("transfer_cache_async", "(self, src_cache, layer_synchronizer, transfer_configs, "
                                 "src_block_indices=None, dst_block_indices=None, "
                                 "dst_block_memory_size=None)"),
        ("push_cache", "(self, dst_cache_key, src_cache, src_batch_index=0, "
                       "src_layer_range=None, dst_layer_range=None, size=-1, "
                       "tensor_num_per_layer=2)"),
        ("push_blocks", "(self, dst_cache_key, src_cache, src_blocks=(), dst_blocks=(), "
                        "src_layer_range=None, dst_layer_range=None, tensor_num_per_layer=2)"),
    )],
    # ---- GE kv_cache_manager.py
    ("", "KvCacheManager", "class", None, "GE kv_cache_manager.py KvCacheManager"),
    ("", "KvCacheManager.check_cache_key", "static", "(cache_key)",
     "GE kv_cache_manager.py KvCacheManager.check_cache_key"),
    *[("", f"KvCacheManager.{m}", "method", sig, f"GE kv_cache_manager.py KvCacheManager.{m}")
      for m, sig in (
        ("is_initialized", "(self)"),
        ("allocate_blocks_cache", "(self, cache_desc, blocks_cache_key=None)"),
        ("allocate_cache", "(self, cache_desc, cache_keys=())"),
        ("deallocate_cache", "(self, cache)"),
        ("remove_cache_key", "(self, cache_key)"),
        ("pull_blocks", "(self, prompt_cache_key, decoder_kv_cache, prompt_blocks, "
                        "decoder_blocks, **kwargs)"),
        ("pull_cache", "(self, cache_key, kv_cache, batch_index=0, size=-1, **kwargs)"),
        ("copy_blocks", "(self, cache, copy_block_info)"),
        ("copy_cache", "(self, dst, src, dst_batch_index=0, src_batch_index=0, offset=0, "
                       "size=-1, req_id=None)"),
        ("get_cache_tensors", "(self, cache, tensor_index=0)"),
        ("swap_blocks", "(self, src, dst, src_to_dst)"),
        ("transfer_cache_async", "(self, src_cache, layer_synchronizer, transfer_configs, "
                                 "src_block_indices=None, dst_block_indices=None, "
                                 "dst_block_memory_size=None)"),
    )],
    # ---- GE tensor.py
    ("", "TensorDesc", "class", "(dtype, shape)", "GE tensor.py TensorDesc.__init__"),
    ("", "TensorDesc.dtype", "ro", None, "GE tensor.py TensorDesc.dtype"),
    ("", "TensorDesc.shape", "ro", None, "GE tensor.py TensorDesc.shape"),
    ("", "Tensor", "class", "(data, tensor_desc=None)", "GE tensor.py Tensor.__init__"),
    ("", "Tensor.from_tensor_tuple", "static", "(tensor_tuple)",
     "GE tensor.py Tensor.from_tensor_tuple"),
    ("", "Tensor.numpy", "method", "(self, copy=False)", "GE tensor.py Tensor.numpy"),
]

# Constructors llm_datadist's users never call (each object comes from a manager or from
# LLMDataDist); datadist's take its engine instead of the native wrapper.
INTERNAL_CTORS = {"CacheTask", "CacheManager", "KvCacheManager"}

# Names of the original that datadist leaves out (docs/compatibility.md says why).
ABSENT = [
    ("v2.llm_types", "PushType", "hixl v2/llm_types.py PushType"),
    ("v2.llm_types", "int_to_mem_status_dict", "hixl v2/llm_types.py int_to_mem_status_dict"),
    ("v2.config", "ClusterConfig", "hixl v2/config.py ClusterConfig"),
    ("v2.config", "EngineConfig", "hixl v2/config.py EngineConfig"),
    ("utils.log", "LOG_FORMAT", "hixl utils/log.py LOG_FORMAT"),
    *[("v2.llm_utils", n, f"hixl v2/llm_utils.py {n}") for n in (
        "CacheDescParser", "pack_cache_desc", "pack_cache_key", "pack_cache_key_by_id",
        "pack_block_cache_key", "pack_mem_info", "TransferCacheParameters", "TransferCacheJob",
        "TransferAsyncThread", "transfer_cache_async", "layer_range_to_tensor_indices")],
]

# datadist's own public members, beyond the original's (README "datadist's own options" and
# docs/compatibility.md).
EXTRAS = {
    "LLMConfig": {"transport", "auth_secret", "verify_checksum", "tls_cert_file",
                  "tls_key_file", "tls_ca_file", "allow_ptrace", "max_connections",
                  "max_connections_per_peer", "nixl_serve", "nixl_allow_whole_process_access"},
    "LLMDataDist": {"engine", "listen_address", "last_link_failure"},
    "DataType": {"itemsize"},
    "CacheManager": {"pull_cache_async", "pull_blocks_async", "push_cache_async",
                     "push_blocks_async"},
    "KvCacheManager": {"pull_cache_async", "pull_blocks_async"},
}

ENUMS = {"LLMStatusCode", "LLMRole", "DataType", "Placement", "RegisterMemStatus", "Memtype"}


def _module(where: str):
    return datadist if not where else importlib.import_module(f"datadist.{where}")


def _resolve(where: str, name: str):
    owner, _, attr = name.rpartition(".")
    if not owner:
        return None, getattr(_module(where), name)
    cls = getattr(_module(where), owner)
    return cls, inspect.getattr_static(cls, attr)


def _sig(obj) -> str:
    sig = inspect.signature(obj)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def _id(row) -> str:
    return f"{row[0] or 'datadist'}:{row[1]}"


@pytest.mark.parametrize("row", T, ids=_id)
def test_original_name_has_its_kind_and_signature(row):
    where, name, kind, signature, source = row
    cls, obj = _resolve(where, name)
    if kind == "class":
        assert isinstance(obj, type), source
        if signature is None:
            assert obj.__name__ in INTERNAL_CTORS
        else:
            assert _sig(obj) == signature, source
    elif kind in ("method", "function"):
        assert inspect.isfunction(obj), source
        assert _sig(obj) == signature, source
    elif kind == "static":
        assert isinstance(obj, staticmethod), source
        assert _sig(obj.__func__) == signature, source
    elif kind == "classmethod":
        assert isinstance(obj, classmethod), source
        assert _sig(getattr(cls, name.rpartition(".")[2])) == signature, source
    elif kind in ("ro", "rw"):
        assert isinstance(obj, property), source
        assert (obj.fset is not None) == (kind == "rw"), f"{source}: settable is {kind == 'rw'}"
    elif kind in ("attr", "value"):
        assert obj is not None or kind == "attr", source
    else:  # pragma: no cover - a typo in the table
        raise AssertionError(kind)


def _public_members(cls: type) -> set[str]:
    """Public names datadist's own classes define (inherited from builtins/ABC excluded)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("datadist"):
            names |= {n for n in vars(klass) if not n.startswith("_")}
    return names


CLASSES = sorted({(row[0], row[1]) for row in T if row[2] == "class"})


@pytest.mark.parametrize(("where", "cls_name"), CLASSES, ids=[c[1] for c in CLASSES])
def test_no_member_beyond_the_original_but_documented_extras(where, cls_name):
    cls = getattr(_module(where), cls_name)
    table = {row[1].partition(".")[2] for row in T
             if row[0] == where and row[1].startswith(cls_name + ".")}
    extra = _public_members(cls) - table - EXTRAS.get(cls_name, set())
    assert not extra, f"{cls_name} has public members llm_datadist lacks: {sorted(extra)}"
    missing = table - _public_members(cls)
    assert not missing


def test_instance_attributes():
    # hixl v2/llm_types.py TransferConfig.__init__ (dst_layer_range = None) and
    # TransferWithCacheKeyConfig.__init__ (dst_cluster_id = cache_key.cluster_id).
    assert datadist.TransferConfig(3, [8, 16]).dst_layer_range is None
    cfg = datadist.TransferWithCacheKeyConfig(datadist.BlocksCacheKey(9), range(1), range(1))
    assert cfg.dst_cluster_id == 9
    # hixl v2/llm_datadist.py LLMDataDist.llm_engine_instance: None until an init.
    assert datadist.LLMDataDist.llm_engine_instance is None


def test_module_all_lists_only_table_names():
    # A module's __all__ (datadist's) names only what the table says the original has.
    table: dict[str, set[str]] = {}
    for where, name, _kind, _sig_text, _src in T:
        table.setdefault(where, set()).add(name.partition(".")[0])
    for where in ("status", "configs", "data_type", "utils.log", "utils.utils",
                  "v2.llm_utils", "v2.cache_manager", "v2.llm_datadist"):
        module = _module(where)
        names = set(module.__all__)
        for name in names:
            assert name in table.get(where, set()) or hasattr(datadist, name), (where, name)


def test_llm_types_all_is_the_originals():
    # hixl v2/llm_types.py __all__, in its order.
    import datadist.v2.llm_types as t

    assert t.__all__ == ["CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "KvCache",
                         "BlocksCacheKey", "Placement", "CacheTask", "TransferConfig",
                         "LayerSynchronizer", "Cache"]
    for name in ("RegisterMemStatus", "Memtype", "MemInfo", "TransferWithCacheKeyConfig"):
        assert getattr(t, name) is getattr(datadist, name)


def test_v2_list_is_the_originals():
    # hixl __init__.py v2_list: __all__ less the three v1 names, in order.
    assert datadist.v2_list == [n for n in datadist.__all__
                                if n not in ("TensorDesc", "Tensor", "KvCacheManager")]
    assert len(datadist.v2_list) == 23


@pytest.mark.parametrize("row", ABSENT, ids=lambda r: f"{r[0]}:{r[1]}")
def test_every_left_out_name_is_documented(row):
    where, name, source = row
    assert not hasattr(_module(where), name), f"{name} exists now: move it into the table"
    assert f"`{name}`" in DOC.read_text(), f"docs/compatibility.md must explain {source}"


@pytest.mark.parametrize("name", sorted(ENUMS))
def test_enums_have_no_member_beyond_their_values(name):
    # hixl status.py LLMStatusCode, configs.py LLMRole, data_type.py DataType,
    # v2/llm_types.py Placement, RegisterMemStatus, Memtype: values and __str__ only (the
    # values themselves: tests/compat/test_enums.py).
    cls = getattr(datadist, name)
    assert issubclass(cls, enum.Enum)
    extra = {k for k in vars(cls) if not k.startswith("_") and k not in cls.__members__}
    assert extra == EXTRAS.get(name, set())
