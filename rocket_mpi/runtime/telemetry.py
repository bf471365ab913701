"""The routing trace a decode run records (decode --telemetry) and what reads it: `place` plans a placement from it,
and --expert-cache-from starts the expert cache from it. One .npz (fields in docs/DESIGN.md, Telemetry)."""
from __future__ import annotations

import hashlib
import json
import os
import zipfile

import numpy as np

from rocket_mpi.errors import RocketError

TELEMETRY_FORMAT = "rocket_mpi telemetry"
TELEMETRY_VERSION = 2


def config_digest(cfg) -> str:
    """A hash of the model's config: the handshake's, and the telemetry's model identity."""
    return hashlib.sha256(json.dumps(cfg.to_json(), sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_identity(cfg, checkpoint: str) -> dict:
    """What a telemetry file was recorded from: `place` refuses to plan another model from it."""
    return {"model_type": cfg.model_type, "config": config_digest(cfg), "n_experts": cfg.n_routed_experts,
            "top_k": cfg.num_experts_per_tok, "moe_layers": list(cfg.moe_layers), "checkpoint": checkpoint}


def step_telemetry(result) -> np.ndarray:
    """A rank's decode steps of one run as [steps, 5]: step seconds, seconds in its experts and in the exchange (NaN
    where not timed: the fixed-shape step), rows it computed, CPU seconds in its experts (CPU ranks)."""
    return np.array([(s.seconds, s.expert_seconds, s.wait_seconds, s.rows_owned, s.expert_cpu_seconds)
                     for s in result.steps[1:]], dtype=np.float64).reshape(-1, 5)


def write_telemetry(path: str, trace, cfg, per_rank: list[dict], placement, steps: list[np.ndarray], model: dict,
                    expert_bytes: int, path_taken: str, device: str, ranks: int | None = None) -> None:
    """--telemetry: the last run of the sweep as one .npz (fields in docs/DESIGN.md, Telemetry): its routing (rows per
    decode step, MoE layer and expert: the same on every rank, rank 0's), the placement it ran with, per rank and step
    the step, expert and exchange times and rows (steps: one array per rank, or none: a server records no times),
    each rank's expert-cache accounting, and the model's identity. ranks: the job's ranks (default len(steps))."""
    layers = list(cfg.moe_layers)
    n_moe, n_exp = len(layers), cfg.n_routed_experts
    trace = np.zeros((0, n_moe, n_exp), dtype=np.int32) if trace is None else trace
    n = min([trace.shape[0]] + [s.shape[0] for s in steps])   # a run that ended early: the steps both have
    per_step = np.stack([s[:n] for s in steps], axis=1) if steps else np.zeros((n, 0, 5))  # [steps, ranks, 5]
    raw = placement.to_json()
    placed = {str(la): raw.get(str(la), raw.get("default")) for la in layers}   # every MoE layer spelt out
    owners = np.array([[o if isinstance(o, int) else min(o) for o in placed[str(la)]] for la in layers],
                      dtype=np.int64).reshape(n_moe, n_exp)
    np.savez_compressed(path, format=np.array(TELEMETRY_FORMAT), version=np.array(TELEMETRY_VERSION),
                        rows=trace[:n], layers=np.array(layers, dtype=np.int64), owners=owners,
                        placement=np.array(json.dumps(placed)), ranks=np.array(len(steps) if ranks is None else ranks),
                        step_s=per_step[:, :, 0], expert_s=per_step[:, :, 1], wait_s=per_step[:, :, 2],
                        rows_owned=per_step[:, :, 3].astype(np.int64), expert_cpu_s=per_step[:, :, 4],
                        expert_bytes=np.array(expert_bytes),
                        streams=np.array(per_rank[0]["M"] if per_rank else 0), path=np.array(path_taken),
                        device=np.array(device), model=np.array(json.dumps(model)),
                        per_rank=np.array(json.dumps(per_rank)))


FIELDS = ("rows", "layers", "placement", "model", "expert_bytes", "expert_s", "rows_owned", "streams")


def read_telemetry(path: str, flag: str = "--telemetry") -> dict:
    """The .npz's fields, or one line (naming `flag` and the file) saying why it is not a telemetry file this version
    reads."""
    if not os.path.isfile(path):
        raise RocketError(f"{flag} {path}: file not found")
    try:
        with np.load(path, allow_pickle=False) as z:
            fields = {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise RocketError(f"{flag} {path}: not a telemetry file (decode --telemetry writes one): {e}") from None
    if str(fields.get("format", "")) != TELEMETRY_FORMAT:
        raise RocketError(f"{flag} {path}: not a telemetry file (decode --telemetry writes one; fields "
                          f"{', '.join(sorted(fields)) or 'none'})")
    if int(fields.get("version", 0)) != TELEMETRY_VERSION or any(k not in fields for k in FIELDS):
        raise RocketError(f"{flag} {path}: telemetry version {int(fields.get('version', 0))}, this rocket_mpi "
                          f"reads version {TELEMETRY_VERSION}: record it again with decode --telemetry")
    t = dict(fields)
    t["model"] = json.loads(str(fields["model"]))
    t["placement"] = json.loads(str(fields["placement"]))
    rows = t["rows"]
    n_exp, layers = t["model"]["n_experts"], list(t["model"]["moe_layers"])
    if rows.ndim != 3 or rows.shape[1:] != (len(layers), n_exp) or list(t["layers"]) != layers:
        raise RocketError(f"{flag} {path}: rows {tuple(rows.shape)} do not match its model's {len(layers)} MoE "
                          f"layers x {n_exp} experts")
    if not rows.shape[0]:
        raise RocketError(f"{flag} {path}: no decode steps recorded (decode at least 2 tokens)")
    return t


def describe(m: dict) -> str:
    lay = m["moe_layers"]
    span = f"{lay[0]}..{lay[-1]}" if lay else "none"
    return f"{m['model_type']} config {m['config']} ({m['n_experts']} experts, MoE layers {span})"


def require_model(t: dict, path: str, cfg, against: str, flag: str = "--telemetry") -> None:
    """One line when the trace was recorded from another model than `cfg` (`against` names it: --checkpoint DIR)."""
    here = {"model_type": cfg.model_type, "config": config_digest(cfg), "n_experts": cfg.n_routed_experts,
            "moe_layers": list(cfg.moe_layers)}
    if any(here[k] != t["model"][k] for k in here):
        raise RocketError(f"{flag} {path} was recorded from another model: {describe(t['model'])}; "
                          f"{against} is {describe(here)}")


def firing_shares(rows: np.ndarray, layers: list[int]) -> dict[int, np.ndarray]:
    """A trace's rows [steps, MoE layers, E] -> per MoE layer, the share of the steps in which each expert had rows."""
    rows = np.asarray(rows)
    return {la: (rows[:, i] > 0).mean(axis=0) if rows.shape[0] else np.zeros(rows.shape[2])
            for i, la in enumerate(layers)}


def cache_start(path: str, cfg, against: str) -> dict[int, np.ndarray]:
    """--expert-cache-from: the trace's firing shares per MoE layer (firing_shares), once the file is a telemetry
    file of this model."""
    t = read_telemetry(path, "--expert-cache-from")
    require_model(t, path, cfg, against, "--expert-cache-from")
    return firing_shares(t["rows"], list(cfg.moe_layers))


def shares_digest(shares: dict[int, np.ndarray] | None) -> str | None:
    """What the ranks compare in their handshake: every rank must start its cache from the same trace."""
    if shares is None:
        return None
    h = hashlib.sha256()
    for la in sorted(shares):
        h.update(np.ascontiguousarray(shares[la], dtype=np.float64).tobytes())
    return h.hexdigest()[:16]
