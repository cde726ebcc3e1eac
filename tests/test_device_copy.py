"""Accelerator <-> host staged copies (device gather/scatter + one DMA per host stretch), run here with
both pools on the CPU: the index and segment logic is the same on any device."""

import pytest
import torch

from tierkv.copy.device_copy import staged_copy
from tests.pool_helpers import random_pools
from tierkv.pools import HOST_LAYOUTS, KVSpec

SPECS = [KVSpec(num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float16),
         KVSpec(num_layers=3, attention="mla", kv_lora_rank=5, rope_dim=2, dtype=torch.bfloat16)]


def _bytes(pool):
    return pool.buffer.view(torch.uint8).clone()


@pytest.mark.parametrize("host_pattern", ["one_run", "two_runs"])
@pytest.mark.parametrize("to_host", [True, False], ids=["write", "load"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("spec", SPECS, ids=["mha", "mla"])
def test_staged_copy_moves_exactly_the_pages(spec, layout, page_size, to_host, host_pattern):
    device, host = random_pools(spec, layout, page_size, 32, 64, seed=page_size)
    device_pages = torch.tensor([9, 2, 30, 17, 3, 4, 21, 0])  # shuffled, as L1 hands them out
    host_pages = torch.arange(40, 48) if host_pattern == "one_run" else torch.cat(
        [torch.arange(5, 9), torch.arange(50, 54)])
    src, src_pages, dst, dst_pages = ((device, device_pages, host, host_pages) if to_host
                                      else (host, host_pages, device, device_pages))
    expected_pages = src.gather_pages(src_pages).contiguous()
    untouched = torch.ones(dst.num_pages, dtype=torch.bool)
    untouched[dst_pages] = False
    before = dst.gather_pages(untouched.nonzero().flatten()).contiguous()
    assert staged_copy(device, device_pages, host, host_pages, to_host=to_host)
    assert torch.equal(dst.gather_pages(dst_pages).view(torch.uint8), expected_pages.view(torch.uint8))
    after = dst.gather_pages(untouched.nonzero().flatten()).contiguous()
    assert torch.equal(after.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("to_host", [True, False], ids=["write", "load"])
def test_fragmented_host_pages_are_declined_untouched(to_host):
    device, host = random_pools(SPECS[0], "page_first", 1, 32, 64)
    before = (_bytes(device), _bytes(host))
    host_pages = torch.arange(0, 64, 2)  # 32 single-page stretches: more DMAs than worth it
    assert not staged_copy(device, torch.arange(32), host, host_pages, to_host=to_host)
    assert torch.equal(_bytes(device), before[0]) and torch.equal(_bytes(host), before[1])


def test_an_empty_batch_copies_nothing():
    device, host = random_pools(SPECS[1], "layer_first", 4, 32, 64)
    before = (_bytes(device), _bytes(host))
    empty = torch.zeros(0, dtype=torch.int64)
    assert staged_copy(device, empty, host, empty, to_host=True)
    assert torch.equal(_bytes(device), before[0]) and torch.equal(_bytes(host), before[1])
