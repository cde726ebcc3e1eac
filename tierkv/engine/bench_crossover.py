"""``tierkv bench engine --models a,b,c``: where L3 starts to pay. For each model size, the chat workload
runs with no cache, L1+L2 and L1+L2+L3 interleaved ``repeats`` times; each run's TTFT p50 and p99 are
divided into the no-cache run's of the same repeat (ratio > 1: faster than no cache), and the table
shows the median TTFTs and the worst and median ratio over the runs.

A small model recomputes a page faster than the file store returns it, so the cost model should skip
most L3 fetches (and the L1+L2+L3 row stays near L1+L2); a large one recomputes slower, so L3 hits
should pay. The last columns count L3 lookups made, reads that followed, and lookups or reads the cost
model skipped; and backups queued and those the cost model judged not worth writing.
"""

from __future__ import annotations

import io
import json
import statistics
from dataclasses import asdict, dataclass, field

from rich.console import Console
from rich.table import Table

from tierkv.cache.config import CacheConfig
from tierkv.engine.bench_workload import ChatWorkload, ModeResult, run_mode, warm_up
from tierkv.engine.engine import MODE_LABELS
from tierkv.engine.loader import build_model

SWEEP_MODES = ("none", "l1+l2", "l1+l2+l3")


@dataclass
class SweepRow:
    """One model and mode over all repeats; ratios are no-cache TTFT / this mode's, per repeat."""

    model: str
    mode: str
    p50_s: list[float] = field(default_factory=list)
    p99_s: list[float] = field(default_factory=list)
    p50_ratio: list[float] = field(default_factory=list)
    p99_ratio: list[float] = field(default_factory=list)
    hit_fraction: float = 0.0
    l3_stats: dict = field(default_factory=dict)
    same_outputs: bool = True


def run_sweep(models: list[str], workload: ChatWorkload, device: str = "cpu", repeats: int = 5,
              l2_fraction: float = 0.5, chunk_tokens: int = 512,
              tier_mode: str = CacheConfig.tier_mode) -> list[SweepRow]:
    """Every model, its modes interleaved within each repeat so machine noise hits them alike."""
    rows: list[SweepRow] = []
    for name in models:
        model = build_model(name, device)
        warm_up(model, device)
        by_mode = {mode: SweepRow(name, mode) for mode in SWEEP_MODES}
        for repeat in range(repeats):
            order = SWEEP_MODES[repeat % len(SWEEP_MODES):] + SWEEP_MODES[: repeat % len(SWEEP_MODES)]  # no mode always runs first or last
            runs = {mode: run_mode(model, workload, mode, device, chunk_tokens, l2_fraction, tier_mode)
                    for mode in order}
            failed = [r.error for r in runs.values() if r.error]
            if failed:
                raise RuntimeError(f"model {name}: {failed[0]}")
            _record_repeat(by_mode, runs)
        rows.extend(by_mode.values())
    return rows


def _record_repeat(by_mode: dict[str, SweepRow], runs: dict[str, ModeResult]) -> None:
    base = runs["none"]
    for mode, r in runs.items():
        row = by_mode[mode]
        p50, p99 = r.ttft_quantile(0.5), r.ttft_quantile(0.99)
        row.p50_s.append(p50)
        row.p99_s.append(p99)
        row.p50_ratio.append(base.ttft_quantile(0.5) / p50)
        row.p99_ratio.append(base.ttft_quantile(0.99) / p99)
        row.hit_fraction = sum(r.hit_tokens.values()) / max(1, r.prompt_tokens)
        row.same_outputs = row.same_outputs and r.outputs == base.outputs
        for key, value in r.l3_stats.items():
            row.l3_stats[key] = row.l3_stats.get(key, 0) + value


def format_crossover(rows: list[SweepRow]) -> str:
    table = Table(title="tierkv bench engine: crossover over model sizes", title_justify="left")
    for name in ("model", "mode", "TTFT p50 ms", "TTFT p99 ms", "hit %", "p50 ratio min/med",
                 "p99 ratio min/med", "p50 ratio per run", "p99 ratio per run", "L3 asked/read/skipped",
                 "backups/skipped"):
        table.add_column(name, justify="left" if name in ("model", "mode") else "right")
    for row in rows:
        ratios = ("", "", "", "") if row.mode == "none" else (
            f"{min(row.p50_ratio):.2f}/{statistics.median(row.p50_ratio):.2f}x",
            f"{min(row.p99_ratio):.2f}/{statistics.median(row.p99_ratio):.2f}x",
            " ".join(f"{x:.2f}" for x in row.p50_ratio), " ".join(f"{x:.2f}" for x in row.p99_ratio))
        stats = row.l3_stats
        read = stats.get("started", 0) - stats.get("revoked", 0)
        skipped = stats.get("not_worth", 0) + stats.get("cut_after_exists", 0)
        table.add_row(row.model, MODE_LABELS[row.mode], f"{statistics.median(row.p50_s) * 1e3:.1f}",
                      f"{statistics.median(row.p99_s) * 1e3:.1f}", f"{100 * row.hit_fraction:.1f}", *ratios,
                      f"{stats.get('started', 0)}/{read}/{skipped}" if stats else "",
                      f"{stats.get('backups', 0)}/{stats.get('backups_skipped', 0)}" if stats else "")
    out = Console(file=io.StringIO(), width=200, force_terminal=False)
    out.print(table)
    same = all(row.same_outputs for row in rows)
    out.print(f"outputs identical to no cache in every run: {'yes' if same else 'NO'}")
    return out.file.getvalue().rstrip("\n")


def main_crossover(models: list[str], workload: ChatWorkload, device: str, repeats: int, l2_fraction: float,
                   json_path: str | None, tier_mode: str = CacheConfig.tier_mode) -> int:
    print(f"crossover: models {', '.join(models)} on {device}; {workload.num_conversations} conversations x "
          f"{workload.num_turns} turns; {repeats} interleaved runs per mode; L2 {l2_fraction} of the "
          f"working set, {tier_mode} tiers", flush=True)
    rows = run_sweep(models, workload, device, repeats, l2_fraction, tier_mode=tier_mode)
    print(format_crossover(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"workload": asdict(workload), "rows": [asdict(r) for r in rows]}, f, indent=2)
    return 0 if all(row.same_outputs for row in rows) else 1
