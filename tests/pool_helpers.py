"""Pools filled with random bytes, for the copy tests."""

import torch

from tierkv.pools import DeviceKVPool, HostKVPool


def random_pools(spec, layout: str, page_size: int, device_pages: int = 16, host_pages: int = 32, seed: int = 0):
    """A CPU L1 and L2 pool of ``spec`` whose every byte is random (NaN patterns included: compare bytes)."""
    device = DeviceKVPool(spec, device_pages * page_size, page_size, "cpu")
    host = HostKVPool(spec, host_pages * page_size, page_size, layout, pin_memory=False)
    g = torch.Generator().manual_seed(seed)
    for pool in (device, host):
        raw = pool.buffer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    return device, host
