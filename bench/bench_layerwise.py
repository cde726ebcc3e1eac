"""Layer-wise load-back against whole-load-then-compute: TTFT of a batch whose prefixes sit in L2.

Both engines are identical but for ``layerwise_load``. Each repeat puts every prefix back into L2 only
(evicts L1), then times one batch: each request loads a long prefix from L2 and prefills a suffix.
Whole: each load is waited for at admission, then the forward runs. Layer-wise: the step's loads are
one batch copied layer by layer on the copy thread (a CUDA stream on a GPU) while the forward runs,
each layer waiting only for its own copy. Repeats interleave the two modes; min and median per mode.

    python bench/bench_layerwise.py                     # 16 layers x hidden 512, MHA, 4 x (2048 + 32) tokens
    python bench/bench_layerwise.py --layers 4 --repeats 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from tierkv.engine.config import ModelConfig
from tierkv.engine.engine import Engine, EngineConfig
from tierkv.engine.loader import build_model


def _engine(model, args, layerwise: bool) -> Engine:
    total = args.batch * (args.prefix_tokens + args.suffix_tokens + 16)
    config = EngineConfig(mode="l1+l2", l1_tokens=total * 2, page_size=16, hicache_ratio=3.0,
                          max_running_requests=args.batch, chunk_tokens=args.batch * (args.suffix_tokens + 16),
                          layerwise_load=layerwise)
    return Engine(model, config)


def _timed_batch(engine: Engine, prefixes: list[list[int]], rng: random.Random, suffix_tokens: int,
                 vocab: int) -> float:
    """Prefixes in L2 only, then one batch; the batch's TTFT (admission to first token of the last)."""
    engine.cache.flush()
    engine.cache.evict(engine.cache.device_pool.num_slots)
    prompts = [p + [rng.randrange(vocab) for _ in range(suffix_tokens)] for p in prefixes]
    start = time.perf_counter()
    requests = engine.generate(prompts, 1)
    elapsed = time.perf_counter() - start
    hit = sum(r.host_hit_tokens for r in requests)
    assert hit >= len(prefixes) * (len(prefixes[0]) - 16), f"prefixes were not L2 hits ({hit} tokens)"
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads of 64 dims (8: MHA at hidden 512)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--suffix-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for compute (the copy thread is extra)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    heads = args.hidden // 64
    cfg = ModelConfig(arch="llama", vocab_size=512, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                      num_layers=args.layers, num_heads=heads, num_kv_heads=args.kv_heads, head_dim=64,
                      dtype="bfloat16")
    model = build_model(cfg, "cpu")
    rng = random.Random(0)
    prefixes = [[rng.randrange(cfg.vocab_size) for _ in range(args.prefix_tokens)] for _ in range(args.batch)]
    engines = {"whole": _engine(model, args, False), "layer-wise": _engine(model, args, True)}
    for engine in engines.values():  # warm up and put the prefixes into L1 + L2
        engine.generate([p + [1] for p in prefixes], 1)
        _timed_batch(engine, prefixes, rng, args.suffix_tokens, cfg.vocab_size)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            times[name].append(_timed_batch(engine, prefixes, rng, args.suffix_tokens, cfg.vocab_size))
    kv_mib = args.batch * args.prefix_tokens * engines["whole"].device_pool.spec.bytes_per_token / 2**20
    print(f"model: {args.layers} layers x hidden {args.hidden} (bf16), batch {args.batch} x "
          f"({args.prefix_tokens} from L2 + {args.suffix_tokens} new) tokens, {kv_mib:.0f} MiB loaded per batch, "
          f"{args.repeats} interleaved repeats")
    print(f"{'mode':<12}{'min ms':>10}{'median ms':>12}")
    for name, values in times.items():
        print(f"{name:<12}{min(values) * 1e3:>10.1f}{statistics.median(values) * 1e3:>12.1f}")
    whole, layer = times["whole"], times["layer-wise"]
    ratios = sorted(w / l for w, l in zip(whole, layer))
    print(f"TTFT whole / layer-wise: min-based {min(whole) / min(layer):.2f}x, median-based "
          f"{statistics.median(whole) / statistics.median(layer):.2f}x, per-repeat {ratios[0]:.2f}-{ratios[-1]:.2f}x")
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
