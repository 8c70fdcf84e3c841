"""``llm_datadist.utils.utils`` under its own name: argument checks with llm_datadist's
signatures and error kinds (TypeError for a type, ValueError for an int range). The checks
themselves are :mod:`datadist.api.checks`; here only the signatures differ: the integer
checks never allow None, and ``check_isinstance`` takes a list of classes, an inner class
for the items of a container, and a message prefix.
"""

from __future__ import annotations

from typing import Any

from datadist.api import checks


def check_inner(arg_name: str, arg_value: Any, inner_class: Any) -> None:
    for val in arg_value:
        if not checks.is_instance(val, inner_class):
            raise TypeError(f"{arg_name} inner type only support {[inner_class]}, "
                            f"but got {type(val)}.")


def check_dict(arg_name: str, arg_value: dict[Any, Any], k_class: Any, v_class: Any,
               v_inner_class: Any = None) -> None:
    for k, v in arg_value.items():
        if not checks.is_instance(k, k_class):
            raise TypeError(f"{arg_name} dict key only support {k_class}, but got {type(k)}.")
        if not checks.is_instance(v, v_class):
            raise TypeError(f"{arg_name} dict value only support {v_class}, "
                            f"but got {type(v)}.")
        if v_inner_class is not None:
            check_inner("dict value", v, v_inner_class)


def check_isinstance(arg_name: str, arg_value: Any, classes: Any, inner_class: Any = None,
                     extra_fmt: str = "", allow_none: bool = True) -> Any:
    if allow_none and arg_value is None:
        return arg_value
    types = tuple(classes) if isinstance(classes, list) else (classes,)
    try:
        checks.check_isinstance(arg_name, arg_value, types, allow_none=False)
    except TypeError as e:
        raise TypeError(f"{extra_fmt}{e}") from None
    if inner_class:
        check_inner(arg_name, arg_value, inner_class)
    return arg_value


def check_uint64(arg_name: str, arg_value: Any) -> None:
    checks.check_int(arg_name, arg_value, "uint64", allow_none=False)


def check_int64(arg_name: str, arg_value: Any) -> None:
    checks.check_int(arg_name, arg_value, "int64", allow_none=False)


def check_int32(arg_name: str, arg_value: Any) -> None:
    checks.check_int(arg_name, arg_value, "int32", allow_none=False)


def check_uint32(arg_name: str, arg_value: Any) -> None:
    checks.check_int(arg_name, arg_value, "uint32", allow_none=False)


def check_uint16(arg_name: str, arg_value: Any) -> None:
    checks.check_int(arg_name, arg_value, "uint16", allow_none=False)


def check_uint8(arg_name: str, arg_value: Any) -> None:
    checks.check_int(arg_name, arg_value, "uint8", allow_none=False)


def check_list_int32(arg_name: str, arg_value: Any) -> None:
    for value in arg_value:
        check_int32(arg_name, value)


def check_list_int64(arg_name: str, arg_value: Any) -> None:
    for value in arg_value:
        check_int64(arg_name, value)


def check_list_uint64(arg_name: str, arg_value: Any) -> None:
    for value in arg_value:
        check_uint64(arg_name, value)


def check_positive_or_set_default(arg_name: str, arg_value: Any, default: int = -1) -> int:
    """None becomes ``default``; otherwise an int64 >= 0 (ValueError if negative)."""
    if arg_value is None:
        return default
    check_int64(arg_name, arg_value)
    if arg_value < 0:
        raise ValueError(f"{arg_name}'s value:{arg_value} is invalid, should be >= 0")
    value: int = arg_value  # an int64, checked above
    return value


__all__ = ["check_inner", "check_dict", "check_isinstance", "check_uint64", "check_int64",
           "check_int32", "check_uint32", "check_uint16", "check_uint8", "check_list_int32",
           "check_list_int64", "check_list_uint64", "check_positive_or_set_default"]
