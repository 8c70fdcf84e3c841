"""The LLM demo end to end: a real (tiny) Llama prefilled in one process, its paged KV cache
pulled with datadist into another, decoded there; the tokens must be generate()'s.

Needs the ``llm`` extra (torch, transformers); skipped without it. The control test at the
bottom shows that the token comparison is sharp: decoding from the wrong request's blocks,
or with a single wrong block in one layer, gives other tokens.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from datadist.demos import llm  # noqa: E402

TINY = ["--layers", "2", "--hidden-size", "64", "--heads", "4", "--kv-heads", "2",
        "--vocab-size", "1000", "--prompts", "3", "--max-prompt-len", "64", "--new-tokens", "6",
        "--block-size", "8"]


@pytest.mark.timeout(90)
def test_pull_blocks_then_decode_matches_generate() -> None:
    out = io.StringIO()
    report = llm.run(llm.parse_args(TINY), out=out)

    assert len(report.rows) == 3
    assert len({r.prompt_len for r in report.rows}) == 3, "prompts should differ in length"
    assert report.data_path in ("cma", "tcp")
    for r in report.rows:
        assert r.kv_identical, f"req {r.req_id}: pulled KV bytes differ from the prompt's"
        assert len(r.reference) == 6
        assert r.tokens == r.reference, f"req {r.req_id}: {r.tokens} != {r.reference}"
        assert r.blocks == -(-r.prompt_len // 8)
        assert r.kv_bytes == r.blocks * 8 * 2 * 16 * 4 * 2 * 2  # block x kv_heads x dim x f32
    # A model that repeats one token would make the comparison weak; this one does not.
    assert len({t for r in report.rows for t in r.tokens}) > 6
    assert report.ok
    text = out.getvalue()
    assert "tokens match" in text and "multiprocessing.Pipe" in text


@pytest.mark.timeout(90)
def test_main_layerwise_over_tcp(capsys: pytest.CaptureFixture[str]) -> None:
    rc = llm.main([*TINY, "--layerwise", "--transport", "tcp", "--prompts", "2"])

    text = capsys.readouterr().out
    assert rc == 0, text
    assert "layer-wise pull" in text
    assert "data path: tcp" in text
    rows = [line.split() for line in text.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert len(rows) == 2
    assert all(row[-2:] == ["yes", "yes"] for row in rows), text


@pytest.mark.timeout(60)
def test_wrong_or_damaged_kv_changes_the_tokens() -> None:
    """In one process, no datadist: the same paged-cache code the demo uses, fed the right
    blocks, the other request's blocks, and the right blocks but one."""
    from datadist.demos import _llm_torch as lt

    spec = lt.ModelSpec(layers=2, hidden_size=64, heads=4, kv_heads=2, vocab_size=1000,
                        seed=0, dtype="float32")
    model = lt.build_model(spec)
    prompts = llm.make_prompts(2, 40, 1000, 8, seed=3)
    length = min(len(p) for p in prompts)
    a, b = (p[:length] for p in prompts)  # same length, so either request's blocks fit
    n = lt.blocks_needed(length, 8)
    blocks = lt.alloc_blocks(lt.kv_geometry(model, 2 * n, 8, "float32"))
    table_a, table_b = list(range(n)), list(range(n, 2 * n))
    first_a, kv_a = lt.prefill(model, a)
    lt.write_blocks(blocks, kv_a, table_a, 8)
    lt.write_blocks(blocks, lt.prefill(model, b)[1], table_b, 8)

    def tokens_from(table: list[int]) -> list[int]:
        cache = lt.cache_from_blocks(blocks, table, length)
        return lt.decode(model, cache, first_a, length, 8)

    want = lt.reference_generate(model, a, 8)
    assert tokens_from(table_a) == want
    assert tokens_from(table_b) != want
    # One block of layer 0's V (tensor 1) taken from the other request: still other tokens.
    blocks[1][table_a[-1]] = blocks[1][table_b[-1]]
    assert tokens_from(table_a) != want


def test_importing_the_demo_does_not_import_torch() -> None:
    code = ("import sys, datadist, datadist.demos.llm; "
            "sys.exit(1 if 'torch' in sys.modules or 'transformers' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


@pytest.mark.timeout(90)
def test_a_failing_child_is_reported_with_its_traceback(tmp_path: Path) -> None:
    # An empty checkpoint directory: both children fail to load a model, and say why.
    cfg = dict(vars(llm.parse_args([*TINY, "--checkpoint", str(tmp_path)])))
    with pytest.raises(llm._ChildFailed, match=r"process failed:\n(?s:.*)Traceback"):
        llm._run_children(cfg, [[1, 2, 3]], io.StringIO())


def test_main_reports_a_checkpoint_it_cannot_load(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert llm.main([*TINY, "--checkpoint", str(tmp_path)]) == 1
    assert "cannot load the model" in capsys.readouterr().err
