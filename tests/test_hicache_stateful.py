"""Random operation sequences against the two-tier cache, with the invariants checked after every step.

Every token's KV is a known function of its whole prefix (as in a real model), written into L1 when a
request inserts it, so any KV the cache hands back, from any tier, can be checked.
"""

import threading

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from tierkv.cache.config import CacheConfig
from tierkv.cache.hicache import HiRadixCache
from tierkv.pools import HOST_LAYOUTS, DeviceKVPool, KVSpec
from tierkv.radix import RadixKey

SPEC = KVSpec(num_layers=2, kv_heads=1, head_dim=2, dtype=torch.float32)
DEVICE_TOKENS = 32

tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=14)
extra_st = st.sampled_from([None, None, "ns"])


def expected_kv(tokens: list[int], extra_key) -> torch.Tensor:
    """[2, layers, n, 1, 2] float32, exact: token i's values name its whole prefix, layer and K/V."""
    h, values = 7 if extra_key is None else 11, []
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % (1 << 18)
        values.append(h)
    base = torch.tensor(values, dtype=torch.float32) * 8
    kv = torch.empty(2, SPEC.num_layers, len(tokens), 1, 2)
    for k in range(2):
        for layer in range(SPEC.num_layers):
            kv[k, layer, :, 0, 0] = base + k * 4 + layer
            kv[k, layer, :, 0, 1] = -(base + k * 4 + layer)
    return kv


class CacheMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 4]),
                policy=st.sampled_from(["lru", "lfu", "fifo", "mru", "priority", "gdsf", "s3fifo"]),
                write_policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
                layout=st.sampled_from(HOST_LAYOUTS), io_backend=st.sampled_from(["kernel", "direct"]),
                ratio=st.sampled_from([1.25, 1.5, 2.0]), tier_mode=st.sampled_from(["inclusive", "exclusive"]),
                split_victims=st.booleans(), load_chunk_tokens=st.sampled_from([0, 1, 4, 4096]))
    def setup(self, page_size, policy, write_policy, layout, io_backend, ratio, tier_mode, split_victims,
              load_chunk_tokens):
        pool = DeviceKVPool(SPEC, DEVICE_TOKENS, page_size, "cpu")
        config = CacheConfig(page_size=page_size, eviction_policy=policy, write_policy=write_policy,
                             host_layout=layout, io_backend=io_backend, hicache_ratio=ratio,
                             load_back_threshold=2, tier_mode=tier_mode, split_victims=split_victims,
                             load_chunk_tokens=load_chunk_tokens)
        self.cache = HiRadixCache(pool, config)
        # Copies start only when a rule lets them (see _complete_copies): runs replay deterministically
        # and writes stay in flight across other operations.
        self.gate = threading.Semaphore(0)
        self.cache.transfer.delay_hook = lambda kind: self.gate.acquire()
        self.page_size = page_size
        self.locks: list[tuple] = []  # (node, device indices, tokens, extra_key) of held locks
        self.held: list[torch.Tensor] = []  # device slots the test holds as a caller
        self.known: list[tuple[list[int], str | None]] = []  # keys inserted so far

    def teardown(self):
        if hasattr(self, "cache"):
            self._complete_copies()
            self.cache.close()

    def _complete_copies(self) -> None:
        """Let every queued copy run and wait for it (none is mid-copy between rules)."""
        transfer = self.cache.transfer
        queued = [handle for handle, _ in (*transfer.writes, *transfer.loads) if not handle.done()]
        for _ in queued:
            self.gate.release()
        transfer.synchronize()

    # ---- helpers ------------------------------------------------------------------------------------
    def _key(self, data) -> tuple[list[int], str | None]:
        """A fresh key, or (mostly) one inserted before, cut or extended: lookups should often hit."""
        if self.known and data.draw(st.integers(0, 3)):
            tokens, extra_key = data.draw(st.sampled_from(self.known))
            cut = data.draw(st.integers(1, len(tokens)))
            return tokens[:cut] + data.draw(st.lists(st.integers(0, 2), max_size=4)), extra_key
        return data.draw(tokens_st), data.draw(extra_st)

    def _host_only_key(self, data) -> tuple[list[int], str | None]:
        """Mostly the key of a node now only in L2 (if any), so that loads back happen often."""
        tree = self.cache.tree
        host_only = sorted((n for n in tree.nodes() if n.device_value is None), key=lambda n: n.id)
        if not host_only or not data.draw(st.integers(0, 3)):
            return self._key(data)
        node = data.draw(st.sampled_from(host_only))
        tokens = [t for n in tree.path_to_root(node) for t in n.key]
        return tokens + data.draw(st.lists(st.integers(0, 2), max_size=4)), node.extra_key

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _padded(self, n: int) -> int:
        return n + (-n) % self.page_size

    def _check_device_kv(self, indices: torch.Tensor, tokens: list[int], extra_key) -> None:
        got = self.cache.device_pool.read_tokens(indices)
        assert torch.equal(got, expected_kv(tokens[: len(indices)], extra_key)), "wrong KV in L1"

    def _write(self, slots: torch.Tensor, tokens: list[int], start: int, extra_key) -> None:
        """Write the KV of tokens[start:start+len(slots)] (pattern past the key's end is arbitrary)."""
        full = expected_kv(tokens + [0] * self.page_size, extra_key)
        self.cache.device_pool.write_tokens(slots, full[:, :, start:start + len(slots)])

    # ---- rules --------------------------------------------------------------------------------------
    @rule(data=st.data(), priority=st.integers(0, 2))
    def insert_fresh(self, data, priority):
        """A request that recomputed everything: its duplicate slots go back to the pool."""
        tokens, extra_key = self._key(data)
        slots = self.cache.alloc_device(self._padded(len(tokens)))
        event(f"insert: {'no room' if slots is None else 'stored'}")
        if slots is None:
            return
        self.known.append((tokens, extra_key))
        self._write(slots, tokens, 0, extra_key)
        owned = self.cache.insert(RadixKey(tokens, extra_key), slots, priority)
        assert owned == self._aligned(len(tokens))
        if owned < len(slots):
            self.cache.device_pool.free(slots[owned:])

    @rule(data=st.data())
    def insert_extending_a_match(self, data):
        """The engine's flow: lock the cached prefix, compute only the rest, insert, unlock."""
        tokens, extra_key = self._key(data)
        key = RadixKey(tokens, extra_key)
        match = self.cache.match_prefix(key)
        self.cache.inc_lock_ref(match.last_device_node)
        prefix = len(match.device_indices)
        new = self.cache.alloc_device(self._padded(len(tokens) - prefix))
        if new is not None:
            self.known.append((tokens, extra_key))
            self._write(new, tokens, prefix, extra_key)
            slots = torch.cat([match.device_indices, new])
            owned = self.cache.insert(key, slots)
            if owned < len(slots):
                self.cache.device_pool.free(slots[owned:])
        self.cache.dec_lock_ref(match.last_device_node)

    @rule(data=st.data())
    def match(self, data):
        tokens, extra_key = self._key(data)
        match = self.cache.match_prefix(RadixKey(tokens, extra_key))
        event(f"match: device {'hit' if len(match.device_indices) else 'miss'}, "
              f"host {'hit' if match.host_hit_length else 'miss'}")
        self._check_device_kv(match.device_indices, tokens, extra_key)
        assert len(match.device_indices) + match.host_hit_length <= self._aligned(len(tokens))

    @precondition(lambda self: len(self.locks) < 4)
    @rule(data=st.data())
    def lock(self, data):
        tokens, extra_key = self._key(data)
        match = self.cache.match_prefix(RadixKey(tokens, extra_key))
        if len(match.device_indices):
            self.cache.inc_lock_ref(match.last_device_node)
            self.locks.append((match.last_device_node, match.device_indices.clone(), tokens, extra_key))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        node, *_ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.dec_lock_ref(node)

    @rule(num_tokens=st.integers(0, DEVICE_TOKENS + 8))
    def evict(self, num_tokens):
        before_evictable = self.cache.evictable_size
        before_free = self.cache.device_pool.num_free_slots
        max_node = max((len(n) for n in self.cache.tree.nodes() if n.device_value is not None), default=0)
        freed = self.cache.evict(num_tokens)
        event(f"evict: {'freed' if freed else 'nothing'}")
        assert min(num_tokens, before_evictable) <= freed <= before_evictable
        assert freed == 0 or freed < num_tokens + max_node  # whole nodes, no more than needed
        assert self.cache.evictable_size == before_evictable - freed
        assert self.cache.device_pool.num_free_slots == before_free + freed

    @rule(num_tokens=st.integers(0, 2 * DEVICE_TOKENS + 8))
    def evict_host(self, num_tokens):
        before_free = self.cache.host_pool.num_free_slots
        freed = self.cache.evict_host(num_tokens)
        event(f"evict_host: {'freed' if freed else 'nothing'}")
        assert self.cache.host_pool.num_free_slots == before_free + freed

    @rule(data=st.data(), quota=st.sampled_from([None, None, 8]), ack_now=st.booleans())
    def load_back(self, data, quota, ack_now):
        tokens, extra_key = self._host_only_key(data)
        match = self.cache.match_prefix(RadixKey(tokens, extra_key))
        result = self.cache.init_load_back(match.last_host_node, mem_quota=quota)
        event(f"load back: {'loaded' if result.pending else 'skipped'}")
        if result.pending is not None:
            self._complete_copies()
            assert result.pending.wait()
            assert result.last_node.lock_ref >= 1  # held until the ack is retired
        self._check_device_kv(result.device_indices, tokens, extra_key)
        if ack_now:
            self.cache.step()

    @rule(complete_first=st.booleans())
    def step(self, complete_first):
        if complete_first:
            self._complete_copies()
        self.cache.step()

    @rule()
    def complete_copies(self):
        self._complete_copies()

    @rule()
    def flush(self):
        self._complete_copies()
        self.cache.flush()
        assert not self.cache.transfer.writes and not self.cache.transfer.loads

    @precondition(lambda self: len(self.held) < 2)
    @rule(num_pages=st.integers(1, 3))
    def hold_slots(self, num_pages):
        slots = self.cache.alloc_device(num_pages * self.page_size)
        if slots is not None:
            self.held.append(slots)

    @precondition(lambda self: self.held)
    @rule()
    def release_slots(self):
        self.cache.device_pool.free(self.held.pop())

    # ---- invariants ---------------------------------------------------------------------------------
    @invariant()
    def integrity(self):
        if not hasattr(self, "cache"):
            return
        held = torch.cat(self.held) if self.held else None
        self.cache.check_integrity(caller_device_slots=held)

    @invariant()
    def every_path_is_loadable(self):
        """L2 need not be a rooted subtree, but no node is unreachable: each ancestor of an L2 copy
        holds its KV in L1 or L2 (write_back copies only the evicted node)."""
        if not hasattr(self, "cache"):
            return
        for node in self.cache.tree.nodes():
            if node.host_value is not None:
                for n in self.cache.tree.path_to_root(node)[:-1]:
                    assert n.device_value is not None or n.host_value is not None, "unreachable L2 copy"
                    if n.host_value is None:
                        event("L2 copy under an L1-only ancestor")

    @invariant()
    def locked_prefixes_stay_in_l1(self):
        for node, indices, tokens, extra_key in getattr(self, "locks", []):
            path = self.cache.tree.path_to_root(node)
            assert all(n.device_value is not None for n in path), "a locked node was evicted"
            assert torch.equal(torch.cat([n.device_value for n in path]), indices)
            self._check_device_kv(indices, tokens, extra_key)

    @invariant()
    def every_tier_holds_the_right_kv(self):
        if not hasattr(self, "cache"):
            return
        cache = self.cache
        for node in cache.tree.nodes():
            path = cache.tree.path_to_root(node)
            tokens = [t for n in path for t in n.key]
            kv = expected_kv(tokens, node.extra_key)[:, :, len(tokens) - len(node.key):]
            if node.device_value is not None:
                assert torch.equal(cache.device_pool.read_tokens(node.device_value), kv), "L1 KV"
            if node.host_value is not None and node.host_ref == 0:  # no copy into it in flight
                assert torch.equal(cache.host_pool.read_tokens(node.host_value), kv), "L2 KV"


def test_cache_state_machine(tree_impl):
    """Once over the compiled key comparison, once over the pure-Python tree."""
    run_state_machine_as_test(CacheMachine, settings=settings(
        max_examples=60, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]))
