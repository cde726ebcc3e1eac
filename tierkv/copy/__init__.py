"""KV copies between the tiers' pools: the transfer controller (L1 <-> L2, asynchronous, per layer) and
the copies it runs (the native CPU chunk copy, the device-side gather and scatter)."""
