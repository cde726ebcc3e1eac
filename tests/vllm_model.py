"""A tiny random-weight Llama checkpoint plus a byte-level tokenizer, built locally for real-vLLM runs.

2 layers, hidden 64, 2 query heads, 1 KV head, head_dim 32 (vLLM's CPU attention backend refuses
head_dim 16). Weights are random but seeded, so every build of the same path is the same model.
"""

from __future__ import annotations

import os
from pathlib import Path

VOCAB_SIZE = 320  # 256 byte tokens + a few specials, rounded up


def build_tiny_llama(path: str | os.PathLike, seed: int = 0) -> str:
    """Write the checkpoint and tokenizer into ``path`` (created) unless already there; returns the path."""
    path = Path(path)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return str(path)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         max_position_embeddings=4096, bos_token_id=256, eos_token_id=257,
                         tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init, so greedy outputs depend on the KV
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    _byte_tokenizer().save_pretrained(path)
    return str(path)


def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>"})
    return fast
