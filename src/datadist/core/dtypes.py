"""Element types by their GE code, for messages in the caller's units.

The core moves bytes and sees a cache's data type only as the code in its layout tag
(:func:`datadist.core.layout.layout_tag`); this table turns the code back into the name the
caller used (``DT_BF16``) and an element size. It mirrors ``api.enums.DataType``, which the
core may not import (tests/api/test_caller_units.py holds the two equal).
"""

from __future__ import annotations

# code -> (name, bytes per element); DT_STRING has no fixed size (0)
DTYPES: dict[int, tuple[str, int]] = {
    0: ("DT_FLOAT", 4), 1: ("DT_FLOAT16", 2), 2: ("DT_INT8", 1), 3: ("DT_INT32", 4),
    4: ("DT_UINT8", 1), 6: ("DT_INT16", 2), 7: ("DT_UINT16", 2), 8: ("DT_UINT32", 4),
    9: ("DT_INT64", 8), 10: ("DT_UINT64", 8), 11: ("DT_DOUBLE", 8), 12: ("DT_BOOL", 1),
    13: ("DT_STRING", 0), 27: ("DT_BF16", 2),
}


def dtype_name(code: int) -> str:
    """``DT_BF16`` for 27; an unknown code reads as ``data type code N``."""
    entry = DTYPES.get(code)
    return entry[0] if entry else f"data type code {code}"


def tag_dtype(layout: int) -> int | None:
    """The dtype code in a layout tag; None when the tag is unknown (0)."""
    return (layout >> 32) - 1 if layout else None


def in_elements(nbytes: int, layout: int) -> str:
    """``4096 DT_FLOAT16 elements (8192 bytes)`` where the tag names a sized dtype that
    divides ``nbytes``; else ``8192 bytes``."""
    code = tag_dtype(layout)
    if code is None:
        return f"{nbytes} bytes"
    size = DTYPES.get(code, ("", 0))[1]
    if size and nbytes % size == 0:
        return f"{nbytes // size} {dtype_name(code)} elements ({nbytes} bytes)"
    return f"{nbytes} bytes"


__all__ = ["DTYPES", "dtype_name", "in_elements", "tag_dtype"]
