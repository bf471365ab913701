"""`--checkpoint preset:NAME[:nvfp4|:nvfp4-all|:nvfp4-head][:seed=N][:skew=S]`: a make-checkpoint preset drawn straight into
memory, tensor by tensor, on the device that will hold it. For shapes too large to write to disk
(GLM-4.5-Air cut to 8 layers is 36 GB in BF16): each rank draws only the tensors it loads.

Values depend on (seed, tensor name) and on the device type that draws them (CPU and CUDA generators
differ), so runs compared with each other must draw on the same kind of device.
"""
from __future__ import annotations

import hashlib

import torch

from rocket_mpi.checkpoint import make, specs
from rocket_mpi.checkpoint.reader import CheckpointReader
from rocket_mpi.config import ModelConfig, QuantConfig
from rocket_mpi.errors import CheckpointError
from rocket_mpi.ops import nvfp4

PREFIX = "preset:"

_DTYPE_CODE = {torch.uint8: "U8", torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}


def is_synthetic(spec: str) -> bool:
    return spec.startswith(PREFIX)


class SyntheticReader(CheckpointReader):
    def __init__(self, spec: str, device: str = "cpu"):
        parts = spec[len(PREFIX):].split(":")
        self.preset, self.seed, self.quant_mode, self.skew = parts[0], 0, None, 0.0
        for p in parts[1:]:
            try:
                if p in ("nvfp4", "nvfp4-all", "nvfp4-head"):
                    self.quant_mode = p
                elif p.startswith("seed="):
                    self.seed = int(p[5:])
                elif p.startswith("skew="):
                    self.skew = float(p[5:])
                    if not 0 <= self.skew < float("inf"):
                        raise ValueError(p)
                else:
                    raise CheckpointError(f"--checkpoint {spec}: unknown option '{p}' (nvfp4, nvfp4-all, nvfp4-head, "
                                          f"seed=N, "
                                          f"skew=S)")
            except ValueError:
                raise CheckpointError(f"--checkpoint {spec}: bad option '{p}' (seed=N takes an integer, skew=S a "
                                      f"finite number >= 0)") from None
        raw = make.config_dict(self.preset)
        self.dir = spec
        self.device = torch.device(device)
        excl = make.exclude_patterns(raw, self.quant_mode in ("nvfp4-all", "nvfp4-head"),
                                     self.quant_mode == "nvfp4-head") if self.quant_mode else None
        quant = QuantConfig(exclude_modules=tuple(excl)) if excl is not None else None
        self.config = ModelConfig.from_dict(raw, source=spec, quant=quant)
        self.files, self._handles, self._cache, self._stored = [], {}, {}, {}
        fam = make._family_for_preset(self.preset)
        self.specs = {n: (shape, kind) for n, shape, kind in (fam or make).tensor_specs(raw)}
        self.where = {}
        for name, (shape, kind) in self.specs.items():
            mod = name[: -len(".weight")]
            if self._quantised(name, shape):
                for suffix in (".weight", ".weight_scale", ".weight_scale_2"):
                    self.where[mod + suffix] = spec
            else:
                self.where[name] = spec

    def _quantised(self, name: str, shape) -> bool:
        if self.config.quant is None or not name.endswith(".weight") or len(shape) != 2:
            return False
        if "embed_tokens" in name or name.endswith("mlp.gate.weight"):
            return False
        return not self.config.quant.excluded(name[: -len(".weight")])

    def _draw(self, name: str) -> torch.Tensor:
        shape, kind = self.specs[name]
        g = torch.Generator(device=self.device).manual_seed(specs._gen(self.seed, name).initial_seed())
        std = {"norm": 0.1, "attn_bias": 0.1, "embed": 1.0}.get(kind, 0.02)
        if kind == "bias":
            return specs.router_bias(self.seed, name, shape, self.skew, self.device)
        t = torch.randn(shape, generator=g, device=self.device) * std
        if kind == "norm":
            t = t + 1.0
        return t if kind == "router" else t.to(torch.bfloat16)

    def _fetch(self, name: str, path: str) -> torch.Tensor:
        if name in self.specs and not self._quantised(name, self.specs[name][0]):
            return self._draw(name)
        mod, _, part = name.rpartition(".weight")
        key = mod
        if key not in self._cache:
            w = self._draw(mod + ".weight").float()
            amax = None
            if mod.endswith(("gate_proj", "up_proj")):
                sib = mod.rsplit(".", 1)[0]
                amax = max(float(self._draw(f"{sib}.{p}.weight").float().abs().max()) for p in ("gate_proj", "up_proj"))
            self._cache = {key: nvfp4.quantize(w, amax)}  # keep one module: weight, scale, scale_2 come in a row
        q = self._cache[key]
        return {"": q[0], "_scale": q[1], "_scale_2": q[2]}[part]

    def _stored_dtype(self, name: str, path: str) -> str:
        if name in self.specs:
            shape, kind = self.specs[name]
            if self._quantised(name, shape):
                return "U8"
            return "F32" if kind in ("router", "bias") else "BF16"
        return _DTYPE_CODE[self._fetch(name, path).dtype]

    def fingerprint(self) -> str:
        return hashlib.sha256(f"{self.dir}|{self.device.type}".encode()).hexdigest()[:16]
