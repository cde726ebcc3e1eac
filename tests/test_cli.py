import argparse
import ast
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tierkv.cli import build_parser, main

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


def _all_parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _all_parsers(child)


def test_serve_and_bench_are_nested_subcommands_with_help_for_every_flag(capsys):
    """29.11: serve and bench were hand-dispatched (add_help=False), flags had no help, defaults showed
    twice or empty."""
    parser = build_parser()
    parsers = {p.prog: p for p in _all_parsers(parser)}
    assert {"tierkv replay", "tierkv serve", "tierkv bench", "tierkv bench engine"} <= parsers.keys()
    for prog, sub in parsers.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{prog} {action.option_strings[0]} has no help"
                shown = formatter._expand_help(action)
                assert shown.count("(default") <= 1, (prog, shown)  # once, not twice
                assert "(default: None)" not in shown and "(default: )" not in shown, (prog, shown)
    for argv, shown in ((["serve", "--help"], "--hicache-write-policy"), (["bench", "--help"], "engine"),
                        (["bench", "engine", "--help"], "--conversations")):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 0 and shown in capsys.readouterr().out


def test_nested_serve_and_bench_engine_run_their_commands(capsys):
    assert main(["serve", "--model", "tiny-llama", "--device", "meta"]) == 2
    assert "tierkv serve: error: --device meta" in capsys.readouterr().err
    assert main(["bench", "engine", "--conversations", "2", "--turns", "2", "--system-tokens", "32", "--quick"]) == 0
    assert "outputs identical across modes: yes" in capsys.readouterr().out


def test_missing_engine_is_a_clear_error_and_replay_still_parses(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tierkv.engine.cli", None)
    assert main(["serve", "--model", "tiny-llama"]) == 2
    assert "needs the engine" in capsys.readouterr().err
    assert main(["bench", "engine", "--quick"]) == 2
    with pytest.raises(SystemExit) as info:
        main(["replay", "--help"])
    assert info.value.code == 0


def test_cli_modules_import_one_way():
    """29.11: tierkv.cli <-> tierkv.engine.cli (token_count) and engine.bench <-> bench_crossover were circles."""
    root = Path(__file__).parent.parent / "tierkv"

    def imports(path: Path) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        return names

    assert "tierkv.cli" not in imports(root / "engine" / "cli.py")
    assert "tierkv.engine.bench" not in imports(root / "engine" / "bench_crossover.py")
    assert "tierkv.engine.bench" not in imports(root / "engine" / "bench_workload.py")


def test_python_dash_m_tierkv_runs():
    proc = subprocess.run([sys.executable, "-m", "tierkv", "replay", "--help"], capture_output=True, text=True,
                          cwd=Path(__file__).parent.parent, timeout=120)
    assert proc.returncode == 0 and "--l1-tokens" in proc.stdout


def test_version_and_bench_help_exit_zero(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("tierkv 0.")
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0 and "tierkv bench" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["bench"])
    assert info.value.code == 2 and "BENCHMARK" in capsys.readouterr().err


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
