"""Shared helpers for the engine tests: tiny models, prompts and the cache-off reference."""

from __future__ import annotations

import os
import random

import pytest
import torch

from tierkv.engine.config import PRESETS
from tierkv.engine.engine import Engine, EngineConfig
from tierkv.engine.loader import build_model

MODEL_KINDS = ("tiny-llama", "tiny-qwen3", "tiny-mla")
DEVICE = os.environ.get("TIERKV_TEST_DEVICE", "cpu")  # bench/gpu_check.sh runs the exactness tests on cuda


def prompts_with_shared_prefix(num: int, prefix_len: int, suffix_len: int, seed: int = 0,
                               vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(vocab) for _ in range(suffix_len)] for _ in range(num)]


def reference(model, prompts: list[list[int]], max_new_tokens: int):
    """Greedy outputs with the cache off, one request at a time."""
    engine = Engine(model, EngineConfig(mode="none", l1_tokens=2048))
    out = [engine.generate([p], max_new_tokens)[0] for p in prompts]
    engine.close()
    return out


def assert_same(got, want) -> None:
    assert got.error is None, got.error
    assert got.output == want.output
    for a, b in ((got.first_logits, want.first_logits), (got.last_logits, want.last_logits)):
        rel = (a - b).abs().max() / b.abs().max()
        assert rel <= 1e-4, f"logits differ by {rel:.2e} (relative)"


def tiny_model(kind: str):
    return build_model(PRESETS[kind], DEVICE)


def save_word_tokenizer_checkpoint(directory) -> None:
    """A tiny checkpoint in ``directory`` with a word-level tokenizer (built offline) whose vocabulary fills
    the model's 320 ids: "[UNK]", "</s>" (eos), "hello", "world", "cache", then w0, w1, ..."""
    import tokenizers
    import transformers
    from tierkv.engine.loader import save_checkpoint

    lm = tiny_model("tiny-llama")
    save_checkpoint(lm, directory)
    words = ["[UNK]", "</s>", "hello", "world", "cache"] + [f"w{i}" for i in range(lm.config.vocab_size - 5)]
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    core.decoder = tokenizers.decoders.WordPiece(prefix="##")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="</s>")
    fast.save_pretrained(str(directory))


__all__ = ["DEVICE", "MODEL_KINDS", "assert_same", "prompts_with_shared_prefix", "reference",
           "save_word_tokenizer_checkpoint", "single_torch_thread", "tiny_model"]


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread():
    """Tiny matmuls only lose from intra-op threads, badly so on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
