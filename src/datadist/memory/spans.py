"""Which same-host copy suits a request out of a peer's shareable memory (a memfd).

Who calls: the rule's reference: the core applies it (cpp/src/shm.h) when it reads a peer's cache; once per request,
to decide whether to ask for a shared-memory grant. O(1) on top of one sum over the request's
span lengths (numpy); never blocks.

Two ways to copy out of an owner's memfd: map it and ``memmove`` span by span (shm: no system
call, no page pinning, but one Python-level call per span), or ``process_vm_readv``, one system
call per IOV_MAX spans (cma: the kernel walks and pins the owner's pages, every 4 KiB where the
memfd has no huge pages). Which is faster depends on the spans: few spans, shm; many spans,
shm as long as each is long enough that the per-span call is small beside its copy.

Measured (2 vCPU, memfd on 4 KiB pages as shmem_enabled=never leaves it, destination numpy
memory on transparent huge pages; GB/s, shm / cma, same run, medians of 7, with
``benchmarks/shm_vs_cma.py``):

    spans x bytes     shm    cma     spans x bytes     shm    cma
    256 x 4 KiB       4.6    7.6     8192 x 16 KiB     5.0    4.4
    1024 x 4 KiB      4.5    7.6     1024 x 32 KiB    10.7    9.3
    8192 x 4 KiB      3.9    5.7     8192 x 32 KiB     5.4    4.7
    1024 x 16 KiB     9.1   10.4     4096 x 64 KiB     6.6    5.7

So shm for up to SHM_MAX_SPANS spans whatever their length, and for any number of spans of
SHM_MIN_SPAN_BYTES or more on average; cma for many small spans.
"""

from __future__ import annotations

import numpy as np

SHM_MAX_SPANS = 256  # up to this many spans, shm whatever their length
SHM_MIN_SPAN_BYTES = 32 << 10  # above SHM_MAX_SPANS, shm when spans average this or more


def shm_pays(num_tensors: int, lengths: np.ndarray) -> bool:
    """Whether a request of ``lengths`` (bytes of each span, the same in every one of its
    ``num_tensors`` tensors) copies faster with shm than with cma (module docstring)."""
    spans = num_tensors * len(lengths)
    if spans <= SHM_MAX_SPANS:
        return True
    return int(np.sum(lengths, dtype=np.uint64)) >= SHM_MIN_SPAN_BYTES * len(lengths)


__all__ = ["SHM_MAX_SPANS", "SHM_MIN_SPAN_BYTES", "shm_pays"]
