"""A small inference engine on top of the hierarchical cache: paged attention in torch, continuous
batching, chunked prefill, greedy decode; llama (GQA), qwen3 (q/k norm) and deepseek_v2 (MLA) models."""
