"""KV cache for M streams of different lengths: one [M, kv_heads, capacity, head_dim] buffer per layer."""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers: int, streams: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (streams, kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.lengths = torch.zeros(streams, dtype=torch.long)  # tokens held per stream
        self.capacity = capacity

    @property
    def streams(self) -> int:
        return self.lengths.numel()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def clear_stream(cache, s: int) -> None:
    """Empty stream slot `s` of any model's cache (KV rows, latents, indexer keys, recurrent states, its length):
    every tensor the cache holds whose first dimension is its streams has row `s` zeroed, so a slot reused for a
    new stream starts exactly as a fresh cache does."""
    m, seen = cache.streams, set()

    def visit(obj):
        if isinstance(obj, torch.Tensor):
            if obj.dim() and obj.shape[0] == m:
                obj[s].zero_()
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                visit(o)
        elif isinstance(obj, dict):
            for o in obj.values():
                visit(o)
        elif hasattr(obj, "__dict__") and id(obj) not in seen:
            seen.add(id(obj))
            for o in vars(obj).values():
                visit(o)

    visit(cache)
