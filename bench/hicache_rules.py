"""tierkv's rules against HiCache's, by page simulation (issue 13 items 5 and 6, issue 24 item 13).

For each trace, policy, write policy and L1:L2 ratio, the simulator (tierkv.replay.sim) runs twice, one
rule on and off. "on" is the rule named, "off" its opposite:
- ``l2_evicts_l1_resident`` (on, tierkv: L2 eviction may drop the copy of a node still in L1; off,
  HiCache: only host-only leaves);
- ``write_back_ancestors`` (on, tierkv before: write-back copies the node's un-backed ancestors with it;
  off, HiCache and tierkv now: only the node, an ancestor when it is evicted in turn);
- ``evict_whole_length`` (on, HiCache: a load back or an L2 write short of room evicts the whole length
  it needs; off, tierkv: only the shortfall);
- ``refresh_split_tail`` (on, HiCache: a match or insert that splits a node refreshes its tail too;
  off, tierkv: only the matched head);
- ``write_back_counts_uses`` (on, tierkv before: LFU and SLRU count uses under write_back; off, HiCache
  and tierkv now: none, LRU order). Acts on lfu and slru only: pass ``--policies lfu,slru``.
Prints hit ratio, L2 hit ratio and tokens copied L1 -> L2 for both.

Run:  python bench/hicache_rules.py data/traces/conversation_trace.jsonl.gz data/traces/synthetic_trace.jsonl.gz
          [--l1-tokens 500k] [--ratios 1,2,8] [--policies lru,gdsf] [--rules RULE,...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tierkv.replay.report import parse_size  # noqa: E402
from tierkv.replay.sim import SimConfig, simulate  # noqa: E402
from tierkv.replay.trace import load_trace  # noqa: E402

# the rule, and the write policies (write_threshold: 1 write_through, 2 selective, None write_back) it acts in
ALL = (1, 2, None)
RULES = {"l2_evicts_l1_resident": ALL, "write_back_ancestors": (None,), "evict_whole_length": ALL,
         "refresh_split_tail": ALL, "write_back_counts_uses": (None,)}
WRITE_POLICY = {1: "write_through", 2: "write_through_selective", None: "write_back"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--l1-tokens", default="500k")
    parser.add_argument("--ratios", default="1,2,8", help="L2 size as a multiple of L1")
    parser.add_argument("--policies", default="lru,gdsf")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--rules", default="l2_evicts_l1_resident,write_back_ancestors",
                        help=f"which rules to flip, of {', '.join(RULES)}")
    args = parser.parse_args()
    l1 = parse_size(args.l1_tokens)
    print("| trace | policy | write policy | L1:L2 | rule | hit % on | hit % off | L2 hit % on | "
          "L2 hit % off | copied tokens on | copied tokens off |")
    print("|" + " --- |" * 11)
    for path in args.traces:
        requests = load_trace(path, limit=args.limit).requests
        for policy in args.policies.split(","):
            for rule in args.rules.split(","):
                write_thresholds = RULES[rule]
                for threshold in write_thresholds:
                    for ratio in (int(r) for r in args.ratios.split(",")):
                        base = dict(l1_tokens=l1, l2_tokens=l1 * ratio, eviction_policy=policy,
                                    write_threshold=threshold)
                        on, off = (simulate(requests, SimConfig(**base, **{rule: value}))
                                        for value in (True, False))
                        print(f"| {Path(path).name.split('.')[0]} | {policy} | {WRITE_POLICY[threshold]} | 1:{ratio} "
                              f"| {rule} | {100 * on.hit_ratio:.2f} | {100 * off.hit_ratio:.2f} "
                              f"| {100 * on.l2_hit_tokens / on.prompt_tokens:.2f} "
                              f"| {100 * off.l2_hit_tokens / off.prompt_tokens:.2f} "
                              f"| {on.written_tokens:,} | {off.written_tokens:,} |", flush=True)


if __name__ == "__main__":
    main()
