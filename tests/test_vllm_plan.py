"""The two halves of the vLLM connector without vLLM: the scheduler's plans run by the worker's copies.

Real tensors stand in for vLLM's per-layer KV blocks, real file stores for L3; a step is what vLLM does
with the hooks: plan (scheduler), start_step / finish_step (worker), report back.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tierkv.integrations.vllm_config import ConnectorConfig, KVGeometry, host_pages
from tierkv.integrations.vllm_io import WorkerTiers
from tierkv.integrations.vllm_plan import SchedulerTiers
from tierkv.storage.config import StorageConfig
from tierkv.storage.factory import open_store
from tierkv.storage.file_pack import pack_pages

BLOCK, LAYERS, DEVICE_BLOCKS = 4, 2, 32
BLOCK_SHAPE = (1, BLOCK, 8)  # kv_heads, block_size, K and V of head_dim 4
BLOCK_NBYTES = 1 * BLOCK * 8 * 4


class Pair:
    """A scheduler half and a worker half over one set of 'vLLM' KV tensors."""

    def __init__(self, tmp_path: Path | None = None, pages: int = 16, faults: dict | None = None,
                 read_timeout_s: float = 5.0, policy: str = ConnectorConfig.eviction_policy) -> None:
        backend = f"file://{tmp_path}" if tmp_path is not None else None
        backend_config = {"faults": faults} if faults else {}
        storage = StorageConfig(prefetch_threshold=0, prefetch_timeout_base=read_timeout_s,
                                prefetch_timeout_per_ki_token=0.0, io_wait_timeout_s=0.5,
                                backend_config=backend_config)
        self.config = ConnectorConfig(storage_backend=backend, storage=storage, eviction_policy=policy)
        self.geometry = KVGeometry("tiny", "test", "float32", BLOCK_SHAPE, LAYERS, BLOCK, BLOCK_NBYTES,
                                   DEVICE_BLOCKS, pages)
        stores = [open_store(backend, self.geometry.store_namespace(0), self.geometry.page_nbytes,
                             dict(backend_config)) if backend else None for _ in range(2)]
        self.scheduler = SchedulerTiers(self.config, self.geometry, stores[0])
        self.worker = WorkerTiers(self.config, self.geometry, stores[1])
        self.layers = [torch.randn(DEVICE_BLOCKS, *BLOCK_SHAPE) for _ in range(LAYERS)]
        self.worker.register(self.layers)

    def step(self) -> set[str]:
        """One engine step; the requests whose asynchronous loads the worker reported finished."""
        plan = self.scheduler.take_plan()
        self.worker.start_step(plan)
        self.worker.finish_step(plan)
        return self.report()

    def report(self) -> set[str]:
        report = self.worker.take_report()
        finished = self.worker.take_finished_loads()
        self.scheduler.on_worker_report(finished, report.backups_done, report.counters)
        return finished

    def match(self, req_id: str, prompt: list[int], local_hit: int = 0, timeout_s: float = 10.0,
              extra_key: str | None = None):
        deadline = time.monotonic() + timeout_s
        while True:
            answer = self.scheduler.num_new_matched_tokens(req_id, prompt, local_hit, extra_key)
            if answer[0] is not None or time.monotonic() > deadline:
                return answer
            time.sleep(0.01)

    def compute(self, req_id: str, prompt: list[int], blocks: list[int], extra_key: str | None = None) -> None:
        """A request with no hit: vLLM computes it all, the connector saves its full blocks."""
        assert self.match(req_id, prompt, extra_key=extra_key) == (0, False)
        self.scheduler.after_alloc(req_id, prompt, blocks, 0, extra_key)
        self.scheduler.plan_save(req_id, prompt, blocks, len(prompt))
        self.step()
        self.scheduler.request_finished(req_id)

    def load_async(self, req_id: str, prompt: list[int], blocks: list[int], timeout_s: float = 10.0) -> str | None:
        """Plan and start a whole-prompt L3 load; the request id once the worker reports it finished."""
        assert self.match(req_id, prompt) == (HIT, True)
        self.scheduler.after_alloc(req_id, prompt, blocks, HIT)
        self.step()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if req_id in self.report():
                return req_id
            time.sleep(0.01)
        return None

    def wait_backups(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.scheduler.backups and time.monotonic() < deadline:
            time.sleep(0.01)
            self.report()
        assert not self.scheduler.backups

    def blocks_equal(self, a: list[int], b: list[int]) -> bool:
        return all(torch.equal(layer[a], layer[b]) for layer in self.layers)

    def close(self) -> None:
        self.worker.close()
        self.scheduler.close()


PROMPT = list(range(100, 114))  # 14 tokens: 3 full blocks, and the last token is never a hit
HIT = 12


def test_l2_hit_copies_the_saved_blocks_into_new_ones():
    pair = Pair()
    pair.compute("r1", PROMPT, [0, 1, 2, 3])
    assert pair.match("r2", PROMPT) == (HIT, False)
    pair.scheduler.after_alloc("r2", PROMPT, [5, 6, 7, 8], HIT)
    pair.step()
    assert pair.blocks_equal([0, 1, 2], [5, 6, 7])
    assert pair.scheduler.stats.loaded_l2_tokens == HIT
    pair.scheduler.request_finished("r2")
    pair.scheduler.check_integrity()
    assert pair.scheduler.state_summary()["host_refs"] == 0
    pair.close()


def test_the_device_copy_path_moves_the_same_bytes(tmp_path):
    """The torch copies used for device KV (vLLM on a GPU), run here on CPU tensors: saves, L2 loads and L3 loads."""
    writer = Pair(tmp_path)
    writer.worker._layer_arrays = None  # what register() sets for non-CPU KV tensors
    writer.compute("r1", PROMPT, [0, 1, 2, 3])
    assert writer.match("r2", PROMPT) == (HIT, False)
    writer.scheduler.after_alloc("r2", PROMPT, [5, 6, 7, 8], HIT)
    writer.step()
    assert writer.blocks_equal([0, 1, 2], [5, 6, 7])
    writer.scheduler.request_finished("r2")
    writer.wait_backups()
    reader = Pair(tmp_path)
    reader.worker._layer_arrays = None
    for layer, source in zip(reader.layers, writer.layers):
        layer[:4] = source[:4]
    assert reader.load_async("r3", PROMPT, [9, 10, 11, 12]) == "r3"
    assert reader.worker.take_load_errors() == set()
    assert reader.blocks_equal([0, 1, 2], [9, 10, 11])
    reader.scheduler.request_finished("r3")
    for pair in (writer, reader):
        pair.close()


def test_hit_beyond_vllms_own_prefix_loads_only_the_rest():
    pair = Pair()
    pair.compute("r1", PROMPT, [0, 1, 2, 3])
    assert pair.match("r2", PROMPT, local_hit=BLOCK) == (HIT - BLOCK, False)
    pair.scheduler.after_alloc("r2", PROMPT, [0, 9, 10, 11], HIT - BLOCK)
    plan = pair.scheduler.plan
    assert plan.loads[0].block_ids == [9, 10]
    pair.step()
    assert pair.blocks_equal([1, 2], [9, 10])
    pair.close()


def test_l3_hit_in_a_fresh_pair_loads_asynchronously(tmp_path):
    writer = Pair(tmp_path)
    writer.compute("r1", PROMPT, [0, 1, 2, 3])
    writer.wait_backups()
    assert writer.scheduler.stats.backed_up_tokens == HIT
    reader = Pair(tmp_path)
    reader.layers[0][:4] = writer.layers[0][:4]
    reader.layers[1][:4] = writer.layers[1][:4]
    assert reader.load_async("r2", PROMPT, [5, 6, 7, 8]) == "r2"
    assert reader.worker.take_load_errors() == set()
    assert reader.blocks_equal([0, 1, 2], [5, 6, 7])
    assert reader.scheduler.stats.loaded_l3_tokens == HIT
    reader.scheduler.request_finished("r2")
    assert reader.scheduler.state_summary()["tracked_requests"] == 0
    for pair in (writer, reader):
        pair.close()


def test_wants_save_is_true_exactly_when_a_step_completes_an_unsaved_block():
    """The connector skips copying a running request's tokens on steps where plan_save would do nothing."""
    pair = Pair()
    prompt = PROMPT + [7, 8]  # 16 tokens: 4 full blocks
    assert pair.match("r", prompt) == (0, False)
    pair.scheduler.after_alloc("r", prompt, [0, 1, 2, 3], 0)
    assert not pair.scheduler.wants_save("r", BLOCK - 1) and pair.scheduler.wants_save("r", BLOCK)
    pair.scheduler.plan_save("r", prompt, [0, 1, 2, 3], 2 * BLOCK)
    for computed in range(2 * BLOCK, 4 * BLOCK + 1):
        planned = len(pair.scheduler.plan.saves)
        wants = pair.scheduler.wants_save("r", computed)
        pair.scheduler.plan_save("r", prompt, [0, 1, 2, 3], computed)
        assert wants == (len(pair.scheduler.plan.saves) > planned), computed
    assert not pair.scheduler.wants_save("unknown", 4 * BLOCK)
    pair.step()
    pair.scheduler.request_finished("r")
    pair.close()


SALT_A, SALT_B = "salt='tenant-a'|lora=None", "salt='tenant-b'|lora=None"


def test_two_salts_never_share_a_page_and_each_hits_its_own(tmp_path):
    pair = Pair(tmp_path)
    pair.compute("a1", PROMPT, [0, 1, 2, 3], extra_key=SALT_A)
    pair.layers[0][4:8] += 1.0  # tenant b's KV for the same tokens differs (as a salted model's would)
    pair.compute("b1", PROMPT, [4, 5, 6, 7], extra_key=SALT_B)
    # equal tokens, two salts: two sets of L2 pages and of L3 keys, none shared
    assert pair.scheduler.allocator.num_used_slots == 2 * HIT
    assert pair.match("none", PROMPT) == (0, False)  # an unsalted request sees neither
    pair.scheduler.request_finished("none")
    for req_id, salt, source in (("a2", SALT_A, [0, 1, 2]), ("b2", SALT_B, [4, 5, 6])):
        assert pair.match(req_id, PROMPT, extra_key=salt) == (HIT, False)
        pair.scheduler.after_alloc(req_id, PROMPT, [20, 21, 22, 23], HIT, salt)
        pair.step()
        assert pair.blocks_equal(source, [20, 21, 22])  # its own tenant's bytes
        pair.scheduler.request_finished(req_id)
    pair.wait_backups()
    pages = sorted(key for pack in tmp_path.rglob("*.pack") for key, _, _ in pack_pages(str(pack)))
    assert len(pages) == len(set(pages)) == 2 * HIT // BLOCK
    # a fresh process: L3 serves each salt its own pages only
    reader = Pair(tmp_path)
    assert reader.match("c1", PROMPT, extra_key="salt='tenant-c'|lora=None") == (0, False)
    assert reader.match("a3", PROMPT, extra_key=SALT_A) == (HIT, True)
    reader.scheduler.request_finished("c1")
    reader.scheduler.request_finished("a3")
    for each in (pair, reader):
        each.scheduler.check_integrity()
        each.close()


def test_salt_keys_are_disjoint_chains(tmp_path):
    pair = Pair(tmp_path)  # with an L3, a lookup hashes every page of the prompt
    chains = {}
    for salt in (None, SALT_A, SALT_B, ""):
        assert pair.match(f"r{salt}", PROMPT, extra_key=salt) == (0, False)
        chains[salt] = pair.scheduler.requests[f"r{salt}"].hashes
    assert all(len(c) == HIT // BLOCK for c in chains.values())
    flat = [h for c in chains.values() for h in c]
    assert len(flat) == len(set(flat))
    pair.close()


def _corrupt(root: Path) -> int:
    """Flip a payload byte of every page in the file L3 under ``root``; the number of pages."""
    num_pages = 0
    for path in sorted(root.rglob("*.pack")):
        data = bytearray(path.read_bytes())
        for _, payload_at, _ in pack_pages(str(path)):
            data[payload_at + 10] ^= 0xFF
            num_pages += 1
        path.write_bytes(bytes(data))
    return num_pages


def test_corrupt_l3_pages_become_load_errors_and_are_not_planned_again(tmp_path):
    writer = Pair(tmp_path)
    writer.compute("r1", PROMPT, [0, 1, 2, 3])
    writer.wait_backups()
    assert _corrupt(tmp_path) == HIT // BLOCK
    reader = Pair(tmp_path)
    before = [layer[5:8].clone() for layer in reader.layers]
    assert reader.load_async("r2", PROMPT, [5, 6, 7, 8]) == "r2"
    assert reader.worker.take_load_errors() == {5, 6, 7}
    assert all(torch.equal(layer[5:8], old) for layer, old in zip(reader.layers, before))
    # vLLM asks again for the request it must now recompute: the failed L3 pages are not offered again
    assert reader.match("r2", PROMPT) == (0, False)
    reader.close()
    writer.close()


def test_a_hung_l3_read_ends_at_the_deadline_as_load_errors(tmp_path):
    framing = {"operations": ["get"], "hang_rate": 0.0}
    writer = Pair(tmp_path, faults=framing)
    writer.compute("r1", PROMPT, [0, 1, 2, 3])
    writer.wait_backups()
    reader = Pair(tmp_path, faults={**framing, "hang_rate": 1.0, "hang_s": 3.0}, read_timeout_s=0.3)
    # well before the hang ends: the connector's deadline is what fires
    assert reader.load_async("r2", PROMPT, [5, 6, 7, 8], timeout_s=2.5) == "r2"
    assert reader.worker.take_load_errors() == {5, 6, 7}
    assert reader.scheduler.stats.failed_load_tokens == HIT
    reader.scheduler.request_finished("r2")
    assert reader.scheduler.state_summary()["host_refs"] == 0
    reader.close()
    writer.close()


def test_full_l2_skips_saves_while_pages_are_protected_then_evicts():
    pair = Pair(pages=3)
    prompt_a, prompt_b = list(range(14)), list(range(50, 64))
    pair.match("a", prompt_a)
    pair.scheduler.after_alloc("a", prompt_a, [0, 1, 2, 3], 0)
    pair.scheduler.plan_save("a", prompt_a, [0, 1, 2, 3], len(prompt_a))
    pair.step()
    pair.match("b", prompt_b)
    pair.scheduler.after_alloc("b", prompt_b, [4, 5, 6, 7], 0)
    pair.scheduler.plan_save("b", prompt_b, [4, 5, 6, 7], len(prompt_b))  # a's pages are protected
    assert pair.scheduler.stats.save_skipped_tokens == HIT
    pair.scheduler.request_finished("a")
    pair.scheduler.request_finished("b")
    pair.compute("c", prompt_b, [8, 9, 10, 11])  # now a's pages may go
    assert pair.scheduler.stats.evicted_tokens == HIT
    assert pair.match("d", prompt_b) == (HIT, False)
    pair.scheduler.check_integrity()
    pair.close()


@pytest.mark.parametrize("policy", ["gdsf", "tinylfu"])
def test_frequency_aware_policies_see_each_use_of_an_l2_prefix(policy):
    """The connector's tree drives the policy's hooks as the cache does (uses, inserts, evictions): A,
    used three times, outlives B, newer but used once. Before, the connector never reported a use, so
    every node had none and both policies fell back to recency: A went."""
    pair = Pair(pages=6, policy=policy)  # room for two prompts of 3 pages
    prompt_a, prompt_b, prompt_c = list(range(14)), list(range(50, 64)), list(range(200, 214))
    pair.compute("a1", prompt_a, [0, 1, 2, 3])
    for req_id in ("a2", "a3"):
        assert pair.match(req_id, prompt_a) == (HIT, False)
        pair.scheduler.after_alloc(req_id, prompt_a, [4, 5, 6, 7], HIT)
        pair.step()
        pair.scheduler.request_finished(req_id)
    pair.compute("b1", prompt_b, [8, 9, 10, 11])
    pair.compute("c1", prompt_c, [12, 13, 14, 15])  # L2 full: A or B goes
    assert pair.scheduler.stats.evicted_tokens == HIT
    assert pair.match("a4", prompt_a) == (HIT, False)
    assert pair.match("b2", prompt_b) == (0, False)
    pair.scheduler.check_integrity()
    pair.close()


def test_the_connectors_default_policy_is_the_caches():
    from tierkv.cache.config import CacheConfig

    assert ConnectorConfig().eviction_policy == CacheConfig().eviction_policy == "adaptive"


@pytest.mark.parametrize("extra, field", [
    ({"write_policy": "write_back"}, "write_policy"),
    ({"hicache_size_gb": "8"}, "hicache_size_gb"),
    ({"no_such_key": 1}, "no_such_key"),
    ({"storage_backend": "file:///tmp/x", "timeout_s": 1.0}, "timeout_s"),
])
def test_bad_extra_config_names_the_key(extra, field):
    with pytest.raises(ValueError, match=field):
        ConnectorConfig.from_extra(extra)


def test_l2_size_from_gb_or_ratio():
    assert host_pages(ConnectorConfig(hicache_size_gb=1e-6), 100, 50) == 10
    assert host_pages(ConnectorConfig(hicache_ratio=2.0), 100, 50) == 100
    with pytest.raises(ValueError, match="hicache"):
        host_pages(ConnectorConfig(hicache_size_gb=1e-9), 100, 50)
