"""The torch side of the LLM demo: a Llama model, a paged KV cache, greedy decoding.

Who calls: ``datadist.demos.llm`` only, from its PROMPT and DECODER processes and for the
single-process reference. Importing this module imports torch and transformers, so nothing
that ``import datadist`` reaches may import it. Every function blocks until its compute is done.

Theory of operation:

- The paged layout is the one serving engines use (vLLM, MindIE): per layer one K and one V
  tensor of shape [num_blocks, block_size, kv_heads, head_dim]. Token t of a request lives in
  block ``table[t // block_size]`` at slot ``t % block_size``. The tensors are kept in the
  order K0, V0, K1, V1, ... so that layer i is tensors [2i, 2i + 2): llm_datadist's layer
  convention with ``tensor_num_per_layer=2``, which layer-wise pulls rely on.
- transformers keeps K/V per layer as [batch, kv_heads, seq, head_dim]. ``write_blocks`` and
  ``read_blocks`` are the only conversions between the two layouts.
- transformers changed its cache API several times between 4.40 and 5.x: a forward step
  returns tuples (4.40) or updates the DynamicCache it was given; the per-layer tensors are
  ``key_cache[i]``, then ``layers[i].keys``; the argument is ``past_key_values=``, then
  ``cache=``; ``num_logits_to_keep``, then ``logits_to_keep``. ``_forward`` and the shims
  ``_layer_kv``, ``_cache_kwarg``, ``_logits_kwargs`` are the only code that knows; the rest
  only uses ``DynamicCache()`` and ``DynamicCache.update``, which every version has.
- Token equality with ``model.generate()`` is exact, not approximate: the prompt and decoder
  call the model with the same arguments generate() uses (an all-ones attention mask and
  ``logits_to_keep=1``), so, given byte-identical K/V, the arithmetic is the same.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# An untrained Llama at transformers' default init (std 0.02) attends almost uniformly and
# soon repeats one token, which would make "the tokens match" a weak check. A wider init keeps
# the output varied and dependent on the context: with it, one wrong block of one layer's V
# changes the decoded tokens (tests/e2e/test_llm_demo.py checks that).
RANDOM_INIT_STD = 0.1


@dataclass(frozen=True)
class ModelSpec:
    """What model to build: a seeded random Llama, or a local checkpoint directory."""

    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    vocab_size: int
    seed: int
    dtype: str
    checkpoint: str | None = None


@dataclass(frozen=True)
class KvGeometry:
    """The paged cache's shape. The PROMPT sends it to the DECODER, which must agree."""

    layers: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str

    @property
    def shape(self) -> list[int]:
        return [self.num_blocks, self.block_size, self.kv_heads, self.head_dim]

    @property
    def num_tensors(self) -> int:
        return 2 * self.layers

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one tensor (one layer's K, or its V)."""
        itemsize = int(torch.empty((), dtype=DTYPES[self.dtype]).element_size())
        return self.block_size * self.kv_heads * self.head_dim * itemsize


def build_model(spec: ModelSpec) -> Any:
    """The model in eval mode: seeded random weights, or ``spec.checkpoint`` when given.

    The same spec gives the same weights in every process (same seed, same init order);
    ``weights_digest`` lets the processes check that rather than trust it.
    """
    torch.manual_seed(spec.seed)
    model: Any
    if spec.checkpoint:
        model = AutoModelForCausalLM.from_pretrained(spec.checkpoint)
    else:
        config = LlamaConfig(
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            intermediate_size=_ffn_size(spec.hidden_size),
            num_hidden_layers=spec.layers,
            num_attention_heads=spec.heads,
            num_key_value_heads=spec.kv_heads,
            max_position_embeddings=4096,
            initializer_range=RANDOM_INIT_STD,
            # No special tokens: an end-of-sequence id would let generate() stop early on a
            # random hit and turn a length check into a coin toss.
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )
        model = LlamaForCausalLM(config)
    return model.to(DTYPES[spec.dtype]).eval()


def _ffn_size(hidden: int) -> int:
    """Llama's MLP width: about 8/3 x hidden, rounded up to a multiple of 32."""
    return -(-(8 * hidden // 3) // 32) * 32


def kv_geometry(model: Any, num_blocks: int, block_size: int, dtype: str) -> KvGeometry:
    """The paged cache geometry this model's attention layers need."""
    cfg = model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return KvGeometry(cfg.num_hidden_layers, num_blocks, block_size, kv_heads, head_dim, dtype)


def eos_ids(model: Any) -> frozenset[int]:
    """The token ids that end generation, as generate() reads them."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def weights_digest(model: Any) -> str:
    """A digest of every weight's bytes, to prove two processes hold the same model."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------- transformers version shims


def _layer_kv(cache: Any, layer: int) -> tuple[Any, Any]:
    """Layer ``layer``'s (K, V), each [batch, kv_heads, seq, head_dim]."""
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers >= 4.54: DynamicCache.layers[i].keys / .values
        return layers[layer].keys, layers[layer].values
    if hasattr(cache, "key_cache"):  # 4.36 .. 4.53
        return cache.key_cache[layer], cache.value_cache[layer]
    return cache[layer][0], cache[layer][1]  # legacy tuple of tuples


def _cache_kwarg(model: Any) -> str:
    """The forward() argument that takes the cache: ``cache`` from transformers 5.2x on,
    ``past_key_values`` before (still accepted there, with a deprecation warning)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _logits_kwargs(model: Any) -> dict[str, int]:
    """Ask for the last position's logits only, as generate() does; the lm_head matmul of one
    row can round differently from the last row of a full-sequence matmul."""
    params = inspect.signature(model.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return {name: 1}
    return {}


def new_cache() -> Any:
    """An empty cache that the model fills layer by layer."""
    return DynamicCache()


def append_layer(cache: Any, layer: int, k: Any, v: Any) -> None:
    """Put one layer's K/V ([1, kv_heads, seq, head_dim]) into an empty cache layer.

    Layers must be appended in order 0, 1, 2, ...: transformers 4.4x appends on every call
    whatever ``layer`` says.
    """
    cache.update(k, v, layer)


# ---------------------------------------------------------------- prefill and paged blocks


def _forward(model: Any, ids: list[int], past: int, cache: Any) -> tuple[int, Any]:
    """One forward step over ``ids`` after ``past`` cached tokens.

    Returns the greedy token and the cache to continue from: the model's returned cache,
    which is ``cache`` itself from transformers 4.4x on, but a fresh tuple in 4.40.
    """
    input_ids = torch.tensor([ids], dtype=torch.long)
    mask = torch.ones((1, past + len(ids)), dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=mask, use_cache=True,
                    **{_cache_kwarg(model): cache}, **_logits_kwargs(model))
    returned = getattr(out, "cache", None)
    if returned is None:
        returned = out.past_key_values
    return int(out.logits[0, -1].argmax()), returned


def prefill(model: Any, prompt: Sequence[int]) -> tuple[int, Any]:
    """Run the prompt through the model. Returns (first generated token, filled cache)."""
    return _forward(model, list(prompt), 0, new_cache())


def alloc_blocks(geo: KvGeometry) -> list[Any]:
    """The paged cache: 2 x layers zeroed tensors, K0, V0, K1, V1, ..."""
    return [torch.zeros(geo.shape, dtype=DTYPES[geo.dtype]) for _ in range(geo.num_tensors)]


def blocks_needed(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def write_blocks(blocks: list[Any], cache: Any, table: Sequence[int], block_size: int) -> None:
    """Copy a prefilled cache (batch 1) into the paged blocks named by ``table``."""
    index = torch.tensor(list(table), dtype=torch.long)
    for layer in range(len(blocks) // 2):
        for kind, t in enumerate(_layer_kv(cache, layer)):
            seq = t.shape[2]
            rows = t[0].permute(1, 0, 2)  # [seq, kv_heads, head_dim]
            padded = rows.new_zeros((len(table) * block_size, *rows.shape[1:]))
            padded[:seq] = rows
            blocks[2 * layer + kind][index] = padded.view(len(table), block_size,
                                                          *rows.shape[1:])


def read_blocks(blocks: list[Any], layer: int, table: Sequence[int],
                tokens: int) -> tuple[Any, Any]:
    """Layer ``layer``'s K and V for the first ``tokens`` tokens of the blocks in ``table``,
    as transformers wants them: [1, kv_heads, tokens, head_dim]."""
    index = torch.tensor(list(table), dtype=torch.long)
    out = []
    for kind in (0, 1):
        paged = blocks[2 * layer + kind][index]  # [len(table), block_size, kv_heads, head_dim]
        rows = paged.reshape(-1, *paged.shape[2:])[:tokens]
        out.append(rows.permute(1, 0, 2).unsqueeze(0).contiguous())
    return out[0], out[1]


def cache_from_blocks(blocks: list[Any], table: Sequence[int], tokens: int) -> Any:
    """A transformers cache rebuilt from paged blocks: what the decoder attends over."""
    cache = new_cache()
    for layer in range(len(blocks) // 2):
        k, v = read_blocks(blocks, layer, table, tokens)
        append_layer(cache, layer, k, v)
    return cache


def blocks_digest(blocks: list[Any], table: Sequence[int]) -> str:
    """A digest of the bytes of ``table``'s blocks, every tensor, in table order. Equal on
    the PROMPT and the DECODER means the bytes arrived exactly (block ids may differ)."""
    index = torch.tensor(list(table), dtype=torch.long)
    h = hashlib.blake2b(digest_size=16)
    for t in blocks:
        h.update(t[index].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------- decoding


def decode(model: Any, cache: Any, first_token: int, prompt_len: int, new_tokens: int,
           eos: frozenset[int] = frozenset()) -> list[int]:
    """Greedy decoding from a cache holding the prompt: ``new_tokens`` tokens in all,
    ``first_token`` (the prefill's) included; stops early at an end-of-sequence id."""
    tokens = [first_token]
    while len(tokens) < new_tokens and tokens[-1] not in eos:
        past = prompt_len + len(tokens) - 1
        token, cache = _forward(model, [tokens[-1]], past, cache)
        tokens.append(token)
    return tokens


def reference_generate(model: Any, prompt: Sequence[int], new_tokens: int) -> list[int]:
    """``model.generate()``, greedy, batch 1, in this process: the tokens to match."""
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    eos = sorted(eos_ids(model))
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
            do_sample=False, num_beams=1, repetition_penalty=1.0,
            # generate() wants a pad id when it knows an eos id; batch 1 never pads.
            pad_token_id=eos[0] if eos else None,
        )
    return [int(t) for t in out[0, len(prompt):]]


def versions() -> str:
    return f"torch {torch.__version__}, transformers {transformers.__version__}"
