"""Writes a random tiny Llama (hidden 128, 2 heads, head_dim 64: the CPU attention refuses
head_dim 16) and a word-level tokenizer with a chat template into a folder, with no download.
Run with the live venv's python: ``python make_tiny_model.py OUT_DIR``.
"""

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = "the a profile trace stage server hello world omni sidecar what is one two three four".split()
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    specials = ["[UNK]", "<s>", "</s>", "[PAD]"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS + [chr(c) for c in range(33, 127)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="[UNK]", pad_token="[PAD]"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,  # >= len(vocab); padded for the kernels
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    (out / "omni_sidecar_tiny.json").write_text(json.dumps({"vocab": len(vocab)}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
