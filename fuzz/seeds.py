"""The fuzzers' seeds: the protocol's golden frames, tests/vectors/frames.txt (made by
tests/vectors/generate.py; both codecs are tested against it). Imported by fuzz_decoder.py and
fuzz_owner.py, so that every message type, flag and malformed case the protocol has is where
the fuzzers start from, with no list of messages of their own to keep up to date."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

GENERATOR = Path(__file__).resolve().parents[1] / "tests" / "vectors" / "generate.py"


def golden_frames(*, valid: bool = True, malformed: bool = True) -> list[bytes]:
    """The frames of frames.txt, in its order: those a decoder accepts, those it refuses."""
    spec = importlib.util.spec_from_file_location("dd_vectors", GENERATOR)
    assert spec is not None and spec.loader is not None
    mod = sys.modules.get(spec.name)
    if mod is None:
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up while built
        spec.loader.exec_module(mod)
    return [v.frame for v in mod.load()
            if (valid if v.refused is None else malformed)]
