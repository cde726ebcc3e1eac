"""`tierkv replay` with policies: every policy accepted, a sweep comparing policies with fractions of MIN,
MIN over a bounded L3, exclusive tiers from the command line."""

import json

import pytest

from tierkv.cache.config import CacheConfig
from tierkv.cli import main
from tierkv.eviction import POLICIES

from tests.test_replay import FIXTURE


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_replays_and_stays_under_min(tmp_path, policy):
    out = tmp_path / "r.json"
    assert main(["replay", str(FIXTURE), "--limit", "80", "--l1-tokens", "4k", "--l2-tokens", "20k",
                 "--policy", policy, "--no-baselines", "--serial", "--json", str(out), "--verify"]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["eviction_policy"] == policy
    assert 0 < report["hit_ratio"] <= report["optimal_hit_ratio"]
    assert report["fraction_of_min"] == pytest.approx(report["hit_ratio"] / report["optimal_hit_ratio"])


def test_sweep_compares_policies_with_fraction_of_min(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "sweep.png"
    assert main(["replay", str(FIXTURE), "--limit", "80", "--l1-tokens", "4k", "--l2-tokens", "20k",
                 "--tier-mode", "exclusive", "--sweep", "8k,30k", "--sweep-policies", "lru,hitdensity",
                 "--sweep-engine", "sim", "--no-baselines", "--serial", "--json", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["tier_mode"] == "exclusive"
    for point in report["sweep"]:
        assert set(point["policies"]) == {CacheConfig.eviction_policy, "lru", "hitdensity"}
        for result in point["policies"].values():
            assert 0 < result["fraction_of_min"] <= 1 and 0 < result["l1_only_fraction_of_min"] <= 1
    assert png.stat().st_size > 0


def test_unknown_sweep_policy_is_a_clear_error(capsys):
    assert main(["replay", str(FIXTURE), "--limit", "5", "--sweep", "8k", "--sweep-policies", "lru,nope"]) == 2
    assert "'nope'" in capsys.readouterr().err


def test_bounded_l3_bounds_min_at_all_three_tiers(tmp_path):
    out = tmp_path / "r.json"
    assert main(["replay", str(FIXTURE), "--limit", "80", "--l1-tokens", "4k", "--l2-tokens", "12k",
                 "--l3", f"file:{tmp_path / 'l3'}", "--l3-tokens", "30k", "--no-baselines", "--serial",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["optimal_capacity_tokens"] == 46_000
    tiers = report["baselines"]["optimal_l1_l2"]
    assert tiers["capacity_tokens"] == 16_000 and tiers["hit_ratio"] <= report["optimal_hit_ratio"]
    assert tiers["l1_l2_hit_ratio"] <= tiers["hit_ratio"]
