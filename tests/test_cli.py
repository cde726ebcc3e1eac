import gzip
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tierkv.cli import main

FIXTURE = Path(__file__).parent / "fixtures" / "conversation_200.jsonl"
REQUIRED = {"requests", "prompt_tokens", "hit_tokens", "hit_ratio", "optimal_hit_ratio", "no_cache_ttft_s",
            "ttft_s", "bytes_moved", "wall_s"}


def test_replay_writes_json_with_the_required_fields_and_a_plot(tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["replay", str(FIXTURE), "--limit", "80", "--l1-tokens", "8k", "--l2-tokens", "24k",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert REQUIRED <= report.keys()
    assert set(report["hit_tokens"]) == {"l1", "l2", "l3"}
    assert set(report["ttft_s"]) == {"mean", "p50", "p99"}
    assert set(report["bytes_moved"]) == {"l1_l2", "l2_l3"}
    assert report["requests"] == 80
    assert report["hit_ratio"] == pytest.approx(sum(report["hit_tokens"].values()) / report["prompt_tokens"])
    assert report["hit_ratio"] <= report["optimal_hit_ratio"]
    assert report["ttft_s"]["mean"] < report["no_cache_ttft_s"]
    assert report["bytes_moved"]["l1_l2"] > 0 and report["bytes_moved"]["l2_l3"] == 0
    assert report["baselines"]["l1_only"]["capacity_tokens"] == 32_000
    assert png.stat().st_size > 0
    assert "optimal (MIN)" in capsys.readouterr().out


def test_replay_with_file_l3_and_sweep(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "sweep.png"
    rc = main(["replay", str(FIXTURE), "--limit", "60", "--l1-tokens", "6k", "--l2-tokens", "16k",
               "--l3", f"file:{tmp_path / 'l3'}", "--sweep", "10k,40k", "--plot", str(png), "--json", str(out), "--serial",
               "--model", "qwen2.5-7b", "--l2-gbps", "20"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["hit_tokens"]["l3"] > 0 and report["bytes_moved"]["l2_l3"] > 0
    assert report["optimal_capacity_tokens"] is None  # L3 is unbounded
    assert report["model"]["name"] == "qwen2.5-7b" and report["model"]["l2_link"]["bandwidth_bytes_per_s"] == 20e9
    assert [p["capacity_tokens"] for p in report["sweep"]] == [10_000, 40_000]
    for p in report["sweep"]:
        assert p["tiered_hit_ratio"] <= p["optimal_hit_ratio"] and p["l1_only_hit_ratio"] <= p["optimal_hit_ratio"]
    assert png.stat().st_size > 0


def test_bad_line_is_an_error_naming_the_line_unless_skipped(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    lines = FIXTURE.read_text().splitlines()[:5]
    lines.insert(2, '{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []}')
    trace.write_text("\n".join(lines) + "\n")
    assert main(["replay", str(trace)]) == 2
    assert "trace line 3" in capsys.readouterr().err
    out = tmp_path / "r.json"
    assert main(["replay", str(trace), "--skip-bad", "--json", str(out), "--no-baselines", "--serial"]) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 5 and report["bad_lines"] == 1 and "l1_only" not in report["baselines"]


def test_bad_options_are_clear_errors(capsys):
    assert main(["replay", str(FIXTURE), "--l2-tokens", "1k", "--l1-tokens", "2k"]) == 2
    assert "l2_tokens" in capsys.readouterr().err
    for bad in ("lots", "inf", "1e400", "1e12", "nan"):
        with pytest.raises(SystemExit) as info:
            main(["replay", str(FIXTURE), "--l1-tokens", bad])
        err = capsys.readouterr().err
        assert info.value.code == 2 and "argument --l1-tokens: bad token count" in err and "Traceback" not in err
    assert main(["replay", str(FIXTURE), "--l3", "tape://x"]) == 2
    assert "tape://x" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["replay", str(FIXTURE), "--policy", "nope"])


def test_serve_and_bench_engine_dispatch_lazily(monkeypatch):
    calls = []
    fake = types.ModuleType("tierkv.engine.cli")
    fake.serve_main = lambda argv: calls.append(("serve", argv)) or 0
    fake.bench_main = lambda argv: calls.append(("bench", argv)) or 3
    monkeypatch.setitem(sys.modules, "tierkv.engine.cli", fake)
    assert main(["serve", "--port", "8000"]) == 0
    assert main(["bench", "engine", "--quick"]) == 3
    assert calls == [("serve", ["--port", "8000"]), ("bench", ["--quick"])]


def test_missing_engine_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tierkv.engine.cli", None)
    assert main(["serve"]) == 2
    assert "needs the engine" in capsys.readouterr().err
    assert main(["bench"]) == 2


def test_python_dash_m_tierkv_runs():
    proc = subprocess.run([sys.executable, "-m", "tierkv", "replay", "--help"], capture_output=True, text=True,
                          cwd=Path(__file__).parent.parent, timeout=120)
    assert proc.returncode == 0 and "--l1-tokens" in proc.stdout


def test_version_and_bench_help_exit_zero(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("tierkv 0.")
    assert main(["bench", "--help"]) == 0
    assert "tierkv bench engine" in capsys.readouterr().out
    assert main(["bench"]) == 2


def test_replay_help_shows_defaults_and_models(capsys):
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    out = capsys.readouterr().out
    assert "(default: 500k)" in out and "llama-3-8b" in out


def test_replay_reads_gz_and_skips_a_non_utf8_line_by_number(tmp_path, capsys):
    lines = FIXTURE.read_bytes().splitlines(keepends=True)[:6]
    lines.insert(3, b'{"timestamp": 0, "bad": "\xff"}\n')
    trace = tmp_path / "t.jsonl.gz"
    trace.write_bytes(gzip.compress(b"".join(lines)))
    assert main(["replay", str(trace), "--no-baselines", "--serial"]) == 2
    assert "trace line 4: not UTF-8" in capsys.readouterr().err
    out = tmp_path / "r.json"
    assert main(["replay", str(trace), "--skip-bad", "--no-baselines", "--serial", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 6 and report["bad_lines"] == 1
