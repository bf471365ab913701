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
