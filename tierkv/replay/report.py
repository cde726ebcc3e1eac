"""Run a replay with its baselines, and present it: rich table, JSON, plots, capacity sweep.

Baselines, all on the same requests:
- no cache: every prompt token is prefilled;
- L1-only: a plain radix cache (the same HiRadixCache with no host tier) whose L1 holds
  ``l1_tokens + l2_tokens``: all the memory the tiered run has in L1 and L2 together, as if it were one
  tier. It shows what the tiers give up in hit ratio for putting most of the capacity in cheaper memory;
- optimal: Belady's MIN (:mod:`tierkv.replay.optimal`) at the same total capacity ``l1_tokens +
  l2_tokens``; with an L3 tier, at ``l1_tokens + l2_tokens + l3_tokens`` for a bounded L3 (unbounded
  when ``l3_tokens`` is None), plus MIN at L1 + L2 alone so each tier's distance from its own optimum
  shows. No cache of that capacity replaying this trace can hit more tokens.

Byte counts use the modelled KV size (``kv_bytes_per_token``, by default the named model's), not the
replay's tiny pools: they say what the run would move on a real server.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from rich import box
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table
from rich.text import Text

from tierkv.replay.optimal import OptimalResult, belady_min, belady_mins
from tierkv.replay.replay import ReplayConfig, ReplayResult, replay
from tierkv.replay.trace import Trace
from tierkv.replay.ttft import TTFTModel
from tierkv.storage.factory import redact_spec

_SIZE_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9}


MAX_SIZE = 10**11  # tokens: past any pool this machine or its storage could hold (1e11 x 128 KiB = 13 PB)


def parse_size(text: str) -> int:
    """Tokens from ``"500000"``, ``"250k"``, ``"1.5M"`` or ``"2G"`` (decimal multiples)."""
    s = str(text).strip().lower()
    scale = _SIZE_SUFFIXES.get(s[-1:], 1)
    number = s[:-1] if scale != 1 else s
    try:
        value = float(number) * scale
    except ValueError:
        raise ValueError(f"bad token count {text!r}: expected e.g. 500000, 250k, 1.5M") from None
    if not math.isfinite(value) or value > MAX_SIZE:
        raise ValueError(f"bad token count {text!r}: must be a finite number up to {MAX_SIZE:.0e}")
    if value < 0 or value != int(value):
        raise ValueError(f"bad token count {text!r}: must be a whole number >= 0")
    return int(value)


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of :func:`parse_size` values."""
    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise ValueError(f"bad size list {text!r}: expected e.g. 250k,1M,3M")
    return sizes


def summarise(values: list[float]) -> dict[str, float]:
    """Mean, p50 and p99 (nearest-rank) of ``values``."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, int(-(-q * len(ordered) // 1)) - 1))]

    return {"mean": sum(ordered) / len(ordered), "p50": rank(0.5), "p99": rank(0.99)}


@dataclass
class RunOutcome:
    """Everything one ``tierkv replay`` run measured, before it is turned into a report."""

    trace: Trace
    tiered: ReplayResult
    l1_only: ReplayResult | None
    optimal: OptimalResult
    ideal: OptimalResult
    wall_s: float
    optimal_l1_l2: OptimalResult | None = None  # with L3: MIN at the L1 + L2 capacity alone


_worker_progress = None  # a shared counter in the baseline process (set by its initializer)


def _init_worker(counter) -> None:
    global _worker_progress
    _worker_progress = counter
    torch.set_num_threads(1)  # one core each for the two replays (see cli.replay_main)


def _count_request(_: int) -> None:
    with _worker_progress.get_lock():
        _worker_progress.value += 1


def optimal_capacity(config: ReplayConfig) -> int | None:
    """MIN's capacity for ``config``: L1 + L2, plus L3 when it is bounded; None for an unbounded L3."""
    if config.l3 == "none":
        return config.total_tokens
    return None if config.l3_tokens is None else config.total_tokens + config.l3_tokens


def _optimal(requests: list, config: ReplayConfig) -> tuple[OptimalResult, OptimalResult, OptimalResult | None]:
    """MIN at the run's capacity, at an unbounded one (the ideal) and, with an L3, at L1 + L2 alone."""
    capacity = optimal_capacity(config)
    capacities = [capacity] + ([None] if capacity is not None else [])
    capacities += [config.total_tokens] if config.l3 != "none" else []
    mins = belady_mins(requests, capacities, config.page_size)
    return mins[0], mins[1] if capacity is not None else mins[0], mins[-1] if config.l3 != "none" else None


def _baselines(requests: list, config: ReplayConfig, with_l1_only: bool
               ) -> tuple[ReplayResult | None, OptimalResult, OptimalResult, OptimalResult | None]:
    """MIN and the L1-only replay, run in a second process while the tiered replay runs in the first.

    MIN goes first: its workload (O(trace)) is freed before the replay's pools are made, so the peak RSS
    is the larger of the two, not their sum."""
    optimal, ideal, l1_l2 = _optimal(requests, config)
    return _l1_only(requests, config) if with_l1_only else None, optimal, ideal, l1_l2


def _l1_only(requests: list, config: ReplayConfig) -> ReplayResult:
    """The L1-only baseline: one tier holding all of ``config``'s L1 + L2."""
    flat = replace(config, l1_tokens=config.total_tokens, l2_tokens=None, l3="none")
    return replay(requests, flat, _count_request if _worker_progress is not None else None)


def run_all(trace: Trace, config: ReplayConfig, baselines: bool = True, console: Console | None = None,
            parallel: bool = True) -> RunOutcome:
    """Replay the tiered cache, the L1-only baseline and MIN, with progress bars on ``console``.

    With ``parallel`` the baselines run in a second process (the CI machine has two cores), so the
    whole run takes about as long as the tiered replay alone.
    """
    start = time.perf_counter()
    requests = trace.requests
    with progress_bars(console, 10) as bar:
        tiered_task = bar.add_task("tiered", total=len(requests))
        flat_task = bar.add_task("L1-only", total=len(requests)) if baselines else None
        if not parallel:
            optimal, ideal, l1_l2 = _optimal(requests, config)  # first, as in _baselines
            tiered = replay(requests, config, lambda i: bar.advance(tiered_task))
            l1_only = _l1_only(requests, config) if baselines else None
            return RunOutcome(trace, tiered, l1_only, optimal, ideal, time.perf_counter() - start, l1_l2)
        ctx = multiprocessing.get_context("spawn")
        counter = ctx.Value("q", 0)
        with ProcessPoolExecutor(1, mp_context=ctx, initializer=_init_worker, initargs=(counter,)) as pool:
            future = pool.submit(_baselines, requests, config, baselines)

            def advance(i: int) -> None:
                bar.update(tiered_task, completed=i + 1)
                if flat_task is not None and i % 64 == 0:
                    bar.update(flat_task, completed=counter.value)

            tiered = replay(requests, config, advance)
            while not future.done():
                if flat_task is not None:
                    bar.update(flat_task, completed=counter.value)
                time.sleep(0.1)
            l1_only, optimal, ideal, l1_l2 = future.result()
    return RunOutcome(trace, tiered, l1_only, optimal, ideal, time.perf_counter() - start, l1_l2)


class LineProgress:
    """Progress for a console that is not a terminal (a CI log, a pipe): rich draws nothing there, so this
    prints one plain line per task at most every ``interval_s`` seconds, with its rate and time left."""

    def __init__(self, console: Console, interval_s: float = 10.0) -> None:
        self.console, self.interval_s = console, interval_s
        self._tasks: dict[int, dict] = {}

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc) -> None:
        for task in self._tasks.values():
            if task["completed"] < task["total"] and exc[0] is None:
                self._print(task)

    def add_task(self, description: str, total: int) -> int:
        task_id = len(self._tasks)
        now = time.monotonic()
        self._tasks[task_id] = {"description": description, "total": total, "completed": 0, "start": now,
                                "printed": now}
        return task_id

    def advance(self, task_id: int, advance: int = 1) -> None:
        self.update(task_id, completed=self._tasks[task_id]["completed"] + advance)

    def update(self, task_id: int, completed: int) -> None:
        task = self._tasks[task_id]
        task["completed"] = completed
        now = time.monotonic()
        if now - task["printed"] >= self.interval_s or completed == task["total"]:
            task["printed"] = now
            self._print(task)

    def _print(self, task: dict) -> None:
        elapsed_s = max(time.monotonic() - task["start"], 1e-9)
        rate = task["completed"] / elapsed_s
        left = f", {(task['total'] - task['completed']) / rate:.0f} s left" if rate > 0 else ""
        self.console.print(f"{task['description']}: {task['completed']:,}/{task['total']:,} requests "
                           f"({rate:,.0f}/s, {elapsed_s:.0f} s{left})", highlight=False, soft_wrap=True)


class RateColumn(ProgressColumn):
    """Requests per second over the task so far."""

    def render(self, task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("" if speed is None else f"{speed:,.0f}/s", style="progress.data.speed")


def progress_bars(console: Console | None, description_width: int):
    """Rich bars with rate and time left on a terminal; plain periodic lines elsewhere."""
    console = console or Console(stderr=True)
    if not console.is_terminal:
        return LineProgress(console)
    return Progress(TextColumn(f"{{task.description:<{description_width}}}"), BarColumn(), MofNCompleteColumn(),
                    RateColumn(), TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                    console=console, transient=True)


def _ttfts(model: TTFTModel, result: ReplayResult) -> list[float]:
    return [model.ttft_s(r.prompt_tokens, r.l1, r.l2, r.l3) for r in result.requests]


def build_report(run: RunOutcome, model: TTFTModel, trace_path: str = "") -> dict:
    """The JSON report: headline numbers of the tiered run, then the config and the baselines."""
    tiered, reqs = run.tiered, run.trace.requests
    hits = tiered.tier_hits()
    b = model.bytes_per_token
    no_cache = [model.ttft_s(r.input_length) for r in reqs]
    report = {
        "trace": trace_path,
        "requests": len(reqs),
        "bad_lines": len(run.trace.bad_lines),
        "prompt_tokens": tiered.prompt_tokens,
        "hit_tokens": hits,
        "hit_ratio": tiered.hit_ratio,
        "optimal_hit_ratio": run.optimal.hit_ratio,
        "optimal_capacity_tokens": run.optimal.capacity_tokens,
        "fraction_of_min": tiered.hit_ratio / run.optimal.hit_ratio if run.optimal.hit_ratio else 0.0,
        "ideal_hit_ratio": run.ideal.hit_ratio,
        "no_cache_ttft_s": summarise(no_cache)["mean"],
        "ttft_s": summarise(_ttfts(model, tiered)),
        "bytes_moved": {"l1_l2": (tiered.written_l1_l2_tokens + tiered.loaded_l2_l1_tokens) * b,
                        "l2_l3": (tiered.backed_up_l2_l3_tokens + tiered.prefetched_l3_l2_tokens) * b},
        "tokens_moved": {"l1_to_l2": tiered.written_l1_l2_tokens, "l2_to_l1": tiered.loaded_l2_l1_tokens,
                         "l2_to_l3": tiered.backed_up_l2_l3_tokens, "l3_to_l2": tiered.prefetched_l3_l2_tokens},
        "uncached_requests": tiered.uncached_requests,
        "replay_wall_s": tiered.wall_s,
        "wall_s": run.wall_s,
        "config": {**asdict(tiered.config), "l3": redact_spec(tiered.config.l3)},  # no URL password
        "model": {**asdict(model.model), "kv_bytes_per_token": b, "effective_flops": model.effective_flops,
                  "l2_link": asdict(model.l2_link), "l3_link": asdict(model.l3_link)},
        "baselines": {"no_cache": {"hit_ratio": 0.0, "ttft_s": summarise(no_cache)}},
    }
    if run.l1_only is not None:
        report["baselines"]["l1_only"] = {
            "capacity_tokens": run.l1_only.config.l1_tokens, "hit_ratio": run.l1_only.hit_ratio,
            "hit_tokens": run.l1_only.tier_hits()["l1"], "uncached_requests": run.l1_only.uncached_requests,
            "ttft_s": summarise(_ttfts(model, run.l1_only)), "wall_s": run.l1_only.wall_s}
    report["baselines"]["optimal"] = {
        "capacity_tokens": run.optimal.capacity_tokens, "hit_ratio": run.optimal.hit_ratio,
        "hit_tokens": run.optimal.hit_tokens,
        "ttft_s": summarise([model.ttft_s(r.input_length, h) for r, h in
                             zip(reqs, run.optimal.per_request_hit_tokens)])}
    if run.optimal_l1_l2 is not None:  # each tier against its own optimum
        l1_l2_hits = (hits["l1"] + hits["l2"]) / tiered.prompt_tokens if tiered.prompt_tokens else 0.0
        opt = run.optimal_l1_l2.hit_ratio
        report["baselines"]["optimal_l1_l2"] = {
            "capacity_tokens": run.optimal_l1_l2.capacity_tokens, "hit_ratio": opt,
            "hit_tokens": run.optimal_l1_l2.hit_tokens, "l1_l2_hit_ratio": l1_l2_hits,
            "l1_l2_fraction_of_min": l1_l2_hits / opt if opt else 0.0}
    return report


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def _ms(x: float) -> str:
    return f"{1000 * x:.1f}"


REPORT_COLUMNS = ("cache", "capacity (tokens)", "L1 hit", "L2 hit", "L3 hit", "hit ratio", "TTFT mean ms", "p50 ms",
                  "p99 ms")
# Below this many columns the report is printed one row per figure (one column per cache), so that no
# number is ever cut short on an 80-column terminal.
WIDE_REPORT_COLUMNS = 130


def _report_rows(report: dict) -> list[list[str]]:
    """One row per configuration, cells in REPORT_COLUMNS order."""
    cfg, base = report["config"], report["baselines"]
    nc = base["no_cache"]["ttft_s"]
    rows = [["no cache", "0", "", "", "", _pct(0), _ms(nc["mean"]), _ms(nc["p50"]), _ms(nc["p99"])]]
    if "l1_only" in base:
        b, t = base["l1_only"], base["l1_only"]["ttft_s"]
        rows.append(["L1-only radix", f"{b['capacity_tokens']:,}", f"{b['hit_tokens']:,}", "", "",
                     _pct(b["hit_ratio"]), _ms(t["mean"]), _ms(t["p50"]), _ms(t["p99"])])
    h, t = report["hit_tokens"], report["ttft_s"]
    cap = f"{cfg['l1_tokens'] + (cfg['l2_tokens'] or 0):,}" + (" + L3" if cfg["l3"] != "none" else "")
    rows.append(["tiered (tierkv)", cap, f"{h['l1']:,}", f"{h['l2']:,}", f"{h['l3']:,}", _pct(report["hit_ratio"]),
                 _ms(t["mean"]), _ms(t["p50"]), _ms(t["p99"])])
    o = base["optimal"]
    ocap = "unbounded" if o["capacity_tokens"] is None else f"{o['capacity_tokens']:,}"
    rows.append(["optimal (MIN)", ocap, f"{o['hit_tokens']:,}", "", "", _pct(o["hit_ratio"]),
                 _ms(o["ttft_s"]["mean"]), _ms(o["ttft_s"]["p50"]), _ms(o["ttft_s"]["p99"])])
    return rows


def _report_table(rows: list[list[str]], wide: bool) -> Table:
    if wide:
        table = Table()
        for col in REPORT_COLUMNS:
            table.add_column(col, justify="left" if col == "cache" else "right", no_wrap=True)
        for row in rows:
            table.add_row(*row, style="bold" if row[0].startswith("tiered") else None)
        return table
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)  # no side borders: five columns fit in 80
    table.add_column("", no_wrap=True)
    for row in rows:
        # Numbers never wrap (min_width holds the longest); a long header wraps at its spaces instead.
        table.add_column(row[0], justify="right", min_width=max(len(cell) for cell in row[1:]),
                         style="bold" if row[0].startswith("tiered") else None)
    for i, name in enumerate(REPORT_COLUMNS[1:], start=1):
        table.add_row(name, *(row[i] for row in rows))
    return table


def _print_unpadded(console: Console, renderable) -> None:
    """Print ``renderable``; off a terminal (a file, a CI log) without the spaces rich pads lines with."""
    if console.is_terminal:
        console.print(renderable)
        return
    with console.capture() as captured:
        console.print(renderable)
    console.out("\n".join(line.rstrip() for line in captured.get().splitlines()), highlight=False)


def print_report(report: dict, console: Console | None = None) -> None:
    """A table with one row per configuration: hits per tier, hit ratio, modelled TTFT (one column per
    configuration instead when the console is narrower than WIDE_REPORT_COLUMNS)."""
    console = console or _stdout_console()
    cfg = report["config"]
    _print_unpadded(console, Text(f"{report['requests']:,} requests, {report['prompt_tokens']:,} prompt tokens; "
                  f"L1 {cfg['l1_tokens']:,} + L2 {cfg['l2_tokens'] or 0:,} tokens, L3 {cfg['l3']}; "
                  f"page {cfg['page_size']}, {cfg['eviction_policy']}, {cfg['write_policy']}; "
                  f"model {report['model']['name']}"))
    _print_unpadded(console, _report_table(_report_rows(report), wide=console.width >= WIDE_REPORT_COLUMNS))
    moved = report["bytes_moved"]
    _print_unpadded(console, Text(f"bytes moved: L1<->L2 {moved['l1_l2'] / 2**30:,.1f} GiB, L2<->L3 {moved['l2_l3'] / 2**30:,.1f} GiB "
                  f"(at {report['model']['kv_bytes_per_token']:,} B/token); ideal (infinite cache) hit ratio "
                  f"{_pct(report['ideal_hit_ratio'])}; requests too large for L1: {report['uncached_requests']}; "
                  f"bad lines skipped: {report['bad_lines']}; wall {report['wall_s']:.1f} s"))
    if "sweep" in report:
        print_sweep(report["sweep"], console)


def _stdout_console() -> Console:
    """Wide enough for the table when stdout is a file or a pipe (rich would assume 80 columns)."""
    console = Console()
    return console if console.is_terminal else Console(width=150)


def write_json(report: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


# ---- capacity sweep -----------------------------------------------------------------------------------
def sweep_config(config: ReplayConfig, total_tokens: int, min_l1_tokens: int = 0) -> ReplayConfig:
    """The tiered config at ``total_tokens`` of L1 + L2, split in the ratio of ``config`` (L3 off), with
    L1 at least ``min_l1_tokens`` (the longest prompt: an engine refuses to start with a KV pool that
    cannot hold one whole request, as vLLM checks max_model_len against it)."""
    page = config.page_size
    if config.l2_tokens is None:
        return replace(config, l1_tokens=max(page, total_tokens // page * page), l3="none")
    l1 = max(page, total_tokens * config.l1_tokens // config.total_tokens // page * page,
             min(-(-min_l1_tokens // page) * page, total_tokens // 2 // page * page))
    l2 = max(l1 + page, (total_tokens - l1) // page * page)
    return replace(config, l1_tokens=l1, l2_tokens=l2, l3="none")


def longest_prompt_tokens(requests: list) -> int:
    """The longest prompt of a trace, in tokens."""
    return max((r.input_length for r in requests), default=0)


def _sweep_hit_ratios(requests: list, config: ReplayConfig, engine: str, on_request) -> tuple[float, float]:
    """Hit ratios of the tiered cache and of one tier of its total size, by replay or by simulator."""
    flat = replace(config, l1_tokens=config.total_tokens, l2_tokens=None)
    if engine == "sim":
        from tierkv.replay.sim import from_cache_config, simulate

        return tuple(simulate(requests, from_cache_config(c.cache_config(), c.l1_tokens, c.l2_tokens)).hit_ratio
                     for c in (config, flat))
    return tuple(replay(requests, c, on_request).hit_ratio for c in (config, flat))


def run_sweep(trace: Trace, config: ReplayConfig, sizes: list[int], console: Console | None = None,
              policies: list[str] | None = None, engine: str = "replay") -> list[dict]:
    """Hit ratio against total capacity: tiered (same L1:L2 split), L1-only and MIN at each size, for
    ``config``'s policy and each of ``policies``; ``engine`` "sim" uses the page-level simulator
    (:mod:`tierkv.replay.sim`, the same tree and policies without KV pools) instead of the replay."""
    if engine not in ("replay", "sim"):
        raise ValueError(f"sweep engine {engine!r} is not one of ['replay', 'sim']")
    names = list(dict.fromkeys([config.eviction_policy] + list(policies or [])))
    points = []
    requests = trace.requests
    with progress_bars(console, 16) as bar:
        for total in sizes:
            tiered_cfg = sweep_config(config, total, longest_prompt_tokens(requests))
            opt = belady_min(requests, tiered_cfg.total_tokens, config.page_size).hit_ratio
            task = bar.add_task(f"sweep {total:,}", total=2 * len(requests) * len(names))
            per_policy = {}
            for name in names:
                tiered, flat = _sweep_hit_ratios(requests, replace(tiered_cfg, eviction_policy=name), engine,
                                                 lambda i: bar.advance(task))
                per_policy[name] = {"tiered_hit_ratio": tiered, "l1_only_hit_ratio": flat,
                                    "fraction_of_min": tiered / opt if opt else 0.0,
                                    "l1_only_fraction_of_min": flat / opt if opt else 0.0}
            main = per_policy[config.eviction_policy]
            points.append({"capacity_tokens": tiered_cfg.total_tokens, "l1_tokens": tiered_cfg.l1_tokens,
                           "l2_tokens": tiered_cfg.l2_tokens, "tiered_hit_ratio": main["tiered_hit_ratio"],
                           "l1_only_hit_ratio": main["l1_only_hit_ratio"], "optimal_hit_ratio": opt,
                           "fraction_of_min": main["fraction_of_min"], "policies": per_policy,
                           "engine": engine})
    return points


def print_sweep(points: list[dict], console: Console | None = None) -> None:
    table = Table(title="hit ratio vs total capacity (L1 + L2, no L3); (fraction of MIN)", title_justify="left")
    names = list(points[0]["policies"]) if points and "policies" in points[0] else []
    for col in ["capacity (tokens)", "L1", "L2", "optimal (MIN)"] + [
            f"{n} {kind}" for n in names for kind in ("tiered", "L1-only")]:
        table.add_column(col, justify="right")
    for p in points:
        cells = [f"{p['capacity_tokens']:,}", f"{p['l1_tokens']:,}", f"{p['l2_tokens'] or 0:,}",
                 _pct(p["optimal_hit_ratio"])]
        for n in names:
            q = p["policies"][n]
            cells += [f"{_pct(q['tiered_hit_ratio'])} ({q['fraction_of_min']:.2f})",
                      f"{_pct(q['l1_only_hit_ratio'])} ({q['l1_only_fraction_of_min']:.2f})"]
        table.add_row(*cells)
    _print_unpadded(console or _stdout_console(), table)


# ---- plots ------------------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(points: list[dict], path: str | Path, title: str = "") -> None:
    """Save :func:`sweep_figure` to ``path``."""
    plt = _pyplot()
    fig = sweep_figure(points, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sweep_figure(points: list[dict], title: str = ""):
    """Hit ratio against capacity (log x, a tick at each size swept, y from 0): MIN, and tiered and L1-only
    for each policy swept; ``title`` (the trace and the configuration) heads the figure."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [p["capacity_tokens"] for p in points]
    ax.plot(xs, [100 * p["optimal_hit_ratio"] for p in points], "k--", label="optimal (Belady MIN)")
    for i, name in enumerate(points[0]["policies"] if points else []):
        for key, label, style in (("l1_only_hit_ratio", "L1-only", ":o"), ("tiered_hit_ratio", "tiered", "-s")):
            ax.plot(xs, [100 * p["policies"][name][key] for p in points], style, color=f"C{i}",
                    label=f"{name} {label}")
    ax.set_xscale("log")
    ax.set_xticks(xs, [_size_label(x) for x in xs])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("total cache capacity (tokens)")
    ax.set_ylabel("hit ratio (% of prompt tokens)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    if points:
        split = f"L1:L2 {points[0]['l1_tokens']:,}:{points[0]['l2_tokens'] or 0:,} at the smallest size"
        ax.set_title("\n".join(t for t in (title, f"{split}; engine {points[0].get('engine', 'replay')}") if t),
                     fontsize=9)
    fig.tight_layout()
    return fig


def _size_label(num_tokens: int) -> str:
    for unit, scale in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if num_tokens >= scale:
            return f"{num_tokens / scale:g}{unit}"
    return str(num_tokens)


def sweep_title(report: dict) -> str:
    """The sweep plot's title: requests and trace, page size, policies."""
    cfg = report["config"]
    return (f"{report['requests']:,} requests of {Path(report['trace']).name}; page {cfg['page_size']}, "
            f"{cfg['write_policy']}, tiers {cfg.get('tier_mode', 'inclusive')}")


_TIER_COLOURS = {"L1": "#1f77b4", "L2": "#ff7f0e", "L3": "#2ca02c", "MIN (no tiers)": "#9467bd"}


def _config_line(report: dict) -> str:
    c = report["config"]
    l3 = "none" if c["l3"] in (None, "none") else c["l3"].split(":", 1)[0]
    return (f"L1 {c['l1_tokens']:,} + L2 {c['l2_tokens'] or 0:,} tokens, L3 {l3}, page {c['page_size']}, "
            f"{c['eviction_policy']}, {c['write_policy']}")


def plot_report(report: dict, path: str | Path) -> None:
    """Hit tokens per tier for each configuration, and modelled TTFT (mean, p50, p99)."""
    plt = _pyplot()
    base = report["baselines"]
    names, tiers = ["no cache"], [(0, 0, 0, 0)]
    if "l1_only" in base:
        names.append("L1-only")
        tiers.append((base["l1_only"]["hit_ratio"], 0, 0, 0))
    total = report["prompt_tokens"] or 1
    h = report["hit_tokens"]
    names += ["tiered", "optimal"]
    tiers += [(h["l1"] / total, h["l2"] / total, h["l3"] / total, 0), (0, 0, 0, base["optimal"]["hit_ratio"])]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.8))
    bottom = [0.0] * len(names)
    for i, tier in enumerate(("L1", "L2", "L3", "MIN (no tiers)")):
        vals = [100 * t[i] for t in tiers]
        ax1.bar(names, vals, bottom=bottom, label=tier, color=_TIER_COLOURS[tier])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.set_ylabel("hit ratio (% of prompt tokens)")
    ax1.legend()
    ttfts = [base["no_cache"]["ttft_s"]] + ([base["l1_only"]["ttft_s"]] if "l1_only" in base else [])
    ttfts += [report["ttft_s"], base["optimal"]["ttft_s"]]
    width = 0.27
    # Greys for the statistics, so no colour means a tier in one panel and a statistic in the other.
    for j, (stat, grey) in enumerate((("mean", "0.25"), ("p50", "0.5"), ("p99", "0.75"))):
        ax2.bar([i + (j - 1) * width for i in range(len(names))], [1000 * t[stat] for t in ttfts], width,
                label=stat, color=grey)
    ax2.set_xticks(range(len(names)), names)
    ax2.set_yscale("log")  # p99 is often 10-30x the p50: a linear axis flattens the means
    ax2.set_ylabel(f"modelled TTFT (ms, log scale), {report['model']['name']}")
    low, high = ax2.get_ylim()
    ax2.set_ylim(low, high * 4)  # room for the legend above the p99 bars
    ax2.legend(ncol=3, loc="upper center")
    fig.suptitle(f"{report['requests']:,} requests of {Path(report['trace']).name}\n{_config_line(report)}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
