"""Which ranks own which routed expert, per MoE layer. Computed in one place, used by loader and MoE.

An expert has one owner rank, or several (a replica on each): a replicated expert's rows are split among its
owners by routing alone (ops/rows.py split_rows), so every rank derives the same split and the canonical row
order and the zero-metadata exchange still hold. The file format (--placement, `place --out`):

    {"default": [0, 0, [0, 1], 1, ...], "5": [...]}

a JSON object from MoE layer index (or "default", for the layers not named) to a list with, for each expert,
its rank or the list of its ranks (each rank once; written sorted).
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

from rocket_mpi.config import ModelConfig
from rocket_mpi.errors import ConfigError
from rocket_mpi.ops.rows import Owners


def contiguous(n_experts: int, n_ranks: int) -> list[int]:
    """Rank of each expert for contiguous ranges, uneven counts allowed (37 on 3 ranks: 13, 12, 12)."""
    owner = []
    for r in range(n_ranks):
        owner += [r] * (n_experts // n_ranks + (r < n_experts % n_ranks))
    return owner


def owner_lists(layer_owners: list, n_ranks: int, where: str) -> tuple[tuple[int, ...], ...]:
    """One layer's list (a rank or a list of ranks per expert) -> the sorted owner tuple of each expert; a bad entry
    is one ConfigError naming `where`, the expert and what is wrong."""
    out = []
    for e, o in enumerate(layer_owners):
        ranks = list(o) if isinstance(o, (list, tuple)) else [o]
        if not ranks or o is None:
            raise ConfigError(f"{where} expert {e} is owned by no rank ({json.dumps(o)})")
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n_ranks:
                raise ConfigError(f"{where} expert {e} -> rank {json.dumps(r)}, not in 0..{n_ranks - 1}")
        if len(set(ranks)) != len(ranks):
            twice = next(r for r in ranks if ranks.count(r) > 1)
            raise ConfigError(f"{where} expert {e}: the replica list {json.dumps(o)} names rank {twice} twice")
        out.append(tuple(sorted(ranks)))
    return tuple(out)


class Placement:
    """owners[layer]: the sorted owner ranks of each expert (a tuple per expert); tables[layer]: the same as the row
    plans take it (ops/rows.py Owners)."""

    def __init__(self, owners: dict[int, list], n_ranks: int, source: str = "contiguous"):
        self.n_ranks = n_ranks
        self.source = source
        self.owners = {layer: owner_lists(list(o), n_ranks, f"placement {source}: layer {layer}")
                       for layer, o in owners.items()}
        self.tables = {layer: Owners.of(o) for layer, o in self.owners.items()}

    @classmethod
    def contiguous(cls, cfg: ModelConfig, n_ranks: int) -> "Placement":
        o = contiguous(cfg.n_routed_experts, n_ranks)
        return cls({layer: o for layer in cfg.moe_layers}, n_ranks)

    @classmethod
    def from_file(cls, path: str, cfg: ModelConfig, n_ranks: int) -> "Placement":
        """JSON object: MoE layer index (or "default") -> the rank, or list of ranks, of each expert."""
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
                raise ConfigError(f"--placement {path}: layer {layer} must list the rank (or ranks) of each of the "
                                  f"{cfg.n_routed_experts} experts")
            owners[layer] = owner_lists(o, n_ranks, f"--placement {path}: layer {layer}")
        return cls(owners, n_ranks, source=path)

    def owned(self, layer: int, rank: int) -> list[int]:
        """The experts of `layer` that `rank` holds (its replicas included), ascending."""
        return [e for e, o in enumerate(self.owners[layer]) if rank in o]

    def table(self, layer: int) -> Owners:
        return self.tables[layer]

    def replicas(self, layer: int) -> int:
        """Copies of the layer's experts beyond one each."""
        return self.tables[layer].n_pairs - len(self.owners[layer])

    def most_owned(self) -> int:
        """The most experts any rank holds in any layer."""
        return max((len(self.owned(la, r)) for la in self.owners for r in range(self.n_ranks)), default=0)

    def digest(self) -> str:
        h = hashlib.sha256()
        for layer in sorted(self.owners):
            h.update(f"{layer}:{json.dumps(self.owners[layer])};".encode())
        return h.hexdigest()[:16]

    def to_json(self) -> dict:
        return {str(k): [o[0] if len(o) == 1 else list(o) for o in v] for k, v in self.owners.items()}

    def first_owners(self, layers: list[int]) -> np.ndarray:
        """[layers, E] int: each expert's lowest owner rank (its only one without replicas)."""
        return np.array([[o[0] for o in self.owners[la]] for la in layers], dtype=np.int64).reshape(len(layers), -1)

    def __eq__(self, other) -> bool:
        return isinstance(other, Placement) and self.owners == other.owners and self.n_ranks == other.n_ranks
