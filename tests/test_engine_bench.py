"""The engine benchmark: every row runs, rows are named as the report expects, outputs agree across modes."""

from engine_helpers import single_torch_thread  # noqa: F401  (autouse fixture)
from tierkv.engine.bench import ChatWorkload, engine_config, format_table, main, run_all

TINY = ChatWorkload(num_conversations=3, num_turns=2, system_tokens=48, user_tokens=24, output_tokens=3)


def test_all_rows_run_and_agree():
    results = run_all("tiny-llama", TINY)
    assert [r.mode for r in results] == ["none", "l1", "l1+l2", "l1+l2+l3"]
    assert all(r.error is None for r in results)
    assert all(r.outputs == results[0].outputs for r in results)
    assert sum(results[0].hit_tokens.values()) == 0
    assert results[2].hit_tokens["L1"] + results[2].hit_tokens["L2"] > 0
    table = format_table(results)
    for label in ("no cache", "L1 only", "L1+L2", "L1+L2+L3", "outputs identical across modes: yes"):
        assert label in table


def test_l2_is_sized_above_l1_and_alike_with_and_without_l3():
    l2 = engine_config("l1+l2", TINY, "cpu", "/tmp/unused", 64)
    l3 = engine_config("l1+l2+l3", TINY, "cpu", "/tmp/unused", 64)
    assert l2.hicache_ratio == l3.hicache_ratio >= 1.5 and l3.l3 == "file:/tmp/unused"
    assert l2.l1_tokens == l3.l1_tokens


def test_exclusive_tiers_run_and_agree_with_no_cache(capsys):
    assert main(["--conversations", "3", "--turns", "2", "--system-tokens", "48", "--quick",
                 "--tier-mode", "exclusive"]) == 0
    printed = capsys.readouterr().out
    assert "exclusive tiers" in printed and "outputs identical across modes: yes" in printed
    results = run_all("tiny-llama", TINY, modes=("l1+l2",), tier_mode="exclusive")
    assert results[0].error is None and results[0].hit_tokens["L1"] + results[0].hit_tokens["L2"] > 0


def test_cli_prints_the_table(capsys, tmp_path):
    out_json = tmp_path / "r.json"
    assert main(["--conversations", "2", "--turns", "2", "--system-tokens", "32", "--quick",
                 "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "TTFT p50 ms" in printed and "L1+L2+L3" in printed
    assert out_json.read_text().count('"mode"') == 4


def test_crossover_table_over_two_models(capsys):
    assert main(["--conversations", "2", "--turns", "2", "--system-tokens", "32", "--quick", "--repeats", "2",
                 "--models", "tiny-llama,tiny-qwen3"]) == 0
    printed = capsys.readouterr().out
    for label in ("tiny-llama", "tiny-qwen3", "p50 ratio min/med", "outputs identical to no cache in every run: yes"):
        assert label in printed
    assert "L1 only" not in printed


def test_copy_benchmark_rows():
    from bench.copybench import format_rows, measure
    rows = measure("cpu", size_mib=1, repeats=1)
    assert [r["case"] for r in rows][1:] == ["kernel/layer_first", "kernel/page_first", "direct/page_first_direct"]
    assert all(r["write_gbps"] > 0 for r in rows) and "write vs flat" in format_rows(rows)


def test_a_device_that_cannot_run_the_model_is_refused_before_the_runs(capsys):
    """24.7: `--device meta` was accepted; every run then failed."""
    assert main(["--device", "meta", "--quick"]) == 2
    assert "--device meta" in capsys.readouterr().err
