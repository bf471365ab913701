"""KV cache for M streams of different lengths: one [M, kv_heads, capacity, head_dim] buffer per layer."""
from __future__ import annotations

import copy

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


def _map_streams(cache, fn):
    """A copy of any model's cache (KVCache, the latent caches, GLM-5.3-Flash's) with fn(t) in place of every tensor
    whose first dimension is its streams: lists, tuples, dicts and objects rebuilt, other values kept. Every tensor
    a cache holds per stream has the stream first, so this reaches all of them and nothing else."""
    m, memo = cache.streams, {}

    def visit(obj):
        if isinstance(obj, torch.Tensor):
            return fn(obj) if obj.dim() and obj.shape[0] == m else obj
        if isinstance(obj, (list, tuple)):
            return type(obj)(visit(o) for o in obj)
        if isinstance(obj, dict):
            return {k: visit(o) for k, o in obj.items()}
        if hasattr(obj, "__dict__") and not isinstance(obj, type):
            if id(obj) not in memo:
                new = memo[id(obj)] = copy.copy(obj)
                for k, o in vars(obj).items():
                    setattr(new, k, visit(o))
            return memo[id(obj)]
        return obj

    return visit(cache)


def clear_stream(cache, s: int) -> None:
    """Empty stream slot `s` of any model's cache (KV rows, latents, indexer keys, recurrent states, its length):
    every tensor the cache holds whose first dimension is its streams has row `s` zeroed, so a slot reused for a
    new stream starts exactly as a fresh cache does."""
    _map_streams(cache, lambda t: t[s].zero_())


def first_streams(cache, n: int):
    """The cache of slots 0..n-1 of `cache`, as views: the same memory (lengths included), so a forward over the
    view writes the slots' own rows and positions; a cache of n streams to the model."""
    if n == cache.streams:
        return cache
    return _map_streams(cache, lambda t: t[:n])
