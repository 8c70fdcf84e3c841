"""A tiny Llama-architecture model directory for trying the connector without a model hub.

    python -m datadist.integrations.vllm.tiny_model /tmp/tiny-llama

writes a ``config.json`` and a byte-level tokenizer; vLLM loads it with
``load_format="dummy"`` (random weights, the same on every instance: vLLM seeds them).
Sizes fit vLLM's CPU attention (head_dim 32). Needs ``transformers`` (a vLLM dependency).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB_SIZE = 3 + 256  # the tokenizer's: every id decodes to text


def make_tiny_llama(path: str | Path, *, layers: int = 2, hidden: int = 128, heads: int = 4,
                    kv_heads: int = 2) -> Path:
    """Write the model directory (config and tokenizer, no weights) and return its path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
        "vocab_size": VOCAB_SIZE, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    specials = ["<s>", "</s>", "<unk>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(specials + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.save_pretrained(str(out))
    return out


if __name__ == "__main__":
    print(make_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"))
