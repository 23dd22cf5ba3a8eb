"""Our sampler (`engine.name=transformers`, CPU and GPU): a batched KV-cached decode over the
host's model (batch.py, kvcache.py), the engine over it (engine.py), and its CUDA fast paths:
decode steps replayed as CUDA graphs over a KV pool (graphs.py), grouped-query decode attention
(attention.py), and decode over merged LoRA with fused projections (fused.py)."""
