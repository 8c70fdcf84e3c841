"""``LLMConfig`` and ``LLMClusterInfo`` (spec §5 and §6): every property's default, the option
keys and values ``generate_options()`` emits, and the error each bad value raises at set time:
TypeError for a wrong type, ValueError for a C-integer range, LLMException(PARAM_INVALID) for a
documented range."""

from __future__ import annotations

import json
import socket

import pytest

from datadist import (
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)

MEM_UTIL = {"llm.MemoryUtilization": "0.95"}  # always emitted


def param_invalid():
    return pytest.raises(LLMException, check=lambda e: e.status_code
                         is LLMStatusCode.LLM_PARAM_INVALID)


def options_with(**props) -> dict[str, str]:
    cfg = LLMConfig()
    for k, v in props.items():
        setattr(cfg, k, v)
    return cfg.generate_options()


# ---------------------------------------------------------------------------------- defaults


def test_empty_config_emits_only_mem_utilization():
    assert LLMConfig().generate_options() == MEM_UTIL


def test_takes_no_arguments():
    with pytest.raises(TypeError):
        LLMConfig(device_id=0)


@pytest.mark.parametrize(("prop", "default"), [
    ("device_id", None), ("listen_ip_info", ""), ("sync_kv_timeout", None), ("ge_options", {}),
    ("enable_cache_manager", False), ("enable_remote_cache_accessible", False),
    ("mem_pool_cfg", ""), ("host_mem_pool_cfg", ""), ("buf_pool_cfg", ""),
    ("enable_switch_role", False), ("link_total_time", 0), ("link_retry_count", 1),
    ("rdma_traffic_class", None), ("rdma_service_level", None), ("local_comm_res", ""),
    ("transfer_backend", ""), ("global_resource_config", ""), ("mem_utilization", 0.95),
    ("deploy_res_path", ""), ("cluster_info", ""), ("output_max_size", None),
])
def test_getter_default(prop, default):
    assert getattr(LLMConfig(), prop) == default


# ---------------------------------------------------------------------------------- emitted keys


@pytest.mark.parametrize(("prop", "value", "emitted"), [
    ("device_id", 3, {"ge.exec.deviceId": "3", "ge.session_device_id": "3"}),
    ("device_id", [2, 5, 7], {"ge.exec.deviceId": "2;5;7", "ge.session_device_id": "2"}),
    ("device_id", (4,), {"ge.exec.deviceId": "4", "ge.session_device_id": "4"}),
    ("listen_ip_info", "10.0.0.1:26000", {"llm.listenIpInfo": "10.0.0.1:26000"}),
    ("listen_ip_info", "", {}),
    ("sync_kv_timeout", 33064, {"llm.SyncKvCacheWaitTime": "33064"}),
    ("sync_kv_timeout", "2000", {"llm.SyncKvCacheWaitTime": "2000"}),
    ("enable_cache_manager", True, {"llm.EnableCacheManager": "1"}),
    ("enable_cache_manager", False, {"llm.EnableCacheManager": "0"}),
    ("enable_remote_cache_accessible", True, {"llm.EnableRemoteCacheAccessible": "1"}),
    ("enable_remote_cache_accessible", False, {"llm.EnableRemoteCacheAccessible": "0"}),
    ("mem_pool_cfg", '{"memory_size": 1024}', {"llm.MemPoolConfig": '{"memory_size": 1024}'}),
    ("mem_pool_cfg", "", {}),
    ("host_mem_pool_cfg", '{"memory_size": 2048, "page_shift": 12}',
     {"llm.HostMemPoolConfig": '{"memory_size": 2048, "page_shift": 12}'}),
    ("buf_pool_cfg", '{"buf_cfg": []}', {"llm.BufPoolCfg": '{"buf_cfg": []}'}),
    ("enable_switch_role", True, {"llm.EnableSwitchRole": "1"}),
    ("enable_switch_role", False, {}),  # only emitted when True
    ("link_total_time", 0, {"llm.LinkTotalTime": "0"}),
    ("link_total_time", 2**32 - 1, {"llm.LinkTotalTime": "4294967295"}),
    ("link_retry_count", 80, {"llm.LinkRetryCount": "80"}),
    ("rdma_traffic_class", 132, {"llm.RdmaTrafficClass": "132"}),
    ("rdma_service_level", 4, {"llm.RdmaServiceLevel": "4"}),
    ("local_comm_res", "", {"llm.LocalCommRes": ""}),  # emitted even when ""
    ("local_comm_res", '{"version": "1.3"}', {"llm.LocalCommRes": '{"version": "1.3"}'}),
    ("transfer_backend", "hixl", {"llm.TransferBackend": "hixl"}),
    ("global_resource_config", '{"a": 1}', {"llm.GlobalResourceConfig": '{"a": 1}'}),
    ("deploy_res_path", "/tmp/res", {"llm.deployResPath": "/tmp/res"}),
    ("output_max_size", 4096, {"llm.OutputMaxSize": "4096"}),
])
def test_property_emits(prop, value, emitted):
    cfg = LLMConfig()
    setattr(cfg, prop, value)
    assert getattr(cfg, prop) == value
    assert cfg.generate_options() == {**emitted, **MEM_UTIL}


@pytest.mark.parametrize(("value", "text"), [(0.5, "0.5"), (0.0, "0.0"), (1.0, "1.0")])
def test_mem_utilization_emits_its_value(value, text):
    assert options_with(mem_utilization=value) == {"llm.MemoryUtilization": text}


def test_cluster_info_ips_become_little_endian_ints():
    info = {"cluster_id": 3, "listen_ip_info": [{"ip": "192.168.1.2", "port": 26000},
                                                {"ip": 1234, "port": 26001}]}
    cfg = LLMConfig()
    cfg.cluster_info = json.dumps(info)
    emitted = json.loads(cfg.generate_options()["llm.ClusterInfo"])
    assert emitted["listen_ip_info"] == [{"ip": 0x0201A8C0, "port": 26000},
                                         {"ip": 1234, "port": 26001}]
    assert emitted["cluster_id"] == 3
    assert json.loads(cfg.cluster_info) == emitted


def test_cluster_info_bad_ip_is_runtime_error():
    cfg = LLMConfig()
    with pytest.raises(RuntimeError, match="Can not parse ip str"):
        cfg.cluster_info = json.dumps({"listen_ip_info": [{"ip": "300.1.1.1", "port": 1}]})


def test_transport_extra():
    assert options_with(transport="tcp") == {"datadist.Transport": "tcp", **MEM_UTIL}
    with param_invalid():
        LLMConfig().transport = "rdma"
    with pytest.raises(TypeError):
        LLMConfig().transport = 1


def test_real_client_config_vllm_ascend_cmgr():
    cfg = LLMConfig()
    cfg.device_id = 1
    cfg.sync_kv_timeout = 33064
    cfg.enable_switch_role = True
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    assert cfg.generate_options() == {
        "ge.exec.deviceId": "1", "ge.session_device_id": "1",
        "llm.SyncKvCacheWaitTime": "33064", "llm.EnableSwitchRole": "1",
        "llm.EnableCacheManager": "1", "llm.EnableRemoteCacheAccessible": "1",
        "llm.MemoryUtilization": "0.95",
    }


def test_real_client_config_hixl_connector():
    cfg = LLMConfig()
    cfg.local_comm_res = ""
    cfg.transfer_backend = "hixl"
    cfg.listen_ip_info = "127.0.0.1:26000"
    cfg.link_total_time = 30
    cfg.link_retry_count = 3
    cfg.ge_options = {"ge.flowGraphMemMaxSize": "1024"}
    assert cfg.generate_options() == {
        "llm.LocalCommRes": "", "llm.TransferBackend": "hixl",
        "llm.listenIpInfo": "127.0.0.1:26000", "llm.LinkTotalTime": "30",
        "llm.LinkRetryCount": "3", "ge.flowGraphMemMaxSize": "1024",
        "llm.MemoryUtilization": "0.95",
    }


# ---------------------------------------------------------------------------------- the dict


def test_generate_options_returns_the_same_dict_every_time():
    cfg = LLMConfig()
    first = cfg.generate_options()
    assert cfg.generate_options() is first
    assert cfg.gen_options() is first
    assert cfg.options is first


def test_generate_options_accumulates():
    cfg = LLMConfig()
    cfg.ge_options = {"ge.a": "1"}
    opts = cfg.generate_options()
    opts["user.raw"] = "x"  # clients add raw keys to the returned dict
    cfg.ge_options = {"ge.b": "2"}
    cfg.device_id = 0
    again = cfg.generate_options()
    assert again is opts
    assert again == {"ge.a": "1", "ge.b": "2", "user.raw": "x", "ge.exec.deviceId": "0",
                     "ge.session_device_id": "0", "llm.MemoryUtilization": "0.95"}


def test_ge_options_are_merged_first_so_config_keys_win():
    cfg = LLMConfig()
    cfg.ge_options = {"ge.exec.deviceId": "9", "llm.listenIpInfo": "1.1.1.1:1", "ge.x": "y"}
    cfg.device_id = 2
    cfg.listen_ip_info = "2.2.2.2:2"
    opts = cfg.generate_options()
    assert opts["ge.exec.deviceId"] == "2"
    assert opts["llm.listenIpInfo"] == "2.2.2.2:2"
    assert opts["ge.x"] == "y"


def test_mem_utilization_wins_over_ge_options():
    cfg = LLMConfig()
    cfg.ge_options = {"llm.MemoryUtilization": "0.5"}
    # mem_utilization is always emitted, after ge_options, so it wins.
    assert cfg.generate_options() == {"llm.MemoryUtilization": "0.95"}


def test_options_is_read_only():
    with pytest.raises(AttributeError):
        LLMConfig().options = {}


# ---------------------------------------------------------------------------------- bad values


@pytest.mark.parametrize(("prop", "value"), [
    ("device_id", "0"), ("device_id", 1.0), ("device_id", None), ("device_id", [0, "1"]),
    ("device_id", {0: 1}),
    ("listen_ip_info", 26000),
    ("sync_kv_timeout", 1.5), ("sync_kv_timeout", None), ("sync_kv_timeout", [1]),
    ("ge_options", [("a", "b")]), ("ge_options", {"a": 1}), ("ge_options", {1: "a"}),
    ("ge_options", None),
    ("enable_cache_manager", 1), ("enable_cache_manager", "1"),
    ("enable_remote_cache_accessible", 1), ("enable_remote_cache_accessible", "True"),
    ("enable_switch_role", 1), ("enable_switch_role", "1"),
    ("mem_pool_cfg", {"memory_size": 1}), ("host_mem_pool_cfg", 1024),
    ("link_total_time", "5"), ("link_total_time", 1.0),
    ("link_retry_count", "5"), ("link_retry_count", 2.0),
    ("rdma_traffic_class", "132"), ("rdma_service_level", 4.0),
    ("local_comm_res", {}),
    ("global_resource_config", {"a": 1}),
    ("mem_utilization", "0.5"), ("mem_utilization", None),
    ("deploy_res_path", 1), ("cluster_info", {"a": 1}), ("output_max_size", "1"),
])
def test_wrong_type_is_type_error(prop, value):
    cfg = LLMConfig()
    before = cfg.generate_options().copy()
    with pytest.raises(TypeError):
        setattr(cfg, prop, value)
    assert cfg.generate_options() == before  # nothing stored


@pytest.mark.parametrize(("prop", "value"), [
    ("device_id", 2**31), ("device_id", [0, 2**31]),
    ("sync_kv_timeout", 2**31), ("sync_kv_timeout", str(2**31)),
    ("rdma_traffic_class", -1), ("rdma_traffic_class", 2**32),
    ("rdma_service_level", -1), ("rdma_service_level", 2**32),
])
def test_c_integer_range_is_value_error(prop, value):
    with pytest.raises(ValueError):
        setattr(LLMConfig(), prop, value)


@pytest.mark.parametrize(("prop", "value"), [
    ("device_id", -1), ("device_id", [0, -1]), ("device_id", []),
    ("sync_kv_timeout", 0), ("sync_kv_timeout", -5), ("sync_kv_timeout", "0"),
    ("sync_kv_timeout", "abc"), ("sync_kv_timeout", "-5"), ("sync_kv_timeout", "1.5"),
    ("link_total_time", -1), ("link_total_time", 2**32),
    ("link_retry_count", 0), ("link_retry_count", 101), ("link_retry_count", 2**40),
    ("mem_utilization", 1.5), ("mem_utilization", -0.1),
    ("mem_pool_cfg", "not json"), ("mem_pool_cfg", '{"page_shift": 16}'),
    ("host_mem_pool_cfg", "[1]"), ("buf_pool_cfg", '{"memory_size": 1}'),
    ("cluster_info", "not json"),
])
def test_documented_range_is_param_invalid(prop, value):
    cfg = LLMConfig()
    with param_invalid():
        setattr(cfg, prop, value)
    assert cfg.generate_options() == MEM_UTIL


@pytest.mark.parametrize(("prop", "value"), [
    ("device_id", 0), ("device_id", 2**31 - 1), ("sync_kv_timeout", 1),
    ("sync_kv_timeout", 2**31 - 1), ("link_retry_count", 1), ("link_retry_count", 100),
    ("mem_utilization", 0.0), ("mem_utilization", 1.0), ("rdma_traffic_class", 2**32 - 1),
])
def test_boundaries_are_accepted(prop, value):
    cfg = LLMConfig()
    setattr(cfg, prop, value)
    assert getattr(cfg, prop) == value


# ---------------------------------------------------------------------------------- LLMClusterInfo


def test_cluster_info_starts_empty():
    c = LLMClusterInfo()
    assert c.remote_cluster_id is None
    assert c.remote_role_type is None
    assert c.local_ip_info_list == []
    assert c.remote_ip_info_list == []


@pytest.mark.parametrize(("ip", "as_int"), [
    ("127.0.0.1", 0x0100007F),  # inet_aton bytes 7f 00 00 01, read little-endian
    ("192.168.1.2", 0x0201A8C0),
    ("0.0.0.0", 0),
    ("255.255.255.255", 0xFFFFFFFF),
    ("1.0.0.0", 1),
    (0x0100007F, 0x0100007F),  # an int is taken as already converted
])
def test_ip_converts_to_little_endian_uint32(ip, as_int):
    c = LLMClusterInfo()
    c.append_local_ip_info(ip, 26000)
    c.append_remote_ip_info(ip, 0)
    assert c.local_ip_info_list == [(as_int, 26000)]
    assert c.remote_ip_info_list == [(as_int, 0)]


def test_ip_infos_append_in_order():
    c = LLMClusterInfo()
    c.append_remote_ip_info("10.0.0.1", 1)
    c.append_remote_ip_info("10.0.0.2", 2)
    assert c.remote_ip_info_list == [(0x0100000A, 1), (0x0200000A, 2)]
    assert c.local_ip_info_list == []


@pytest.mark.parametrize("ip", ["not-an-ip", "256.1.1.1", "", "::1::", "1.2.3.4\x00"])
@pytest.mark.parametrize("side", ["append_local_ip_info", "append_remote_ip_info"])
def test_bad_ip_is_runtime_error(ip, side):
    c = LLMClusterInfo()
    with pytest.raises(RuntimeError, match="Can not parse ip str") as info:
        getattr(c, side)(ip, 80)
    assert not isinstance(info.value, LLMException)
    assert c.local_ip_info_list == [] and c.remote_ip_info_list == []


@pytest.mark.parametrize("ip", [1.5, None, b"127.0.0.1", ["127.0.0.1"]])
def test_ip_of_wrong_type_is_type_error(ip):
    with pytest.raises(TypeError):
        LLMClusterInfo().append_local_ip_info(ip, 80)


@pytest.mark.parametrize(("port", "error"), [
    (65536, ValueError), (-1, ValueError), ("80", TypeError), (80.0, TypeError),
    (None, TypeError),
])
@pytest.mark.parametrize("side", ["append_local_ip_info", "append_remote_ip_info"])
def test_port_must_be_uint16(port, error, side):
    c = LLMClusterInfo()
    with pytest.raises(error):
        getattr(c, side)("127.0.0.1", port)
    assert c.local_ip_info_list == [] and c.remote_ip_info_list == []


@pytest.mark.parametrize("port", [0, 65535])
def test_port_bounds_accepted(port):
    c = LLMClusterInfo()
    c.append_remote_ip_info("127.0.0.1", port)
    assert c.remote_ip_info_list[0][1] == port


def test_remote_cluster_id_is_uint64():
    c = LLMClusterInfo()
    c.remote_cluster_id = 2**64 - 1
    assert c.remote_cluster_id == 2**64 - 1
    c.remote_cluster_id = 0
    assert c.remote_cluster_id == 0
    for bad in (-1, 2**64):
        with pytest.raises(ValueError):
            c.remote_cluster_id = bad
    for bad in ("1", 1.0):
        with pytest.raises(TypeError):
            c.remote_cluster_id = bad
    assert c.remote_cluster_id == 0


def test_remote_role_type_takes_a_role_or_int():
    c = LLMClusterInfo()
    c.remote_role_type = LLMRole.PROMPT
    assert c.remote_role_type is LLMRole.PROMPT
    c.remote_role_type = 0
    assert c.remote_role_type == 0
    with pytest.raises(TypeError):
        c.remote_role_type = "PROMPT"


@pytest.mark.parametrize(("listen", "address"), [
    ("[::1]:0", "::1"), ("[0:0:0:0:0:0:0:1]:0", "::1"), ("[::]:0", "::"),
])
def test_ipv6_listen_address_in_brackets(listen, address):
    """The original's C++ API takes "[ipv6]:port" for its listen address (hicann/hixl
    src/llm_datadist/common/llm_utils.cc, LLMUtils::ParseListenIpInfo); datadist takes it in
    both APIs (issue 22 item 8). The listener binds it; the address comes back short."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    cfg = LLMConfig()
    cfg.local_comm_res = ""
    cfg.listen_ip_info = listen
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    dd.init(cfg.generate_options())
    try:
        host, port = dd.listen_address
        assert host == address and port > 0
    finally:
        dd.finalize()


@pytest.mark.parametrize(("listen", "why"), [
    ("::1:26000", r"written in brackets, e.g. '\[::1\]:26000'"),
    ("fe80::1:26000", "written in brackets"),
    ("[::1]", r"expected '\[ipv6\]:port'"), ("[::1]26000", r"expected '\[ipv6\]:port'"),
    ("[not-ip]:80", r"expected '\[ipv6\]:port'"), ("[fe80::1%eth0]:80", "ipv6"),
    ("[::1]:65536", "port in"), ("[::1]:x", "port in"),
])
def test_bad_ipv6_listen_address_is_param_invalid(listen, why):
    """The original refuses a bare IPv6 address with a port (more than one ':' outside
    brackets): LLM_PARAM_INVALID, with a message that shows the bracketed form."""
    cfg = LLMConfig()
    cfg.local_comm_res = ""
    cfg.listen_ip_info = listen
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(LLMException, match=why) as e:
        dd.init(cfg.generate_options())
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


@pytest.mark.parametrize(("ip", "kept"), [
    ("::1", "::1"), ("0:0:0:0:0:0:0:1", "::1"), ("FD00::2", "fd00::2"),
    ("::ffff:127.0.0.1", "::ffff:7f00:1"),
])
def test_ipv6_cluster_address_is_kept_as_its_literal(ip, kept):
    """No uint32 holds an IPv6 address: LLMClusterInfo keeps it as its short literal (an
    IPv4 one stays llm_datadist's uint32), and trans_str_ip does the same."""
    from datadist.configs import trans_str_ip

    info = LLMClusterInfo()
    info.append_remote_ip_info(ip, 26000)
    info.append_local_ip_info(ip, 0)
    info.append_remote_ip_info("127.0.0.1", 1)
    assert info.remote_ip_info_list == [(kept, 26000), (0x0100007F, 1)]
    assert info.local_ip_info_list == [(kept, 0)]
    assert trans_str_ip(ip) == kept
    assert f"[{kept}]:26000" in repr(info)


@pytest.mark.parametrize("ip", ["[::1]", "::1::2", "fe80::1%eth0", "::g", ":::"])
def test_bad_ipv6_cluster_address_keeps_the_original_error(ip):
    info = LLMClusterInfo()
    with pytest.raises(RuntimeError, match=r"^Can not parse ip str:"):
        info.append_remote_ip_info(ip, 26000)
    assert info.remote_ip_info_list == []
