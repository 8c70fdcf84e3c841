"""Enum members, values and ``str`` forms of llm_datadist (spec §3 and §4.1)."""

from __future__ import annotations

import pytest

import datadist as llm_datadist
from datadist import DataType, LLMRole, LLMStatusCode, Memtype, Placement, RegisterMemStatus

# Spec §4.1, member by member.
STATUS_CODES = {
    "LLM_SUCCESS": 0,
    "LLM_FAILED": 0xFFFFFFFF,
    "LLM_WAIT_PROCESS_TIMEOUT": 0x5010B001,
    "LLM_KV_CACHE_NOT_EXIST": 0x5010B002,
    "LLM_REPEAT_REQUEST": 0x5010B003,
    "LLM_REQUEST_ALREADY_COMPLETED": 0x5010B004,
    "LLM_PARAM_INVALID": 0x5010B005,
    "LLM_ENGINE_FINALIZED": 0x5010B006,
    "LLM_NOT_YET_LINK": 0x5010B007,
    "LLM_ALREADY_LINK": 0x5010B008,
    "LLM_LINK_FAILED": 0x5010B009,
    "LLM_UNLINK_FAILED": 0x5010B00A,
    "LLM_NOTIFY_PROMPT_UNLINK_FAILED": 0x5010B00B,
    "LLM_CLUSTER_NUM_EXCEED_LIMIT": 0x5010B00C,
    "LLM_PROCESSING_LINK": 0x5010B00D,
    "LLM_DEVICE_OUT_OF_MEMORY": 0x5010B00E,
    "LLM_PREFIX_ALREADY_EXIST": 0x5010B00F,
    "LLM_PREFIX_NOT_EXIST": 0x5010B010,
    "LLM_SEQ_LENOVERLIMIT": 0x5010B011,  # sic
    "LLM_NO_FREE_BLOCK": 0x5010B012,
    "LLM_BLOCKS_OUT_OF_MEMORY": 0x5010B013,
    "LLM_EXIST_LINK": 0x5010B018,
    "LLM_FEATURE_NOT_ENABLED": 0x5010B019,
    "LLM_TIMEOUT": 0x5010B01A,
    "LLM_LINK_BUSY": 0x5010B01B,
    "LLM_OUT_OF_MEMORY": 0x5010B01C,
    "LLM_DEVICE_MEM_ERROR": 507053,
    "LLM_SUSPECT_REMOTE_ERROR": 507057,
    "LLM_UNKNOWN_ERROR": -1,
}


@pytest.mark.parametrize(("name", "value"), sorted(STATUS_CODES.items()))
def test_status_code_value(name, value):
    member = getattr(LLMStatusCode, name)
    assert member.name == name  # canonical, not an alias of another member
    assert member.value == value
    assert member == value  # an IntEnum compares with the native int
    assert LLMStatusCode(value) is member


def test_status_codes_are_exactly_the_spec_ones():
    assert {m.name for m in LLMStatusCode} == set(STATUS_CODES)


@pytest.mark.parametrize("name", sorted(STATUS_CODES))
def test_status_code_str(name):
    assert str(getattr(LLMStatusCode, name)) == f"LLMStatusCode.{name}"


def test_unknown_native_code_becomes_llm_failed():
    # hixl status.py code_2_status: any code not in the map is LLM_FAILED (what
    # handle_llm_status raises with) ...
    from datadist.status import code_2_status

    assert code_2_status(0x5010B014) is LLMStatusCode.LLM_FAILED  # CACHE_INCOMPATIBLE (C only)
    # ... while hixl status.py LLMException.__init__ and Status.__init__ keep the code given.
    e = llm_datadist.LLMException("x", status_code=0x5010B014)
    assert e.status_code == 0x5010B014
    assert llm_datadist.Status(12345).status_code == 12345
    assert llm_datadist.LLMException("x", status_code=0x5010B005).status_code is \
        LLMStatusCode.LLM_PARAM_INVALID
    assert llm_datadist.LLMException("x").status_code is LLMStatusCode.LLM_SUCCESS


@pytest.mark.parametrize(("member", "value"), [
    (LLMRole.PROMPT, 1), (LLMRole.DECODER, 2), (LLMRole.MIX, 3),
])
def test_llm_role(member, value):
    assert member.value == value and member == value
    assert str(member) == f"LLMRole.{member.name}"


def test_llm_role_members():
    assert [m.name for m in LLMRole] == ["PROMPT", "DECODER", "MIX"]


def test_placement():
    assert [(m.name, m.value) for m in Placement] == [("HOST", 0), ("DEVICE", 1)]
    assert str(Placement.DEVICE) == "Placement.DEVICE"
    assert str(Placement.HOST) == "Placement.HOST"
    assert Placement.DEVICE == 1


def test_register_mem_status():
    assert [(m.name, m.value) for m in RegisterMemStatus] == [
        ("OK", 0), ("PREPARING", 1), ("FAILED", 2)]
    assert str(RegisterMemStatus.OK) == "RegisterMemStatus.OK"


def test_memtype():
    assert [(m.name, m.value) for m in Memtype] == [("MEM_TYPE_DEVICE", 0), ("MEM_TYPE_HOST", 1)]
    assert str(Memtype.MEM_TYPE_HOST) == "Memtype.MEM_TYPE_HOST"


# Spec §3: the GE ints and the element sizes.
DATA_TYPES = {
    "DT_FLOAT": (0, 4), "DT_FLOAT16": (1, 2), "DT_INT8": (2, 1), "DT_INT32": (3, 4),
    "DT_UINT8": (4, 1), "DT_INT16": (6, 2), "DT_UINT16": (7, 2), "DT_UINT32": (8, 4),
    "DT_INT64": (9, 8), "DT_UINT64": (10, 8), "DT_DOUBLE": (11, 8), "DT_BOOL": (12, 1),
    "DT_STRING": (13, None), "DT_BF16": (27, 2),
}


def test_data_type_members_are_the_spec_ones():
    assert {m.name for m in DataType} == set(DATA_TYPES)


@pytest.mark.parametrize(("name", "value_size"), sorted(DATA_TYPES.items()))
def test_data_type(name, value_size):
    value, size = value_size
    member = getattr(DataType, name)
    assert member.value == value
    assert str(member) == f"DataType.{name}"
    if size is not None:
        # The element size is what CacheDesc.size multiplies by.
        desc = llm_datadist.CacheDesc(1, [3, 5], member, Placement.HOST)
        assert desc.size == 15 * size


def test_error_messages_name_the_code_beside_its_number():
    """llm_datadist's message prefix ("<func> failed, error code is <n>, ") is kept; the code's
    name follows the number, so a reader need not look 1343270919 up."""
    from datadist.api.status import LLMStatusCode, llm_errors
    from datadist.core.errors import Code, DatadistError

    with pytest.raises(llm_datadist.LLMException) as info, llm_errors("pull_cache"):
        raise DatadistError("cluster 7 is not linked", code=Code.NOT_YET_LINK)
    msg = str(info.value)
    assert msg.startswith(f"pull_cache failed, error code is {int(Code.NOT_YET_LINK)} "
                          "(LLM_NOT_YET_LINK), ")
    assert msg.endswith("cluster 7 is not linked")
    assert info.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
