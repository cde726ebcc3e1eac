"""`tierkv replay` fails before the work, and its report reads on an 80-column terminal and in a CI log."""

import gzip
import io
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from tierkv.replay import report as rep

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "data/traces/conversation_trace.jsonl.gz"


def _replay(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierkv", "replay", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout_s)


def test_an_unwritable_json_path_is_refused_before_the_replay(tmp_path):
    proc = _replay(str(TRACE), "--limit", "50", "--no-baselines", "--json", "/dev/null/report.json")
    assert proc.returncode == 2 and "--json" in proc.stderr and "/dev/null/report.json" in proc.stderr
    assert "tiered" not in proc.stdout  # no report: nothing was replayed


def test_an_unwritable_plot_path_is_refused_before_the_replay(tmp_path):
    proc = _replay(str(TRACE), "--limit", "50", "--no-baselines", "--plot", str(tmp_path / "missing" / "p.png"))
    assert proc.returncode == 2 and "--plot" in proc.stderr and "does not exist" in proc.stderr


def test_an_unreachable_l3_is_refused_and_its_password_never_shown():
    proc = _replay(str(TRACE), "--limit", "50", "--no-baselines", "--l3", "redis://:hunter2secret@127.0.0.1:1/0")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "L3" in proc.stderr and "hunter2secret" not in proc.stderr + proc.stdout
    assert "tiered" not in proc.stdout


def test_an_empty_trace_and_limit_zero_are_refused(tmp_path):
    empty = tmp_path / "empty.jsonl.gz"
    with gzip.open(empty, "wt") as f:
        f.write("")
    proc = _replay(str(empty), "--no-baselines")
    assert proc.returncode == 2 and "no requests" in proc.stderr
    proc = _replay(str(TRACE), "--limit", "0", "--no-baselines")
    assert proc.returncode == 2 and "--limit" in proc.stderr


def _report() -> dict:
    ttft = {"mean": 0.123456, "p50": 0.1, "p99": 1.5}
    return {"requests": 12031, "prompt_tokens": 123_456_789,
            "config": {"l1_tokens": 500_000, "l2_tokens": 4_000_000, "l3": "file:/tmp/x", "page_size": 512,
                       "eviction_policy": "gdsf", "write_policy": "write_through"},
            "model": {"name": "llama-3-8b", "kv_bytes_per_token": 131072},
            "baselines": {"no_cache": {"ttft_s": ttft},
                          "l1_only": {"capacity_tokens": 4_500_000, "hit_tokens": 29_615_123, "hit_ratio": 0.2,
                                      "ttft_s": ttft},
                          "optimal": {"capacity_tokens": None, "hit_tokens": 46_012_345, "hit_ratio": 0.373,
                                      "ttft_s": ttft}},
            "hit_tokens": {"l1": 21_000_321, "l2": 17_654_321, "l3": 7_123_456}, "hit_ratio": 0.3729,
            "ttft_s": ttft, "bytes_moved": {"l1_l2": 2**40, "l2_l3": 2**39}, "ideal_hit_ratio": 0.373,
            "uncached_requests": 0, "bad_lines": 0, "wall_s": 76.0}


@pytest.mark.parametrize("width", [80, 150])
def test_the_report_never_cuts_a_number_and_pads_no_line(width):
    out = io.StringIO()
    rep.print_report(_report(), Console(file=out, width=width, force_terminal=False, color_system=None))
    text = out.getvalue()
    for number in ("29,615,123", "21,000,321", "17,654,321", "7,123,456", "46,012,345", "4,500,000", "37.29 %"):
        assert number in text, f"{number} cut at {width} columns:\n{text}"
    assert "…" not in text
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), text
    assert not [line for line in lines if line != line.rstrip()], "lines padded with spaces"


def test_a_log_that_is_not_a_terminal_gets_progress_lines_with_rate_and_time_left():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False)
    with rep.progress_bars(console, 10) as bar:
        bar.interval_s = 0.0
        task = bar.add_task("tiered", total=4)
        for _ in range(4):
            bar.advance(task)
    lines = out.getvalue().splitlines()
    assert lines and lines[-1].startswith("tiered: 4/4 requests (")
    assert "/s" in lines[0] and "left" in lines[0]


def test_the_sweep_plot_has_a_title_a_tick_per_size_and_a_y_axis_from_zero():
    points = [{"capacity_tokens": c, "l1_tokens": c // 9, "l2_tokens": c - c // 9, "optimal_hit_ratio": 0.3,
               "engine": "sim", "policies": {"gdsf": {"tiered_hit_ratio": 0.2, "l1_only_hit_ratio": 0.21}}}
              for c in (250_000, 1_000_000, 4_500_000)]
    fig = rep.sweep_figure(points, "12,031 requests of conversation_trace.jsonl.gz; page 16")
    ax = fig.axes[0]
    assert [round(t) for t in ax.get_xticks()] == [250_000, 1_000_000, 4_500_000]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["250k", "1M", "4.5M"]
    assert ax.get_ylim()[0] == 0
    assert "conversation_trace" in ax.get_title() and "page 16" in ax.get_title()
    rep._pyplot().close(fig)
