"""Random request sequences through the vLLM connector's two halves (no vLLM), every eviction policy.

Each block's KV is a known function of the tokens up to its end (as in a real model), written into
"vLLM's" blocks when a request computes them; every L2 hit the connector plans is then checked block
by block after the worker's copy, and after every step: the tree's invariants, every L2 page owned by
exactly one node, and no host_ref or request left behind once requests finish. A second machine adds
a file L3 and restarts, so L3 hits (loaded asynchronously) are checked too.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import zlib

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from tests.test_vllm_plan import BLOCK, BLOCK_SHAPE, Pair

POLICIES = ("gdsf", "lru", "s3fifo", "arc", "tinylfu", "hitdensity", "slru")
# a few conversations' histories (one to three blocks) and what a turn adds: prompts share whole blocks
PREFIXES = ([], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9], [7, 7, 7, 7, 8, 8, 8, 8])
tokens_st = st.builds(lambda prefix, tail: prefix + tail, st.sampled_from(PREFIXES),
                      st.lists(st.integers(0, 9), min_size=1, max_size=9))


def block_kv(prefix: list[int], layer: int) -> torch.Tensor:
    """The KV of the block that ends ``prefix``, in one layer: exact, and different for any other prefix."""
    seed = zlib.crc32(bytes(prefix) + bytes([layer]))
    return torch.randn(BLOCK_SHAPE, generator=torch.Generator().manual_seed(seed))


class ConnectorMachine(RuleBasedStateMachine):
    with_l3 = False

    @initialize(policy=st.sampled_from(POLICIES), pages=st.integers(2, 10))
    def setup(self, policy: str, pages: int) -> None:
        self.l3_dir = tempfile.mkdtemp(prefix="tierkv-vllm-l3-") if self.with_l3 else None
        self.policy, self.pages = policy, pages
        self.pair = Pair(self.l3_dir, pages=pages, policy=policy)
        self.num_requests = 0
        self.async_loads: set[str] = set()

    def teardown(self) -> None:
        if hasattr(self, "pair"):
            self.pair.close()
        if getattr(self, "l3_dir", None) is not None:
            shutil.rmtree(self.l3_dir, ignore_errors=True)

    def _admit(self, prompt: list[int], first_block: int) -> tuple[str, list[int], int]:
        """vLLM's side of a new request: ask for the external hit, allocate blocks, take what is offered."""
        req_id = f"r{self.num_requests}"
        self.num_requests += 1
        blocks = list(range(first_block, first_block + -(-len(prompt) // BLOCK)))
        hit, is_async = self.pair.match(req_id, prompt)
        assert hit is not None
        assert self.l3_dir is not None or not is_async  # without L3, L2 answers at once
        assert hit % BLOCK == 0 and hit <= (len(prompt) - 1) // BLOCK * BLOCK
        self.pair.scheduler.after_alloc(req_id, prompt, blocks, hit)
        if is_async:
            self.async_loads.add(req_id)
        return req_id, blocks, hit

    def _wait_loads(self, finished: set[str]) -> None:
        """vLLM waits for a request's asynchronous (L3) load before computing (``finished``: those the
        step's report already carried); none may fail here."""
        self.async_loads -= finished
        deadline = time.monotonic() + 10
        while self.async_loads and time.monotonic() < deadline:
            self.async_loads -= self.pair.report()
            time.sleep(0.002)
        assert not self.async_loads, f"L3 loads never finished: {self.async_loads}"
        assert self.pair.worker.take_load_errors() == set()

    def _check_loaded(self, prompt: list[int], blocks: list[int], hit: int) -> None:
        for b in range(hit // BLOCK):
            for layer, kv in enumerate(self.pair.layers):
                assert torch.equal(kv[blocks[b]], block_kv(prompt[:(b + 1) * BLOCK], layer)), \
                    f"hit block {b} of {prompt} (from L2 or L3) is not its KV"

    def _compute_and_save(self, req_id: str, prompt: list[int], blocks: list[int], hit: int) -> None:
        for b in range(hit // BLOCK, len(prompt) // BLOCK):  # the model computes the full blocks past the hit
            for layer, kv in enumerate(self.pair.layers):
                kv[blocks[b]] = block_kv(prompt[:(b + 1) * BLOCK], layer)
        self.pair.scheduler.plan_save(req_id, prompt, blocks, len(prompt))

    def _settle(self) -> None:
        """What must finish before the leak checks (nothing without L3)."""

    @rule(prompt=tokens_st)
    def one_request(self, prompt: list[int]) -> None:
        req_id, blocks, hit = self._admit(prompt, 0)
        self._wait_loads(self.pair.step())
        self._check_loaded(prompt, blocks, hit)
        self._compute_and_save(req_id, prompt, blocks, hit)
        self.pair.step()
        self.pair.scheduler.request_finished(req_id)

    @rule(first=tokens_st, second=tokens_st)
    def two_requests_in_one_step(self, first: list[int], second: list[int]) -> None:
        """Both admitted before either computes: the second's saves may find L2 full of pages the first
        protects; what it cannot save is skipped, never taken from the first."""
        admitted = [(prompt, *self._admit(prompt, start)) for prompt, start in ((first, 0), (second, 8))]
        self._wait_loads(self.pair.step())
        for prompt, req_id, blocks, hit in admitted:
            self._check_loaded(prompt, blocks, hit)
            self._compute_and_save(req_id, prompt, blocks, hit)
        self.pair.step()
        for _, req_id, _, _ in admitted:
            self.pair.scheduler.request_finished(req_id)

    @invariant()
    def nothing_leaked(self) -> None:
        if not hasattr(self, "pair"):
            return
        self._settle()
        summary = self.pair.scheduler.state_summary()
        assert summary["integrity"] == "ok", summary
        assert summary["host_refs"] == 0 and summary["tracked_requests"] == 0, summary


class ConnectorWithL3Machine(ConnectorMachine):
    """The same with a file L3 shared by restarts: a new pair (a new vLLM process) finds what the last
    one backed up, and every L3 hit, loaded asynchronously, is checked as the L2 hits are."""

    with_l3 = True

    @rule()
    def restart(self) -> None:
        self.pair.wait_backups()
        self.pair.close()
        self.pair = Pair(self.l3_dir, pages=self.pages, policy=self.policy)

    def _settle(self) -> None:
        self.pair.wait_backups()  # a backup still being written protects its path until the worker reports it


def test_connector_state_machine(tree_impl):
    """Once over the compiled tree, once over the pure-Python one."""
    run_state_machine_as_test(ConnectorMachine, settings=settings(
        max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]))


def test_connector_with_l3_state_machine():
    run_state_machine_as_test(ConnectorWithL3Machine, settings=settings(
        max_examples=15, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]))
