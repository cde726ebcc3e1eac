"""The GPU check's benchmark scripts run end to end in their tiny CPU mode (their figures mean nothing
on a CPU: this only keeps the scripts working between GPU sessions)."""

import json

from bench import bench_engine_repeats, bench_gpu_copy


def test_copy_tables_tiny(tmp_path, capsys):
    out = tmp_path / "copy.json"
    assert bench_gpu_copy.main(["--tiny", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for label in ("kernel/layer_first/torch", "direct/page_first_direct/torch", "layer-wise", "overlap",
                  "flat pinned copy GB/s (load)", "bit-exact on cpu"):
        assert label in printed
    result = json.loads(out.read_text())
    assert all(result["exact"].values()) and {r["tokens"] for r in result["copies"]} == {64, 256}
    assert all(r["ratio_min"] > 0 for r in result["copies"])


def test_engine_table_tiny(tmp_path, capsys):
    out = tmp_path / "engine.json"
    assert bench_engine_repeats.main(["--tiny", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["none", "l1", "l1+l2", "l1+l2+l3"]
    assert all(r["error"] is None and r["repeats"] == 2 and r["same_outputs"] for r in rows)
    assert "L1+L2+L3" in capsys.readouterr().out


def test_engine_table_with_l2_too_small(tmp_path, capsys):
    """gpu_check's L3 step: more conversations and a smaller L2 than the workload's own."""
    out = tmp_path / "engine_l3.json"
    assert bench_engine_repeats.main(["--tiny", "--conversations", "6", "--l2-fraction", "0.1",
                                      "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "6 conversations x 2 turns" in printed and "L2 0.1 of the working set" in printed
    rows = json.loads(out.read_text())
    assert all(r["error"] is None and r["same_outputs"] for r in rows)
