"""Trace replay through the real cache, the offline-optimal (Belady MIN) bound, a TTFT model, reports."""
