"""A fast page-level simulator of the tiered cache, for policy sweeps the full replay is too slow for.

It runs the real :class:`tierkv.radix.RadixTree` and the real policy objects (:mod:`tierkv.eviction`),
keyed by page (one key element per ``page_size`` tokens: the first token id of the page, which names the
page and, in Mooncake-format traces, its whole prefix), with slot counts instead of KV pools. Per
request it does what :class:`tierkv.replay.replay.TraceReplayer` does: match, load the host part back
(when it is at least ``load_back_threshold`` tokens and L1 has room), evict for the new suffix with
the prefix locked, insert, count a use on every node of the path, then write to L2 per the tier mode.

Tier modes (``CacheConfig.tier_mode``):
- ``inclusive``: write-through; a node is copied to L2 once it has ``write_threshold`` uses, and an L1
  eviction of a backed-up node keeps it in L2;
- ``exclusive``: L2 holds what L1 dropped: a node is copied to L2 when L1 evicts it (if the policy
  admits it), and loading it back into L1 frees its L2 copy.

Eviction keeps one heap per tier across calls (:class:`tierkv.eviction.heap.EvictionHeap`, as the
cache does), so a call costs what it evicts, not the size of the frontier.
Checked against the full replay at one point in tests/test_sim.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierkv.replay.trace import TraceRequest
from tierkv.cache.config import CacheConfig
from tierkv.eviction import get_policy
from tierkv.eviction.heap import EvictionHeap
from tierkv.eviction.tiers import chunk_segments, drop_host_subtree, promote_loaded, tier_orders
from tierkv.radix import RadixKey, RadixTree, TreeNode

TIER_MODES = ("inclusive", "exclusive")


@dataclass(frozen=True)
class SimConfig:
    """Capacities in tokens (``l2_tokens`` None: L1-only), page size, policy and tier mode."""

    l1_tokens: int
    l2_tokens: int | None = None
    page_size: int = 16
    eviction_policy: str = "lru"
    tier_mode: str = "inclusive"
    write_threshold: int | None = 1  # uses before an L2 copy; None: write_back (copy on L1 eviction)
    admission: bool = False  # ask the policy before copying a node to L2
    load_back_threshold: int = 10
    # L2 eviction may drop the L2 copy of a node still in L1 (tierkv); False: only host-only leaves, as
    # HiCache's evict_host does (README, "Differences from SGLang HiCache")
    l2_evicts_l1_resident: bool = True
    # a copy on L1 eviction (write_back, exclusive) takes only the node, an ancestor being copied when L1
    # evicts it in turn, its L2-only subtree dropped if that copy fails (HiCache, and the cache); True:
    # the node's ancestors that L2 lacks are copied with it (the cache's rule before: L2 a rooted subtree)
    write_back_ancestors: bool = False
    split_victims: bool = True  # an eviction takes only the pages it needs of its last victim (as the cache)
    # a what-if for loads not in chunks (load_chunk_tokens=0): an exclusive load's L2 slots take the pages
    # L1 demotes to make room for it at once (a swap of the whole load)
    swap_loads: bool = False
    # exclusive tiers: a load back whose L1 demotions do not fit in L2's free room goes in chunks of
    # this many tokens, each chunk's L2 pages freed once it is in L1, so the next chunk's demotions take
    # them, the first chunk's taking one chunk of staging L2 keeps free (as CacheConfig.load_chunk_tokens
    # and staging_tokens); 0: one load, L2 evicting for the demotions
    load_chunk_tokens: int = 256
    # HiCache's rules the cache does not follow, to measure them (docs/differences.md):
    # a load back or an L2 write short of room evicts the whole length it needs, not the shortfall
    evict_whole_length: bool = False
    # a match or insert that splits a node refreshes its tail too, not only the matched head
    refresh_split_tail: bool = False
    # under write_back LFU and SLRU count uses (tierkv's rule before; HiCache's LFU stays LRU there)
    write_back_counts_uses: bool = False

    def __post_init__(self) -> None:
        if self.tier_mode not in TIER_MODES:
            raise ValueError(f"tier_mode {self.tier_mode!r} is not one of {list(TIER_MODES)}")
        get_policy(self.eviction_policy)


@dataclass
class SimResult:
    config: SimConfig
    prompt_tokens: int = 0
    hit_tokens: int = 0
    l2_hit_tokens: int = 0
    written_tokens: int = 0  # L1 -> L2 copies: the write traffic admission saves

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class PageSim:
    """One simulated cache; :meth:`serve` one request at a time, read :attr:`result` at the end."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.page = config.page_size
        self.tree = RadixTree(1)
        self.policy = get_policy(config.eviction_policy)
        self.policy.element_tokens = self.page
        self.tree.split_hook = self._on_split if config.refresh_split_tail else self.policy.on_split
        self._splits: list[tuple[TreeNode, TreeNode]] = []  # (head, tail) of the walk running
        self._demoted_now: set[int] = set()  # ids of the nodes one L1 eviction demoted, while L2 makes room
        self.l1_pages = config.l1_tokens // self.page
        self.l2_pages = (config.l2_tokens or 0) // self.page
        self.l2_used = 0
        self.l2_staging = 0  # pages L2 may hold beyond l2_pages while a chunk's demotions are made
        self.l1_in_flight = 0  # pages a chunked load has copied into L1 for a node not yet all there
        device_order, host_order = tier_orders(self.policy, config.tier_mode)
        self.l1_heap = EvictionHeap(self.tree, "device", device_order)
        self.l2_heap = EvictionHeap(self.tree, "host", host_order)
        self.result = SimResult(config)

    @property
    def l1_used(self) -> int:
        return self.tree.evictable_size + self.tree.protected_size + self.l1_in_flight

    def serve(self, req: TraceRequest) -> int:
        """Replay one request; returns its hit tokens."""
        pages = req.prompt_tokens()[: req.input_length // self.page * self.page: self.page]
        key = RadixKey(pages)
        path = self._walk(self.tree.match, key).nodes
        device = 0
        while device < len(path) and path[device].device_value is not None:
            device += 1
        hit = sum(len(n) for n in path[:device])
        last = path[device - 1] if device else self.tree.root
        host_part = path[device:]
        loaded = self._load_back(host_part) if host_part else []
        if loaded:
            hit += sum(len(n) for n in loaded)
            self.result.l2_hit_tokens += sum(len(n) for n in loaded) * self.page
            last = loaded[-1]
        self.tree.inc_lock_ref(last)
        # slots for every new token, a last partial page included (the engine computes it; the tree
        # keeps whole pages only, so it is freed after the insert)
        num_new = -(-req.input_length // self.page) - hit
        room = self._make_room_l1(num_new)
        self.tree.dec_lock_ref(last)
        if room:
            self._insert(key)
        self.result.prompt_tokens += req.input_length
        self.result.hit_tokens += hit * self.page
        return hit * self.page

    def _insert(self, key: RadixKey) -> None:
        result = self._walk(lambda k: self.tree.insert(k, range(len(k))), key)
        revived = {id(n) for n in result.revived}  # recomputed, not hit: no use counted (as the cache)
        write_through = self.config.write_threshold is not None
        counts_uses = write_through or self.policy.counts_uses_under_write_back or self.config.write_back_counts_uses
        for node in result.path:
            if id(node) not in revived:
                if counts_uses:
                    self.policy.on_access(node)
                if write_through:
                    node.hit_count += 1
        if result.new_node is not None:
            self.policy.on_insert(result.new_node)
        if self.l2_pages and self.config.tier_mode == "inclusive" and self.config.write_threshold is not None:
            hot = [n for n in result.path if n.host_value is None and n.hit_count >= self.config.write_threshold]
            if hot and (not self.config.admission or self.policy.admit(hot[-1])):
                self._copy_to_l2(hot[-1])

    def _on_split(self, head: TreeNode, tail: TreeNode) -> None:
        self.policy.on_split(head, tail)
        self._splits.append((head, tail))

    def _walk(self, walk, key: RadixKey):
        """``walk(key)`` (a match or insert); under ``refresh_split_tail`` the tail of a node it split
        takes the head's new access time, as HiCache's walk refreshes the node before splitting it."""
        if not self.config.refresh_split_tail:
            return walk(key)
        self._splits = []
        result = walk(key)
        tails = [tail for _, tail in self._splits]
        for head, tail in self._splits:
            tail.last_access_time = head.last_access_time
        self._splits = []
        for tier in ("device", "host"):  # their eviction heaps rank the tails again
            self.tree.mark_changed(tier, tails)
        return result

    def _load_back(self, host_part: list[TreeNode]) -> list[TreeNode]:
        """Load ``host_part`` into L1 (in chunks when the cache would); returns the nodes loaded, a prefix
        of the path (the last may be the head of a node split where a chunked load stopped)."""
        num = sum(len(n) for n in host_part)
        if num * self.page < self.config.load_back_threshold:
            return []
        self.tree.inc_lock_ref(host_part[-1])
        chunk_pages = max(1, self.config.load_chunk_tokens // self.page) if self.config.load_chunk_tokens else 0
        if self._loads_in_chunks(num, chunk_pages):
            loaded = self._load_in_chunks(host_part, chunk_pages)
        else:
            loaded = self._load_at_once(host_part, num)
        self.tree.dec_lock_ref(host_part[-1])
        return loaded

    def _loads_in_chunks(self, num_pages: int, chunk_pages: int) -> bool:
        """As ``HiRadixCache._loads_in_chunks``: exclusive tiers, a load whose L1 demotions would not fit
        in L2's free room."""
        if self.config.tier_mode != "exclusive" or chunk_pages <= 0:
            return False
        return self.l1_used + num_pages - self.l1_pages > self.l2_pages - self.l2_used

    def _load_at_once(self, host_part: list[TreeNode], num: int) -> list[TreeNode]:
        swap = self.config.tier_mode == "exclusive" and self.config.swap_loads
        if swap:  # the loaded pages' L2 slots take the pages L1 demotes to make room for them
            self.l2_used -= sum(len(n) for n in host_part if not n.host_ref)
        ok = self._make_room_l1(num, whole_length=self.config.evict_whole_length)
        if swap:
            self.l2_used += sum(len(n) for n in host_part if not n.host_ref)
        if not ok:
            return []
        for n in host_part:
            self.tree.set_device_value(n, range(len(n)))
        if self.config.tier_mode == "exclusive":  # promote: the L2 copy is no longer needed
            freed = promote_loaded(self.tree, host_part[-1], num)
            self.l2_used -= sum(len(v) for v in freed)
        return host_part

    def _load_in_chunks(self, host_part: list[TreeNode], chunk_pages: int) -> list[TreeNode]:
        """As :class:`tierkv.cache.chunked_load.ChunkedLoad`: each chunk's L2 pages are freed once it is in L1;
        a node takes its L1 pages when its last chunk lands; a load that stops inside a node splits it."""
        loaded: list[TreeNode] = []
        filled, free_host = 0, False  # of the node being filled
        for segments in chunk_segments(host_part, chunk_pages):
            num = sum(end - start for _, start, end in segments)
            self.l2_staging = num
            try:
                if not self._make_room_l1(num):
                    break
                self.l1_in_flight += num
                for node, start, end in segments:
                    if start == 0:
                        filled, free_host = 0, node.host_ref == 0
                    filled += end - start
                    if free_host:
                        self.l2_used -= end - start
                    if end == len(node):
                        loaded.append(self._hand_over(node, free_host))
                        filled = 0
            finally:
                self.l2_staging = 0
                self._evict_l2_for(0)
        if filled:  # stopped inside a node: its head is loaded
            node = next(n for n in host_part if n.device_value is None)
            loaded.append(self._hand_over(self.tree.split(node, filled), free_host))
        return loaded

    def _hand_over(self, node: TreeNode, free_host: bool) -> TreeNode:
        self.l1_in_flight -= len(node)
        self.tree.set_device_value(node, range(len(node)))
        if free_host:
            node.host_value = None  # its pages were freed as they were copied
        return node

    def _make_room_l1(self, num_pages: int, whole_length: bool = False) -> bool:
        """Evict from L1 until ``num_pages`` more fit: the shortfall (the cache's rule), or with
        ``whole_length`` ``num_pages`` more than now (HiCache's load back: ``evict(len(host_indices))``)."""
        if self.l1_used + num_pages <= self.l1_pages:
            return True
        target_used = (self.l1_used if whole_length else self.l1_pages) - num_pages
        demoted: list[TreeNode] = []  # protected in L2 until the room is made, as the cache's batch copy
        try:
            for victim in self.l1_heap.victims():
                need = self.l1_used - target_used
                if self.config.split_victims and len(victim) > need:
                    self.tree.split(victim, len(victim) - need)  # the head stays in L1, ranked as before
                if self._evict_l1(victim):
                    self.tree.inc_host_ref(victim)
                    demoted.append(victim)
                if self.l1_used <= target_used:
                    break
            return self.l1_used + num_pages <= self.l1_pages
        finally:
            for node in demoted:
                self.tree.dec_host_ref(node)
            if demoted and self.config.tier_mode == "exclusive":  # the demotions' room: see _copy_to_l2
                self._demoted_now = {id(n) for n in demoted}
                try:
                    self._evict_l2_for(0)
                finally:
                    self._demoted_now = set()

    def _evict_l1(self, node: TreeNode) -> bool:
        """Evict ``node`` from L1; True when it was copied to L2 on the way (write_back, exclusive)."""
        on_evict = self.config.tier_mode == "exclusive" or self.config.write_threshold is None
        copied = False
        if on_evict and node.host_value is None and self.l2_pages:
            if not self.config.admission or self.policy.admit(node):
                copied = self._copy_to_l2(node, ancestors=self.config.write_back_ancestors)
        self.tree.clear_device_value(node)
        removed = node.host_value is None
        if removed:  # its host-only descendants are unreachable now
            self.l2_used -= sum(len(v) for v in drop_host_subtree(self.tree, node, self.policy))
            self.tree.remove_leaf(node)
        self.policy.on_evict(node, removed)
        return copied

    def _copy_to_l2(self, node: TreeNode, ancestors: bool = True) -> bool:
        """Give ``node`` and (``ancestors``) its ancestors without one an L2 copy, evicting from L2 for room.

        Exclusive tiers: L2 evicts for all of one L1 eviction's demotions at once, after them, ranking the
        demoted nodes with its own (as the cache's Eviction._demote_exclusive): so L2 over its size until
        then. Evicting for each in turn, with the earlier ones protected, kept a demoted node that ranks
        below an L2 node the next demotion then evicted, where one tier of the total drops that node
        (adaptive's exclusive tiers were 0.23 points below one tier; GDSF and LRU never rank them so)."""
        path = []
        n = node
        while n is not self.tree.root and n.host_value is None and (ancestors or not path):
            path.append(n)
            n = n.parent
        num = sum(len(n) for n in path)
        if self.config.tier_mode == "exclusive":
            self._give_l2(path, num)
            return True
        self.tree.inc_host_ref(node)
        self._evict_l2_for(num, whole_length=self.config.evict_whole_length)
        self.tree.dec_host_ref(node)
        if self.l2_used + num > self.l2_pages + self.l2_staging:
            return False
        self._give_l2(path, num)
        return True

    def _give_l2(self, path: list[TreeNode], num: int) -> None:
        for n in path:
            n.host_value = range(len(n))
        self.l2_used += num
        self.result.written_tokens += num * self.page

    def _evict_l2_for(self, num: int, whole_length: bool = False) -> None:
        """Evict from L2 until ``num`` more pages fit (the staging pages of a chunk being loaded count):
        the shortfall, or with ``whole_length`` ``num`` pages (HiCache's ``evict_host(len(node.value))``)."""
        limit = self.l2_pages + self.l2_staging
        if self.l2_used + num <= limit:
            return
        target_used = (self.l2_used if whole_length else limit) - num
        for victim in self.l2_heap.victims():
            if victim.device_value is not None and not self.config.l2_evicts_l1_resident:
                continue  # HiCache's rule: only host-only leaves leave L2 (re-marked when L1 drops it)
            need = self.l2_used - target_used
            if self.config.split_victims and len(victim) > need:
                self.tree.split(victim, len(victim) - need)
            self._evict_l2(victim)
            if self.l2_used <= target_used:
                break

    def _drop_host(self, node: TreeNode) -> None:
        node.host_value = None
        self.l2_used -= len(node)

    def _evict_l2(self, node: TreeNode) -> None:
        if id(node) in self._demoted_now:  # dropped before its copy: never written (a split's head stays)
            self.result.written_tokens -= len(node) * self.page
        self._drop_host(node)
        removed = node.device_value is None
        if removed:
            self.tree.remove_leaf(node)
        self.policy.on_evict(node, removed)


def from_cache_config(cache: CacheConfig, l1_tokens: int, l2_tokens: int | None) -> SimConfig:
    """The simulated twin of a cache with this config and these capacities."""
    return SimConfig(l1_tokens=l1_tokens, l2_tokens=l2_tokens, page_size=cache.page_size,
                     eviction_policy=cache.eviction_policy, tier_mode=cache.tier_mode,
                     write_threshold=cache.write_threshold, admission=cache.l2_admission,
                     load_back_threshold=cache.load_back_threshold, split_victims=cache.split_victims,
                     load_chunk_tokens=cache.load_chunk_tokens)


def simulate(requests: list[TraceRequest], config: SimConfig) -> SimResult:
    """Run ``requests`` through a fresh :class:`PageSim`."""
    sim = PageSim(config)
    for req in requests:
        sim.serve(req)
    return sim.result
