"""The engine benchmark's workload and one run of it: a seeded multi-turn chat replayed through an engine
in one cache mode. Shared by ``tierkv bench engine`` (tierkv.engine.bench) and its crossover table over
model sizes (tierkv.engine.bench_crossover)."""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import dataclass, field

from tierkv.cache.config import CacheConfig
from tierkv.engine.engine import Engine, EngineConfig, sync_device
from tierkv.engine.prefetch import l3_counters
from tierkv.engine.request import Request

PAGE_SIZE = 16  # one L3 file per page: per-token pages would measure the file system, not the cache
L2_FRACTION = 0.5  # of the working set, for both rows with an L2: L3 must supply what L2 dropped


@dataclass(frozen=True)
class ChatWorkload:
    num_conversations: int = 16
    num_turns: int = 4
    num_system_prompts: int = 2
    system_tokens: int = 384
    user_tokens: int = 48
    output_tokens: int = 16
    seed: int = 0

    def system_prompts(self, vocab: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [[rng.randrange(vocab) for _ in range(self.system_tokens)] for _ in range(self.num_system_prompts)]

    def user_message(self, conversation: int, turn: int, vocab: int) -> list[int]:
        rng = random.Random(f"{self.seed}-{conversation}-{turn}")
        return [rng.randrange(vocab) for _ in range(self.user_tokens)]

    @property
    def max_context_tokens(self) -> int:
        return self.system_tokens + self.num_turns * (self.user_tokens + self.output_tokens)

    @property
    def working_set_tokens(self) -> int:
        """KV tokens of every conversation's full history (system prompts counted once)."""
        per_conversation = self.num_turns * (self.user_tokens + self.output_tokens)
        return self.num_system_prompts * self.system_tokens + self.num_conversations * per_conversation


@dataclass
class ModeResult:
    mode: str
    wall_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    decode_tokens_per_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    hit_tokens: dict = field(default_factory=dict)
    l1_tokens: int = 0
    l2_tokens: int = 0
    outputs: list[list[int]] = field(default_factory=list)
    l3_stats: dict = field(default_factory=dict)  # prefetches started / revoked / judged not worth it, backups
    error: str | None = None

    @property
    def throughput(self) -> float:
        """Generated tokens per second of wall time over the whole replay."""
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0

    def ttft_quantile(self, q: float) -> float:
        values = sorted(self.ttft_s)
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def replay(engine: Engine, workload: ChatWorkload, mode: str) -> ModeResult:
    """All conversations advance one turn per round; a round's requests run batched together."""
    vocab = min(engine.model.config.vocab_size, 256)
    systems = workload.system_prompts(vocab)
    histories = [list(systems[c % len(systems)]) for c in range(workload.num_conversations)]
    result = ModeResult(mode, hit_tokens={"L1": 0, "L2": 0, "L3": 0})
    start = time.perf_counter()
    for turn in range(workload.num_turns):
        requests = []
        for c, history in enumerate(histories):
            history += workload.user_message(c, turn, vocab)
            requests.append(engine.scheduler.submit(Request(list(history), workload.output_tokens)))
        while engine.scheduler.has_work:
            engine.scheduler.step()
        sync_device(engine.model.device)
        for history, r in zip(histories, requests):
            if r.error:
                raise RuntimeError(f"request failed in mode {mode}: {r.error}")
            history += r.output
            _record(result, r)
    result.wall_s = time.perf_counter() - start
    result.l1_tokens = engine.device_pool.num_slots
    result.l2_tokens = engine.cache.host_pool.num_slots if engine.cache.host_pool is not None else 0
    if engine.cache.storage is not None:
        result.l3_stats = l3_counters(engine.cache)
    return result


def _record(result: ModeResult, r: Request) -> None:
    result.ttft_s.append(r.ttft_s)
    if r.decode_tokens_per_s:
        result.decode_tokens_per_s.append(r.decode_tokens_per_s)
    result.prompt_tokens += len(r.prompt)
    result.generated_tokens += len(r.output)
    result.hit_tokens["L1"] += r.device_hit_tokens
    result.hit_tokens["L2"] += r.host_hit_tokens
    result.hit_tokens["L3"] += r.storage_hit_tokens
    result.outputs.append(r.output)


def engine_config(mode: str, workload: ChatWorkload, device: str, l3_dir: str, chunk_tokens: int,
                  l2_fraction: float = L2_FRACTION, tier_mode: str = CacheConfig.tier_mode) -> EngineConfig:
    """L1 holds about a quarter of the working set (at least two requests); L2, in both rows that have
    one, ``l2_fraction`` of it (at least 1.5x L1). Chat turns come back round robin, which a tier keeps
    only if it holds every history: with L2 under the working set, what the L1+L2+L3 row gains over
    L1+L2 is what L3 supplies, like for like. ``tier_mode`` applies to both rows with an L2."""
    l1 = max(workload.working_set_tokens // 4, 2 * workload.max_context_tokens)
    ratio = max(1.5, l2_fraction * workload.working_set_tokens / l1)
    l3 = mode == "l1+l2+l3"
    # HiCache's prefetch_threshold: a prompt that extends its L1+L2 hit by no more than one turn's new
    # text (never stored anywhere) is not worth an L3 lookup, which would also hold L2 room meanwhile
    threshold = -(-(workload.user_tokens + workload.output_tokens) // PAGE_SIZE) * PAGE_SIZE + PAGE_SIZE
    # HiCache's rate limit (0.8 x (L2 - L1) in flight) would refuse a whole history here (L2 is 1.5x L1):
    # two prompts' worth in flight at most
    extra = {"prefetch_threshold": threshold, "prefetch_stop_policy": "wait_complete",
             "prefetch_max_tokens_in_flight": 2 * workload.max_context_tokens}
    return EngineConfig(mode=mode, device=device, l1_tokens=l1 - l1 % PAGE_SIZE, page_size=PAGE_SIZE,
                        hicache_ratio=ratio, chunk_tokens=chunk_tokens, tier_mode=tier_mode,
                        host_layout="page_first" if l3 else "layer_first",
                        l3=f"file:{l3_dir}" if l3 else None, storage_extra=extra if l3 else None)


def run_mode(model, workload: ChatWorkload, mode: str, device: str, chunk_tokens: int,
             l2_fraction: float = L2_FRACTION, tier_mode: str = CacheConfig.tier_mode) -> ModeResult:
    """One replay of ``workload`` in ``mode`` on a fresh engine (and an empty L3 directory)."""
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-l3-") as l3_dir:
        try:
            engine = Engine(model, engine_config(mode, workload, device, l3_dir, chunk_tokens, l2_fraction,
                                                 tier_mode))
        except ValueError as exc:
            return ModeResult(mode, error=str(exc))
        try:
            return replay(engine, workload, mode)
        finally:
            engine.close()


def warm_up(model, device: str) -> None:
    engine = Engine(model, EngineConfig(mode="none", device=device, l1_tokens=512))
    engine.generate([list(range(64))], 4)
    engine.close()
