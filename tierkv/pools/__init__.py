"""KV pools of the device (L1) and host (L2) tiers."""

from tierkv.pools.allocator import SlotAllocator
from tierkv.pools.kv import HOST_LAYOUTS, DeviceKVPool, HostKVPool, host_pool_tokens
from tierkv.pools.spec import KVSpec, parse_dtype

__all__ = ["HOST_LAYOUTS", "DeviceKVPool", "HostKVPool", "KVSpec", "SlotAllocator", "host_pool_tokens",
           "parse_dtype"]
