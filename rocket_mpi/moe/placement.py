"""Which rank owns which routed expert, per MoE layer. Computed in one place, used by loader and MoE."""
from __future__ import annotations

import hashlib
import json

import torch

from rocket_mpi.config import ModelConfig
from rocket_mpi.errors import ConfigError


def contiguous(n_experts: int, n_ranks: int) -> list[int]:
    """Rank of each expert for contiguous ranges, uneven counts allowed (37 on 3 ranks: 13, 12, 12)."""
    owner = []
    for r in range(n_ranks):
        owner += [r] * (n_experts // n_ranks + (r < n_experts % n_ranks))
    return owner


class Placement:
    def __init__(self, owners: dict[int, list[int]], n_ranks: int, source: str = "contiguous"):
        self.owners = {layer: torch.tensor(o, dtype=torch.long) for layer, o in owners.items()}
        self.n_ranks = n_ranks
        self.source = source

    @classmethod
    def contiguous(cls, cfg: ModelConfig, n_ranks: int) -> "Placement":
        o = contiguous(cfg.n_routed_experts, n_ranks)
        return cls({layer: o for layer in cfg.moe_layers}, n_ranks)

    @classmethod
    def from_file(cls, path: str, cfg: ModelConfig, n_ranks: int) -> "Placement":
        """JSON object: MoE layer index (or "default") -> list of the owning rank of each expert."""
        try:
            with open(path) as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"--placement {path}: file not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"--placement {path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"--placement {path}: expected an object of layer -> [rank per expert]")
        owners = {}
        for key in raw:
            if key != "default" and (not key.isdigit() or int(key) not in cfg.moe_layers):
                raise ConfigError(f"--placement {path}: '{key}' is not a MoE layer (MoE layers are "
                                  f"{cfg.moe_layers[0]}..{cfg.moe_layers[-1]})")
        for layer in cfg.moe_layers:
            o = raw.get(str(layer), raw.get("default"))
            if o is None:
                raise ConfigError(f"--placement {path}: no entry for MoE layer {layer} and no \"default\"")
            if not isinstance(o, list) or len(o) != cfg.n_routed_experts:
                raise ConfigError(f"--placement {path}: layer {layer} must list the rank of each of the "
                                  f"{cfg.n_routed_experts} experts")
            for e, r in enumerate(o):
                if not isinstance(r, int) or not 0 <= r < n_ranks:
                    raise ConfigError(f"--placement {path}: layer {layer} expert {e} -> rank {r!r}, "
                                      f"not in 0..{n_ranks - 1}")
            owners[layer] = o
        return cls(owners, n_ranks, source=path)

    def owned(self, layer: int, rank: int) -> list[int]:
        return (self.owners[layer] == rank).nonzero().flatten().tolist()

    def digest(self) -> str:
        h = hashlib.sha256()
        for layer in sorted(self.owners):
            h.update(f"{layer}:".encode() + bytes(self.owners[layer].to(torch.uint8).tolist()))
        return h.hexdigest()[:16]

    def to_json(self) -> dict:
        return {str(k): v.tolist() for k, v in self.owners.items()}
