"""Synthetic agent-like and RAG-like traces in the Mooncake format, so policies are not tuned to two traces.

A prompt is built from *pieces* (a piece id and a token count); two prompts share a prefix exactly as far
as their piece sequences agree. Block ids follow the Mooncake convention: one id per 512-token block of
the prompt (the last one may be partial), naming the block's content *and everything before it*, so
equal ids mean equal prefixes. Both generators are deterministic for a seed.

agent: ``sessions`` agent runs, interleaved. Each run starts from one of a few system prompts with tool
  descriptions (2-6k tokens) and a task (100-600 tokens), then takes a geometric number of steps (mean
  ``mean_steps``); each step re-sends the whole context plus the last tool result (200-3,000 tokens,
  long tails) and the model's action (output 20-300 tokens, appended to the next step's context). Steps
  of a run come 5-120 s apart (tool latency, model time); runs start as a Poisson process. Reuse: deep, growing prefixes at short
  reuse distances, plus the shared system prompts.
rag: each request = a shared system prompt (one of 3, 300-800 tokens) + ``docs_per_request`` retrieved
  chunks (1,000-3,000 tokens each) drawn from a corpus of ``corpus_docs`` chunks with Zipf(``zipf_s``)
  popularity, most relevant first + a unique question (30-200 tokens). Reuse: shallow (system prompt, and
  the first chunk or two when the same popular chunks rank first), long reuse distances for the tail.

Run:  python -m tierkv.replay.gen_traces agent OUT.jsonl [--requests 4000] [--seed 0]
      python -m tierkv.replay.gen_traces rag OUT.jsonl [--requests 4000] [--seed 0]
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
from pathlib import Path

from tierkv.replay.trace import BLOCK_TOKENS

Piece = tuple[int, int]  # (piece id, tokens)


class BlockIds:
    """Mooncake block ids for piece sequences: equal content up to a block's end gives an equal id."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def of(self, pieces: list[Piece]) -> tuple[int, list[int]]:
        """``(input_length, hash_ids)`` of the prompt made of ``pieces``."""
        ids, prev, block, filled = [], -1, [], 0
        for piece_id, tokens in pieces:
            offset = 0
            while offset < tokens:
                take = min(tokens - offset, BLOCK_TOKENS - filled)
                block.append((piece_id, offset, take))
                offset, filled = offset + take, filled + take
                if filled == BLOCK_TOKENS:
                    prev = self._id(prev, block)
                    ids.append(prev)
                    block, filled = [], 0
        if block:
            ids.append(self._id(prev, block))
        return sum(t for _, t in pieces), ids

    def _id(self, prev: int, block: list) -> int:
        return self._ids.setdefault((prev, tuple(block)), len(self._ids))


def _long_tail(rng: random.Random, low: int, high: int) -> int:
    """Tokens in [low, high], log-uniform: many short, a few long."""
    return int(round(low * (high / low) ** rng.random()))


def agent_trace(num_requests: int, seed: int = 0, mean_steps: float = 12.0, sessions_per_s: float = 2.0
                ) -> list[dict]:
    rng, blocks, piece = random.Random(seed), BlockIds(), iter(range(1, 1 << 62))
    systems = [[(next(piece), rng.randint(2000, 6000))] for _ in range(4)]
    events: list[tuple[float, int, list[Piece], int]] = []  # (time_s, run id, context, steps left)
    t, run_id = 0.0, 0
    out = []
    while len(out) < num_requests:
        if not events or events[0][0] > t:  # the next run starts before the next step: start it
            t += rng.expovariate(sessions_per_s)
            steps = max(1, int(rng.expovariate(1 / mean_steps)) + 1)
            ctx = list(rng.choice(systems)) + [(next(piece), rng.randint(100, 600))]
            heapq.heappush(events, (t, run_id, ctx, steps))
            run_id += 1
            continue
        now, rid, ctx, steps = heapq.heappop(events)
        length, ids = blocks.of(ctx)
        output = rng.randint(20, 300)
        out.append({"timestamp": int(now * 1000), "input_length": length, "output_length": output,
                    "hash_ids": ids})
        if steps > 1:
            ctx = ctx + [(next(piece), output), (next(piece), _long_tail(rng, 200, 3000))]
            heapq.heappush(events, (now + rng.uniform(5, 120), rid, ctx, steps - 1))
    return sorted(out, key=lambda r: r["timestamp"])


def rag_trace(num_requests: int, seed: int = 0, corpus_docs: int = 5000, docs_per_request: int = 3,
              zipf_s: float = 1.0, requests_per_s: float = 4.0) -> list[dict]:
    rng, blocks, piece = random.Random(seed), BlockIds(), iter(range(1, 1 << 62))
    systems = [(next(piece), rng.randint(300, 800)) for _ in range(3)]
    docs = [(next(piece), rng.randint(1000, 3000)) for _ in range(corpus_docs)]
    weights = [1 / (k + 1) ** zipf_s for k in range(corpus_docs)]
    t, out = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(requests_per_s)
        chosen = list(dict.fromkeys(rng.choices(range(corpus_docs), weights, k=docs_per_request * 2)))
        ranked = sorted(chosen[:docs_per_request])  # most popular = most relevant first: shared prefixes
        pieces = [rng.choice(systems)] + [docs[k] for k in ranked] + [(next(piece), rng.randint(30, 200))]
        length, ids = blocks.of(pieces)
        out.append({"timestamp": int(t * 1000), "input_length": length,
                    "output_length": rng.randint(50, 400), "hash_ids": ids})
    return out


GENERATORS = {"agent": agent_trace, "rag": rag_trace}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=sorted(GENERATORS))
    ap.add_argument("out")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rows = GENERATORS[args.kind](args.requests, args.seed)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


if __name__ == "__main__":
    main()
