"""``LLMConfig`` (alias ``LlmConfig``) and ``LLMClusterInfo``, as in llm_datadist.

``LLMConfig.generate_options()`` emits exactly llm_datadist's option keys; ``init`` also accepts
a hand-written dict of them. datadist's own extras (``transport``, ``auth_secret``,
``verify_checksum``, TLS files, connection caps, NIXL serving) are generated from the core's
option table (cpp/src/options.h), which also parses them at init, for both APIs.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import TYPE_CHECKING, Any

from datadist.api.checks import check_int, check_isinstance
from datadist.api.status import LLMException, LLMStatusCode
from datadist.core import config as core_config
from datadist.core import options as core_options
from datadist.core.address import format_host_port, ipv6_literal
from datadist.core.errors import InvalidArgument

OPT_DEVICE_ID = "ge.exec.deviceId"
OPT_SESSION_DEVICE_ID = "ge.session_device_id"
OPT_LISTEN_IP_INFO = "llm.listenIpInfo"
OPT_SYNC_KV_WAIT = "llm.SyncKvCacheWaitTime"
OPT_ENABLE_CACHE_MANAGER = "llm.EnableCacheManager"
OPT_REMOTE_CACHE_ACCESSIBLE = "llm.EnableRemoteCacheAccessible"
OPT_MEM_POOL = "llm.MemPoolConfig"
OPT_HOST_MEM_POOL = "llm.HostMemPoolConfig"
OPT_BUF_POOL = "llm.BufPoolCfg"
OPT_SWITCH_ROLE = "llm.EnableSwitchRole"
OPT_LINK_TOTAL_TIME = "llm.LinkTotalTime"
OPT_LINK_RETRY_COUNT = "llm.LinkRetryCount"
OPT_RDMA_TC = "llm.RdmaTrafficClass"
OPT_RDMA_SL = "llm.RdmaServiceLevel"
OPT_LOCAL_COMM_RES = "llm.LocalCommRes"
OPT_TRANSFER_BACKEND = "llm.TransferBackend"
OPT_GLOBAL_RESOURCE = "llm.GlobalResourceConfig"
OPT_MEM_UTILIZATION = "llm.MemoryUtilization"
OPT_DEPLOY_RES_PATH = "llm.deployResPath"
OPT_CLUSTER_INFO = "llm.ClusterInfo"
OPT_OUTPUT_MAX_SIZE = "llm.OutputMaxSize"
# datadist's own options: their keys, variables, values, defaults and messages are the core's
# option table (cpp/src/options.h, ``_core.options()``); LLMConfig's extras are generated from it.
OPT_TRANSPORT = core_config.OPT_TRANSPORT
OPT_NIXL_SERVE = core_config.OPT_NIXL_SERVE
OPT_NIXL_WHOLE_PROCESS = core_config.OPT_NIXL_WHOLE_PROCESS
OPT_AUTH_SECRET = core_config.OPT_AUTH_SECRET
OPT_VERIFY = core_config.OPT_VERIFY
OPT_ALLOW_PTRACE = core_config.OPT_ALLOW_PTRACE
OPT_TLS_CERT = core_config.OPT_TLS_CERT
OPT_TLS_KEY = core_config.OPT_TLS_KEY
OPT_TLS_CA = core_config.OPT_TLS_CA
OPT_MAX_CONNECTIONS = core_config.OPT_MAX_CONNECTIONS
OPT_MAX_CONNECTIONS_PER_PEER = core_config.OPT_MAX_CONNECTIONS_PER_PEER


def _param_invalid(msg: str) -> LLMException:
    return LLMException(msg, status_code=LLMStatusCode.LLM_PARAM_INVALID)


def ip_value(ip: str | int) -> int | str:
    """An ip as ``LLMClusterInfo`` keeps it: IPv4 (dotted, or already an int) as the
    little-endian uint32 llm_datadist stores (inet_aton order); IPv6, which no uint32 holds,
    as its short-form literal (``"::1"``). Anything else: RuntimeError("Can not parse ip
    str:..."), llm_datadist's error."""
    if isinstance(ip, int):
        # a bool too, kept as given: the original checks isinstance(ip, [str, int]) and keeps
        # an int as it is (configs.py LLMClusterInfo._check_inputs, trans_str_ip)
        check_int("ip", ip, "uint32", allow_none=False)
        return ip
    check_isinstance("ip", ip, (str, int), allow_none=False)
    v6 = ipv6_literal(ip)
    if v6 is not None:
        return v6
    try:
        return int(struct.unpack("<I", socket.inet_aton(ip))[0])
    except (OSError, ValueError):  # ValueError: an embedded NUL
        hint = (" (an IPv6 address is written without brackets or zone, e.g. '::1')"
                if ":" in ip else "")
        raise RuntimeError(f"Can not parse ip str:{ip}{hint}") from None


def ip_text(value: int | str) -> str:
    """The address to connect to for an ip :func:`ip_value` returned."""
    return value if isinstance(value, str) else socket.inet_ntoa(struct.pack("<I", value))


# --------------------------------------------------------------------------------------------
# checks of a raw option dict, run by ``LLMDataDist.init`` before anything starts: a bad value
# is LLMException PARAM_INVALID naming the option and the value, never a raw OverflowError or
# ValueError later on every pull.

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1


def _digits(value: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also accepts '²' or '٣', which ``int`` refuses or
    reads as another number."""
    return bool(value) and value.isascii() and value.isdigit()


def int_option(name: str, raw: str, lo: int, hi: int, unit: str = "") -> int:
    """``raw`` as an int in [lo, hi], else PARAM_INVALID naming ``name`` and the value."""
    if not _digits(raw) or not lo <= int(raw) <= hi:
        what = f" ({unit})" if unit else ""
        raise _param_invalid(f"{name} must be an integer in [{lo}, {hi}]{what}, got {raw!r}")
    return int(raw)


def link_total_time_s(opts: dict[str, str], environ: dict[str, str] | Any,
                      default: int) -> int:
    """``llm.LinkTotalTime`` seconds in [0, 2**32-1]; 0 (or unset) means
    ``HCCL_CONNECT_TIMEOUT``, else ``default``. A bad environment value is not ours to
    refuse: it is ignored with a warning."""
    seconds = int_option(OPT_LINK_TOTAL_TIME, opts.get(OPT_LINK_TOTAL_TIME, "0"), 0,
                         UINT32_MAX, "s")
    if seconds > 0:
        return seconds
    env = environ.get("HCCL_CONNECT_TIMEOUT", "")
    if env:
        if _digits(env) and 0 < int(env) <= UINT32_MAX:
            return int(env)
        import logging

        logging.getLogger(__name__).warning(
            "HCCL_CONNECT_TIMEOUT=%r is not an integer in [1, %d]: using %d s", env,
            UINT32_MAX, default)
    return default


def pool_bytes_option(name: str, raw: str) -> int:
    """A pool size in bytes given as a digit string (``ge.flowGraphMemMaxSize``): > 0 and
    below 2**48 (the pool counts 64 KiB pages in 32 bits, as ``PoolConfig.parse`` checks)."""
    return int_option(name, raw, 1, (UINT32_MAX << 16) - 1, "bytes")


class LLMConfig:
    """Options for ``LLMDataDist.init``; set properties, then ``generate_options()``.

    datadist's extras (``transport``, ``auth_secret``, ``verify_checksum``, ...) are made
    from the core's option table (``_core.options()``, cpp/src/options.h) below the class:
    one property per row with an LLMConfig name, checked by the core as init checks it.
    """

    if TYPE_CHECKING:  # the extras are generated (_add_extras): typed by the table at run time
        def __getattr__(self, name: str) -> Any: ...
        def __setattr__(self, name: str, value: Any) -> None: ...

    def __init__(self) -> None:
        self._options: dict[str, str] = {}
        self._device_id: int | list[int] | tuple[int, ...] | None = None
        self._listen_ip_info: str | None = ""
        self._sync_kv_timeout: int | str | None = None
        self._ge_options: dict[str, str] = {}
        self._enable_cache_manager: bool | None = None
        self._enable_remote_cache_accessible: bool | None = None
        self._mem_pool_cfg: str | None = ""
        self._host_mem_pool_cfg: str | None = ""
        self._buf_pool_cfg: str | None = ""
        self._enable_switch_role: bool | None = False
        self._link_total_time: int | None = None
        self._link_retry_count: int | None = None
        self._rdma_traffic_class: int | None = None
        self._rdma_service_level: int | None = None
        self._local_comm_res: str | None = None
        self._transfer_backend: str | None = None
        self._global_resource_config: str | None = None
        self._mem_utilization = 0.95
        self._deploy_res_path: str | None = ""
        self._cluster_info = ""
        self._output_max_size: int | None = None
        # datadist's extras set so far, by option key: their parsed values (_Extra)
        self._extras: dict[str, bool | int | str] = {}

    # -- device and addresses

    @property
    def device_id(self) -> int | list[int] | tuple[int, ...] | None:
        """Device id(s): an int, or a list/tuple of them (default unset). Emits
        ``ge.exec.deviceId`` (ids joined by ';') and ``ge.session_device_id`` (the first)."""
        return self._device_id

    @device_id.setter
    def device_id(self, value: int | list[int] | tuple[int, ...]) -> None:
        # The original's setter (llm_datadist/configs.py) checks with plain isinstance, so a
        # bool is an int there: True is accepted and the options carry "True" (str(True)).
        if not isinstance(value, bool):
            check_isinstance("device_id", value, (int, list, tuple), allow_none=False)
        ids = list(value) if isinstance(value, (list, tuple)) else [value]
        if not ids:
            raise _param_invalid("device_id list must not be empty")
        for i in ids:
            if not isinstance(i, bool):
                check_int("device_id", i, "int32", allow_none=False)
            if i < 0:
                raise _param_invalid(f"device_id should be greater than or equal to zero. "
                                     f"(got {i})")
        self._device_id = value

    @property
    def listen_ip_info(self) -> str | None:
        """``'ip:port'`` this process listens on to be linked to (a PROMPT's, default "": not
        listening). Emits ``llm.listenIpInfo``."""
        return self._listen_ip_info

    @listen_ip_info.setter
    def listen_ip_info(self, value: str | None) -> None:
        check_isinstance("listen_ip_info", value, str, allow_none=True)  # None: unset
        self._listen_ip_info = value

    @property
    def sync_kv_timeout(self) -> int | str | None:
        """Milliseconds a pull or push may take, an int or digit string > 0 (default unset:
        1000 ms). Emits ``llm.SyncKvCacheWaitTime``."""
        return self._sync_kv_timeout

    @sync_kv_timeout.setter
    def sync_kv_timeout(self, value: int | str) -> None:
        check_isinstance("sync_kv_timeout", value, (int, str), allow_none=False)
        if isinstance(value, str):
            if not _digits(value):
                raise _param_invalid(f"sync_kv_timeout must be digit. (got {value!r})")
            number = int(value)
        else:
            number = value
        check_int("sync_kv_timeout", number, "int32", allow_none=False)
        if number <= 0:
            raise _param_invalid(f"sync_kv_timeout should be greater than zero. (got {number})")
        self._sync_kv_timeout = value

    @property
    def ge_options(self) -> dict[str, str]:
        """Extra options (str to str), copied first into the generated options (default {})."""
        return self._ge_options

    @ge_options.setter
    def ge_options(self, value: dict[str, str]) -> None:
        check_isinstance("ge_options", value, dict, allow_none=False)
        for k, v in value.items():
            check_isinstance("ge_options key", k, str, allow_none=False)
            check_isinstance("ge_options value", v, str, allow_none=False)
        self._ge_options = value

    # -- modes

    def _bool(self, name: str, value: bool | None) -> bool | None:
        check_isinstance(name, value, bool, allow_none=True)  # None: unset
        return value

    @property
    def enable_cache_manager(self) -> bool:
        """Cache-manager mode (``LLMDataDist.cache_manager``); default False (unset: not
        emitted). Emits ``llm.EnableCacheManager`` "1"/"0"."""
        return bool(self._enable_cache_manager)

    @enable_cache_manager.setter
    def enable_cache_manager(self, value: bool | None) -> None:
        self._enable_cache_manager = self._bool("enable_cache_manager", value)

    @property
    def enable_remote_cache_accessible(self) -> bool:
        """Make this process's caches reachable by address from linked peers (raw-address
        writes of ``transfer_cache_async``); default False (unset: not emitted). Emits
        ``llm.EnableRemoteCacheAccessible`` "1"/"0"."""
        return bool(self._enable_remote_cache_accessible)

    @enable_remote_cache_accessible.setter
    def enable_remote_cache_accessible(self, value: bool | None) -> None:
        self._enable_remote_cache_accessible = self._bool("enable_remote_cache_accessible", value)

    @property
    def enable_switch_role(self) -> bool | None:
        """Allow ``switch_role`` (default False). Emits ``llm.EnableSwitchRole`` "1" when true."""
        return self._enable_switch_role

    @enable_switch_role.setter
    def enable_switch_role(self, value: bool | None) -> None:
        self._enable_switch_role = self._bool("enable_switch_role", value)

    # -- pools

    def _pool(self, name: str, value: str | None, *, buf: bool = False) -> str | None:
        check_isinstance(name, value, str, allow_none=True)  # None: unset
        if value:
            try:
                cfg = json.loads(value)
            except ValueError:
                raise _param_invalid(f"{name} must be JSON, got {value!r}") from None
            key = "buf_cfg" if buf else "memory_size"
            if not isinstance(cfg, dict) or key not in cfg:
                raise _param_invalid(f"{name} must be a JSON object with {key!r}")
        return value

    @property
    def mem_pool_cfg(self) -> str | None:
        """JSON of the device memory pool, ``{"memory_size": bytes}`` (default "": none).
        Emits ``llm.MemPoolConfig``."""
        return self._mem_pool_cfg

    @mem_pool_cfg.setter
    def mem_pool_cfg(self, value: str | None) -> None:
        self._mem_pool_cfg = self._pool("mem_pool_cfg", value)

    @property
    def host_mem_pool_cfg(self) -> str | None:
        """JSON of the host memory pool, ``{"memory_size": bytes}`` (default "": none).
        Emits ``llm.HostMemPoolConfig``."""
        return self._host_mem_pool_cfg

    @host_mem_pool_cfg.setter
    def host_mem_pool_cfg(self, value: str | None) -> None:
        self._host_mem_pool_cfg = self._pool("host_mem_pool_cfg", value)

    @property
    def buf_pool_cfg(self) -> str | None:
        """JSON of the legacy-mode buffer pool tiers, ``{"buf_cfg": [...]}`` (default "": none).
        Emits ``llm.BufPoolCfg``."""
        return self._buf_pool_cfg

    @buf_pool_cfg.setter
    def buf_pool_cfg(self, value: str | None) -> None:
        self._buf_pool_cfg = self._pool("buf_pool_cfg", value, buf=True)

    # -- link tuning (accepted and emitted; HCCL/RDMA knobs have no effect on TCP)

    @property
    def link_total_time(self) -> int:
        """Seconds a link may take, in [0, 2**32-1] (default 0: ``HCCL_CONNECT_TIMEOUT``, else
        120). Emits ``llm.LinkTotalTime`` once set."""
        return self._link_total_time or 0

    @link_total_time.setter
    def link_total_time(self, value: int) -> None:
        # A documented [0, 2**32-1] range, not a C type: out of range is PARAM_INVALID.
        check_isinstance("link_total_time", value, int, allow_none=False)
        if not 0 <= value <= 2**32 - 1:
            raise _param_invalid("link_total_time should be an integer between [0, 2^32-1], "
                                 f"given value is {value}")
        self._link_total_time = value

    @property
    def link_retry_count(self) -> int:
        """Link attempts, in [1, 100] (default 1). Emits ``llm.LinkRetryCount`` once set."""
        return self._link_retry_count or 1

    @link_retry_count.setter
    def link_retry_count(self, value: int) -> None:
        check_isinstance("link_retry_count", value, int, allow_none=False)
        if not 1 <= value <= 100:
            raise _param_invalid("link_retry_count should be an integer between [1, 100], "
                                 f"given value is {value}")
        self._link_retry_count = value

    @property
    def rdma_traffic_class(self) -> int | None:
        """RDMA traffic class, a uint32 (default unset); accepted, no effect on TCP. Emits
        ``llm.RdmaTrafficClass``."""
        return self._rdma_traffic_class

    @rdma_traffic_class.setter
    def rdma_traffic_class(self, value: int) -> None:
        check_int("rdma_traffic_class", value, "uint32", allow_none=False)
        self._rdma_traffic_class = value

    @property
    def rdma_service_level(self) -> int | None:
        """RDMA service level, a uint32 (default unset); accepted, no effect on TCP. Emits
        ``llm.RdmaServiceLevel``."""
        return self._rdma_service_level

    @rdma_service_level.setter
    def rdma_service_level(self, value: int) -> None:
        check_int("rdma_service_level", value, "uint32", allow_none=False)
        self._rdma_service_level = value

    # -- backends

    @property
    def local_comm_res(self) -> str:
        """Local communication resources, as LLM-DataDist takes them (default "", unset).
        Emits ``llm.LocalCommRes`` once set, even to "", which selects cache-manager mode with
        ``enable_remote_cache_accessible`` on unless that is set (so ``pull_cache`` takes
        ``CacheKeyByIdAndIndex``, not ``CacheKey``): docs/modes.md."""
        return self._local_comm_res or ""

    @local_comm_res.setter
    def local_comm_res(self, value: str | None) -> None:
        check_isinstance("local_comm_res", value, str, allow_none=True)  # None: unset
        self._local_comm_res = value

    @property
    def transfer_backend(self) -> str:
        """Transfer backend name (default "", unset). Emits ``llm.TransferBackend`` once set."""
        return self._transfer_backend or ""

    @transfer_backend.setter
    def transfer_backend(self, value: str | None) -> None:
        check_isinstance("transfer_backend", value, str, allow_none=True)  # None: unset
        self._transfer_backend = value

    @property
    def global_resource_config(self) -> str:
        """Global resource configuration (default "", unset). Emits
        ``llm.GlobalResourceConfig`` once set."""
        return self._global_resource_config or ""

    @global_resource_config.setter
    def global_resource_config(self, value: str | None) -> None:
        check_isinstance("global_resource_config", value, str, allow_none=True)  # None: unset
        self._global_resource_config = value

    # -- v1 / offline options

    @property
    def mem_utilization(self) -> float:
        """Share of device memory to use, a float in [0, 1] (default 0.95). Always emits
        ``llm.MemoryUtilization``."""
        return self._mem_utilization

    @mem_utilization.setter
    def mem_utilization(self, value: float) -> None:
        # A float, as in llm_datadist: 1 (an int) is a TypeError.
        check_isinstance("mem_utilization", value, float, allow_none=False)
        if not 0.0 <= value <= 1.0:
            raise _param_invalid(f"mem_utilization must be in range [0,1], current:{value}")
        self._mem_utilization = value

    @property
    def deploy_res_path(self) -> str | None:
        """Deployment resource path (default "": not emitted). Emits ``llm.deployResPath``."""
        return self._deploy_res_path

    @deploy_res_path.setter
    def deploy_res_path(self, value: str | None) -> None:
        check_isinstance("deploy_res_path", value, str, allow_none=True)  # None: unset
        self._deploy_res_path = value

    @property
    def cluster_info(self) -> str:
        """Legacy-mode cluster JSON; its ``listen_ip_info`` IPs are stored as integers (default
        ""). Emits ``llm.ClusterInfo``."""
        return self._cluster_info

    @cluster_info.setter
    def cluster_info(self, value: str) -> None:
        check_isinstance("cluster_info", value, str, allow_none=False)
        try:
            info = json.loads(value)
        except ValueError:
            raise _param_invalid("cluster_info must be JSON") from None
        items = info.get("listen_ip_info", []) if isinstance(info, dict) else []
        if not isinstance(items, list):
            raise _param_invalid(f"cluster_info listen_ip_info must be a list, got {items!r}")
        for item in items:
            if isinstance(item, dict) and isinstance(item.get("ip"), str):
                item["ip"] = ip_value(item["ip"])
        self._cluster_info = json.dumps(info)

    @property
    def output_max_size(self) -> int | None:
        """Legacy-mode output size limit, an int64 (default unset). Emits ``llm.OutputMaxSize``."""
        return self._output_max_size

    @output_max_size.setter
    def output_max_size(self, value: int | None) -> None:
        check_int("output_max_size", value, "int64", allow_none=True)  # None: unset
        self._output_max_size = value

    @property
    def options(self) -> dict[str, str]:
        """The dict ``generate_options`` fills and returns (the same dict every time)."""
        return self._options

    # -- output

    def generate_options(self) -> dict[str, str]:
        """The init options. Returns (and accumulates into) the same dict every time.

        Emits what llm_datadist emits, in its order: a string option set to "" is left out,
        except ``local_comm_res``, ``transfer_backend`` and ``global_resource_config``, which
        are emitted once set, even to "" (``llm.LocalCommRes`` = "" selects cache-manager
        mode). datadist's own options come last.
        """
        o = self._options
        if self._ge_options:
            o.update(self._ge_options)
        if self._device_id is not None:
            if isinstance(self._device_id, int):
                o[OPT_DEVICE_ID] = str(self._device_id)
                o[OPT_SESSION_DEVICE_ID] = str(self._device_id)
            else:
                o[OPT_SESSION_DEVICE_ID] = str(self._device_id[0])
                o[OPT_DEVICE_ID] = ";".join(str(i) for i in self._device_id)
        if self._sync_kv_timeout is not None:
            o[OPT_SYNC_KV_WAIT] = str(self._sync_kv_timeout)
        if self._deploy_res_path:
            o[OPT_DEPLOY_RES_PATH] = self._deploy_res_path
        # memory
        if self._buf_pool_cfg:
            o[OPT_BUF_POOL] = self._buf_pool_cfg
        if self._mem_pool_cfg:
            o[OPT_MEM_POOL] = self._mem_pool_cfg
        if self._host_mem_pool_cfg:
            o[OPT_HOST_MEM_POOL] = self._host_mem_pool_cfg
        if self._enable_cache_manager is not None:
            o[OPT_ENABLE_CACHE_MANAGER] = "1" if self._enable_cache_manager else "0"
        if self._enable_remote_cache_accessible is not None:
            o[OPT_REMOTE_CACHE_ACCESSIBLE] = "1" if self._enable_remote_cache_accessible else "0"
        # connections
        if self._listen_ip_info:
            o[OPT_LISTEN_IP_INFO] = self._listen_ip_info
        if self._link_total_time is not None:
            o[OPT_LINK_TOTAL_TIME] = str(self._link_total_time)
        if self._link_retry_count is not None:
            o[OPT_LINK_RETRY_COUNT] = str(self._link_retry_count)
        if self._rdma_traffic_class is not None:
            o[OPT_RDMA_TC] = str(self._rdma_traffic_class)
        if self._rdma_service_level is not None:
            o[OPT_RDMA_SL] = str(self._rdma_service_level)
        if self._local_comm_res is not None:
            o[OPT_LOCAL_COMM_RES] = self._local_comm_res
        if self._transfer_backend is not None:
            o[OPT_TRANSFER_BACKEND] = self._transfer_backend
        if self._global_resource_config is not None:
            o[OPT_GLOBAL_RESOURCE] = self._global_resource_config
        # offline (v1)
        if self._cluster_info:
            o[OPT_CLUSTER_INFO] = self._cluster_info
        if self._output_max_size is not None:
            o[OPT_OUTPUT_MAX_SIZE] = str(self._output_max_size)
        if self._enable_switch_role:
            o[OPT_SWITCH_ROLE] = "1"
        o[OPT_MEM_UTILIZATION] = str(self._mem_utilization)
        # datadist's own, as the table writes them; a bool at its default is left out, so
        # that its environment variable still applies
        for extra in _EXTRAS:
            if extra.spec.key in self._extras:
                value = self._extras[extra.spec.key]
                if extra.spec.kind != "bool" or extra.text(value) != extra.spec.default:
                    o[extra.spec.key] = extra.text(value)
        return o

    gen_options = generate_options


class _Extra:
    """One of datadist's extras of LLMConfig, made from a row of the core's option table:
    its property (getter: the value set, else the table's default; setter: the Python type
    of its kind, then the core's check of the value, LLMException PARAM_INVALID with the
    table's message; None, or "" for a text, unsets it) and how ``generate_options`` writes
    it."""

    _TYPES: dict[str, type] = {"bool": bool, "int": int}

    def __init__(self, spec: core_options.OptionSpec) -> None:
        self.spec = spec
        self.default = core_options.check_option(spec.key, spec.default)

    @staticmethod
    def text(value: bool | int | str) -> str:
        """The option's text for a value ("1" / "0" for a bool)."""
        if isinstance(value, bool):
            return "1" if value else "0"
        return str(value)

    def doc(self) -> str:
        s = self.spec
        where = f"Option ``{s.key}``" + (f", or the environment variable ``{s.env}``"
                                         if s.env else "")
        if s.kind == "enum":
            accepted = f" One of {', '.join(s.values)}."
        elif s.range is not None:
            unit = f" {s.unit}" if s.unit else ""
            accepted = f" An int in [{s.range[0]}, {s.range[1]}]{unit}."
        else:
            accepted = ""
        return (f"datadist extra: {s.doc}{accepted} {where}. Default {self.default!r}; None "
                "unsets it.")

    def get(self, config: LLMConfig) -> bool | int | str:
        return config._extras.get(self.spec.key, self.default)

    def set(self, config: LLMConfig, value: bool | int | str | None) -> None:
        s = self.spec
        if value is None:
            config._extras.pop(s.key, None)
            return
        # TypeError for another type. A bool is not an int here: these are datadist's own
        # settings (a connection cap of True is a mistake), not the original's int arguments,
        # which take a bool as its isinstance checks do.
        if isinstance(value, bool) and s.kind == "int":
            raise TypeError(f"{s.attr} only support ['int'], but got {type(value)}.")
        check_isinstance(s.attr, value, self._TYPES.get(s.kind, str), allow_none=False)
        if value == "":
            config._extras.pop(s.key, None)
            return
        try:
            config._extras[s.key] = core_options.check_option(s.key, self.text(value))
        except InvalidArgument as e:
            raise _param_invalid(str(e)) from None


def _add_extras() -> tuple[_Extra, ...]:
    """LLMConfig's extras, one property per row of the core's table with an LLMConfig name;
    none where the core is not built (init then says why it cannot run)."""
    extras = tuple(_Extra(spec) for spec in core_options.option_table() if spec.attr)
    for extra in extras:
        setattr(LLMConfig, extra.spec.attr,
                property(extra.get, extra.set, doc=extra.doc()))
    return extras


_EXTRAS = _add_extras()

LlmConfig = LLMConfig


class LLMClusterInfo:
    """A remote cluster to link with: its id and the addresses to use."""

    def __init__(self) -> None:
        self._remote_cluster_id: int | None = None
        self._remote_role_type: int | None = None  # an LLMRole (an int) once set
        # (ip, port): an IPv4 ip as llm_datadist's uint32, an IPv6 one as its literal
        self._local_ip_info_list: list[tuple[int | str, int]] = []
        self._remote_ip_info_list: list[tuple[int | str, int]] = []

    @property
    def remote_cluster_id(self) -> int | None:
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, value: int) -> None:
        check_int("remote_cluster_id", value, "uint64", allow_none=False)
        self._remote_cluster_id = value

    @property
    def remote_role_type(self) -> int | None:
        return self._remote_role_type

    @remote_role_type.setter
    def remote_role_type(self, value: int) -> None:
        check_isinstance("remote_role_type", value, int, allow_none=False)
        self._remote_role_type = value

    def append_local_ip_info(self, ip: str | int, port: int) -> None:
        check_int("port", port, "uint16", allow_none=False)
        self._local_ip_info_list.append((ip_value(ip), port))

    def append_remote_ip_info(self, ip: str | int, port: int) -> None:
        check_int("port", port, "uint16", allow_none=False)
        self._remote_ip_info_list.append((ip_value(ip), port))

    @property
    def local_ip_info_list(self) -> list[tuple[int | str, int]]:
        return list(self._local_ip_info_list)

    @property
    def remote_ip_info_list(self) -> list[tuple[int | str, int]]:
        return list(self._remote_ip_info_list)

    def __repr__(self) -> str:
        remote = [format_host_port(ip_text(i), p) for i, p in self._remote_ip_info_list]
        return f"LLMClusterInfo(remote_cluster_id={self._remote_cluster_id}, remote={remote})"
