"""NIXL and GPU memory on the core (cpp/src/nixl.h: CudaDevice, MemoryKind): a cache placed
on the DEVICE whose memory the CUDA runtime says is a GPU's is registered with NIXL as VRAM of
that device (as the Python engine's transport/nixl.py did); host placement is DRAM and never
asked; without a CUDA runtime everything is DRAM. NIXL configurations therefore run on the core
on GPU hosts too (core/native.py's ``refusal`` no longer keeps them on Python).

This machine has no GPU. A CUDA runtime stand-in (cpp/tests/fake_cudart.cc, compiled here with
the C++ compiler) names one address range as device memory of one device and counts the
questions; the core is pointed at it with DATADIST_CUDART_LIBRARY, or finds it by its soname on
LD_LIBRARY_PATH. NIXL's UCX here has no CUDA support, so it refuses each VRAM registration
("VRAM memory is detected as host by UCX"): a device cache on the "GPU" is then not served by
NIXL, nor pulled into, which is how the tests see that VRAM was asked for. What only a GPU host
can check (VRAM registered and pulled, bytes compared): examples/nixl/gpu_check.py.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from datadist.core import native, nixl_wheel
from datadist.core import nixl_wheel as nixl
from datadist.core.config import DEVICE, HOST, EngineConfig
from datadist.core.errors import InvalidArgument, NotSupported
from datadist.core.layout import Geometry, every_tensor, plan_slot
from datadist.testing import engine as hooks
from datadist.wire import protocol as p

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not native.available()[0], reason="the C++ core is not built here"),
    pytest.mark.skipif(nixl_wheel.library() is None, reason="nixl-cu12 not installed"),
]
ROOT = Path(__file__).resolve().parents[2]
FAKE_SOURCE = ROOT / "cpp" / "tests" / "fake_cudart.cc"
MEM_DRAM, MEM_VRAM = 0, 1
N = 4096  # bytes per tensor; two tensors per cache


@pytest.fixture(autouse=True)
def _nixl_readers_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where NIXL is installed, in-process readers that force NIXL get the whole-process
    allowance (docs/security.md, "The NIXL path"), as e2e/conftest.py gives its decoders."""
    if nixl.available() is not None:
        monkeypatch.setenv("DATADIST_NIXL_ALLOW_WHOLE_PROCESS_ACCESS", "1")


def _compile_fake(out: Path) -> Path:
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the CUDA runtime stand-in")
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([cxx, "-shared", "-fPIC", "-O1", "-o", str(out), str(FAKE_SOURCE)],
                   check=True, capture_output=True, timeout=120)
    return out


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _compile_fake(tmp_path_factory.mktemp("cudart") / "libfake_cudart.so")


class FakeCuda:
    """The stand-in as the test drives it: the same library handle the core dlopens."""

    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        self.lib.fake_cudart_calls.restype = ctypes.c_long
        self.lib.fake_cudart_set.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                                             ctypes.c_int]

    def place(self, arr: np.ndarray, device: int) -> None:
        """``arr``'s memory is now device memory of ``device``; the count starts at 0."""
        self.lib.fake_cudart_set(arr.ctypes.data, arr.ctypes.data + arr.nbytes, device, 2)

    @property
    def calls(self) -> int:
        return int(self.lib.fake_cudart_calls())


@pytest.fixture
def cuda(fake_lib: Path, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    monkeypatch.setenv("DATADIST_CUDART_LIBRARY", str(fake_lib))
    return FakeCuda(fake_lib)


@pytest.fixture
def engines() -> Iterator[tuple[native.NativeEngine, native.NativeEngine]]:
    owner = native.NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0),
                                             nixl_serve=True, nixl_whole_process=True))
    reader = native.NativeEngine(EngineConfig(cluster_id=2, role=2, transport="nixl",
                                              nixl_whole_process=True))
    yield owner, reader
    reader.close()
    owner.close()


def _register(eng: native.NativeEngine, arena: np.ndarray, first: int, placement: int) -> int:
    """A cache of two N-byte tensors at arena[first * N:], placed at ``placement``."""
    base = arena.ctypes.data + first * N
    return eng.register(Geometry(2, N, 1), [base, base + N], placement=placement).cache_id


def _regions(eng: native.NativeEngine) -> dict[int, tuple[int, int]]:
    """What the engine's NIXL agent registered: start -> (memory kind, device)."""
    return {start: (mem, dev) for start, _end, mem, dev in hooks.nixl_regions(eng)}


def _pull(reader: native.NativeEngine, src_id: int, dst_id: int) -> None:
    geo = Geometry(2, N, 1)
    plan = plan_slot(geo, 0, every_tensor(2))
    reader.pull(1, p.KeyRef(p.KeyKind.CACHE_ID, src_id, 0), 0, plan, dst_id, 5.0)


def test_device_placed_caches_on_a_gpu_are_registered_as_vram(
        cuda: FakeCuda, engines: tuple[native.NativeEngine, native.NativeEngine]) -> None:
    """Reader and owner: only device-placed caches are asked of CUDA (one question per
    tensor); those on the "GPU" go to NIXL as VRAM of device 3, which this host's UCX refuses,
    so the reader cannot pull into its own and the owner grants none of its own; host
    placement at the same addresses stays DRAM, unasked, and moves. Before: all were DRAM.
    (A failed VRAM registration also leaves NIXL 1.5.1's agent with metadata no peer can
    load: the owner's device cache comes last, after the reader linked.)"""
    owner, reader = engines
    arena = np.zeros(8 * N, np.uint8)
    cuda.place(arena, 3)
    on_host = _register(owner, arena, 2, HOST)
    into_gpu = _register(reader, arena, 4, DEVICE)  # the reader's agent is made at init
    into_host = _register(reader, arena, 6, HOST)
    assert cuda.calls == 2  # the reader's device cache
    addr, port = owner.listen_address or ("", 0)
    link = reader.link(1, addr, port, 5.0)
    assert link.path_name == "nixl", link.reason
    base = arena.ctypes.data
    assert _regions(reader) == {base + 6 * N: (MEM_DRAM, 0), base + 7 * N: (MEM_DRAM, 0)}
    arena[2 * N:4 * N] = np.arange(2 * N) % 251
    _pull(reader, on_host, into_host)
    assert np.array_equal(arena[6 * N:8 * N], arena[2 * N:4 * N])
    with pytest.raises(InvalidArgument, match="not registered with NIXL"):
        _pull(reader, on_host, into_gpu)

    gpu = _register(owner, arena, 0, DEVICE)
    assert cuda.calls == 4  # and the owner's, registered with its agent at once
    assert _regions(owner) == {base + 2 * N: (MEM_DRAM, 0), base + 3 * N: (MEM_DRAM, 0)}
    with pytest.raises(NotSupported, match="not registered with NIXL"):
        _pull(reader, gpu, into_host)


def test_without_a_cuda_runtime_device_caches_are_dram(
        monkeypatch: pytest.MonkeyPatch,
        engines: tuple[native.NativeEngine, native.NativeEngine]) -> None:
    """No CUDA runtime (none loads from DATADIST_CUDART_LIBRARY): a device-placed cache is
    DRAM, served and pulled into by NIXL as any host memory."""
    monkeypatch.setenv("DATADIST_CUDART_LIBRARY", "/nonexistent/libcudart.so")
    owner, reader = engines
    arena = np.zeros(4 * N, np.uint8)
    arena[:2 * N] = np.arange(2 * N) % 253
    src = _register(owner, arena, 0, DEVICE)
    dst = _register(reader, arena, 2, DEVICE)
    host, port = owner.listen_address or ("", 0)
    reader.link(1, host, port, 5.0)
    base = arena.ctypes.data
    assert _regions(owner) == {base: (MEM_DRAM, 0), base + N: (MEM_DRAM, 0)}
    _pull(reader, src, dst)
    assert np.array_equal(arena[2 * N:], arena[:2 * N])


_ON_A_GPU_HOST = """
import ctypes, json
import numpy as np
from datadist.core import native, nixl_wheel
from datadist.core.config import DEVICE, EngineConfig
from datadist.core.layout import Geometry
from datadist.testing import engine as hooks
fake = ctypes.CDLL("libcudart.so")  # found on LD_LIBRARY_PATH, as the core finds it
fake.fake_cudart_calls.restype = ctypes.c_long
fake.fake_cudart_set.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
served = EngineConfig(cluster_id=1, role=1, nixl_serve=True, nixl_whole_process=True)
forced = EngineConfig(cluster_id=2, role=2, transport="nixl", nixl_whole_process=True)
out = {"refusals": [native.refusal(served), native.refusal(forced)]}
eng = native.NativeEngine(forced)
arena = np.zeros(8192, np.uint8)
fake.fake_cudart_set(arena.ctypes.data, arena.ctypes.data + arena.nbytes, 1, 2)
eng.register(Geometry(1, 8192, 1), [arena.ctypes.data], placement=DEVICE)
out["calls"] = fake.fake_cudart_calls()
out["regions"] = hooks.nixl_regions(eng)
eng.close()
print(json.dumps(out))
"""


def test_nixl_runs_on_the_core_where_cuda_sees_a_gpu(fake_lib: Path, tmp_path: Path) -> None:
    """A host whose CUDA runtime (found by its soname, libcudart.so) sees a GPU: NIXL
    configurations, served or forced, are the core's (``refusal`` says nothing), and the core
    asks that runtime about a device cache. Before: both were refused to the core ("NIXL on a
    host with a GPU")."""
    libdir = tmp_path / "lib"
    libdir.mkdir()
    shutil.copy(fake_lib, libdir / "libcudart.so")
    env = {k: v for k, v in os.environ.items() if k != "DATADIST_CUDART_LIBRARY"}
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(libdir),
                                                           env.get("LD_LIBRARY_PATH")]))
    proc = subprocess.run([sys.executable, "-c", _ON_A_GPU_HOST], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["refusals"] == [None, None]
    assert out["calls"] == 1 and out["regions"] == []  # asked; VRAM of device 1 refused by UCX


def _no_access(nbytes: int) -> int:
    """``nbytes`` of address space mapped with no access (PROT_NONE), as GPU memory appears
    in /proc/self/maps; never unmapped (the test's process ends with it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    addr = libc.mmap(None, nbytes, 0, 0x22, -1, 0)  # PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS
    assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    return int(addr)


def test_register_cache_accepts_gpu_memory_the_cuda_runtime_vouches_for(cuda: FakeCuda) -> None:
    """GPU memory is not mapped readable and writable for the CPU, so the facade's
    /proc/self/maps check refused every DEVICE cache of a CUDA tensor (vLLM's
    kv_buffer_device="cuda"). Now a DEVICE cache whose first and last bytes the CUDA runtime
    says are one device's registers; HOST placement of the same memory, and DEVICE memory
    CUDA does not know, are still LLM_PARAM_INVALID."""
    import datadist as llm

    gpu = _no_access(4 * N)
    cuda.lib.fake_cudart_set(gpu, gpu + 4 * N, 0, 2)
    dd = llm.LLMDataDist(llm.LLMRole.DECODER, 7)
    cfg = llm.LLMConfig()
    cfg.local_comm_res = ""
    dd.init(cfg.generate_options())
    try:
        cm = dd.cache_manager
        u8 = llm.DataType.DT_UINT8
        device = llm.CacheDesc(2, [N], u8, llm.Placement.DEVICE)
        cache = cm.register_cache(device, [gpu, gpu + N])
        assert cuda.calls >= 2
        cm.unregister_cache(cache.cache_id)
        host = llm.CacheDesc(2, [N], u8, llm.Placement.HOST)
        with pytest.raises(llm.LLMException) as e:
            cm.register_cache(host, [gpu, gpu + N])
        assert e.value.status_code == llm.LLMStatusCode.LLM_PARAM_INVALID
        unknown = _no_access(N)  # not in the runtime's range: unmapped host memory
        with pytest.raises(llm.LLMException) as e:
            cm.register_cache(llm.CacheDesc(1, [N], u8, llm.Placement.DEVICE), [unknown])
        assert e.value.status_code == llm.LLMStatusCode.LLM_PARAM_INVALID
        # a range that ends past the device's memory is refused too
        with pytest.raises(llm.LLMException) as e:
            cm.register_cache(device, [gpu + 3 * N, gpu + 3 * N + N // 2])
        assert e.value.status_code == llm.LLMStatusCode.LLM_PARAM_INVALID
    finally:
        dd.finalize()
