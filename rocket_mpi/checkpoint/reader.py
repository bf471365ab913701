"""Lazy safetensors reading, single file or sharded, with one-line errors naming file and tensor.

NVFP4 parts are handed out under ModelOpt's names (`weight`, `weight_scale`, `weight_scale_2`) whichever layout the
checkpoint has: a compressed-tensors checkpoint's `weight_packed` is read as `weight` (the same bytes) and its
`weight_global_scale` as `weight_scale_2` (its reciprocal, in fp32), so nothing past this reader tells them apart.
Errors name the tensor as the file stores it."""
from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass

import torch
from safetensors import safe_open

from rocket_mpi.ops import fp8, nvfp4
from rocket_mpi.config import COMPRESSED_TENSORS, ModelConfig
from rocket_mpi.errors import CheckpointError

INDEX = "model.safetensors.index.json"

# compressed-tensors' names of NVFP4 parts -> ModelOpt's, the names this reader hands them out under
CT_NAMES = ((".weight_packed", ".weight"), (".weight_global_scale", ".weight_scale_2"))


@dataclass
class Linear:
    """One Linear's weights as stored: BF16 `weight`, or NVFP4 parts (weight/scale/scale_2)."""

    name: str
    weight: torch.Tensor                      # [N, K] bf16, or [N, K/2] uint8 when NVFP4
    weight_scale: torch.Tensor | None = None  # [N, K/16] float8_e4m3fn
    weight_scale_2: torch.Tensor | None = None  # [] fp32
    bias: torch.Tensor | None = None

    @property
    def nvfp4(self) -> bool:
        return self.weight_scale is not None

    def dense(self, dtype=torch.bfloat16, with_global_scale: bool = True) -> torch.Tensor:
        if not self.nvfp4:
            return self.weight.to(dtype)
        s2 = self.weight_scale_2 if with_global_scale else 1.0
        return nvfp4.dequantize(self.weight, self.weight_scale, s2, dtype=dtype)

    @property
    def scale_2(self) -> float:
        return float(self.weight_scale_2) if self.nvfp4 else 1.0


class CheckpointReader:
    """Maps tensor names to files and opens each tensor only when asked for."""

    log = None  # a ContentLog (fingerprint.py) while a rank loads: the digest of every tensor get() hands out

    def __init__(self, ckpt_dir: str, config: ModelConfig | None = None):
        self.dir = ckpt_dir
        self.config = config or ModelConfig.from_checkpoint(ckpt_dir)
        self.files = self._find_files()
        self._handles: dict[str, object] = {}
        self.where: dict[str, str] = {}
        idx = os.path.join(ckpt_dir, INDEX)
        if os.path.exists(idx):
            wm = _weight_map(idx)
            for name, fname in wm.items():
                path = os.path.join(ckpt_dir, fname)
                if not os.path.exists(path):
                    raise CheckpointError(f"{idx}: tensor '{name}' points to missing file {path}")
                self.where[name] = path
        else:
            for path in self.files:
                for name in self._open(path).keys():
                    self.where[name] = path
        self._stored: dict[str, str] = {}  # name handed out -> name in the file, where the two differ
        if self._ct_nvfp4:
            self._compressed_tensors_names()

    @property
    def _ct_nvfp4(self) -> bool:
        q = self.config.quant
        return q is not None and q.layout == COMPRESSED_TENSORS and q.nvfp4

    def _compressed_tensors_names(self) -> None:
        for stored in list(self.where):
            if stored.endswith(".weight_zero_point"):
                raise CheckpointError(f"{self.where[stored]}: tensor '{stored}': zero points (asymmetric weights) "
                                      f"are not NVFP4")
            for ct, mo in CT_NAMES:
                if stored.endswith(ct):
                    name = stored[:-len(ct)] + mo
                    if name in self.where:
                        raise CheckpointError(f"{self.where[stored]}: both '{stored}' and '{name}' are stored (a "
                                              f"compressed-tensors checkpoint holds only the first)")
                    self.where[name] = self.where.pop(stored)
                    self._stored[name] = stored

    def stored_name(self, name: str) -> str:
        """The name under which the checkpoint stores what this reader calls `name`."""
        if name in self._stored or name in self.where:
            return self._stored.get(name, name)
        if self._ct_nvfp4:  # a missing part
            for ct, mo in CT_NAMES:
                if name.endswith(mo):
                    return name[:-len(mo)] + ct
        return name

    def _find_files(self) -> list[str]:
        if not os.path.isdir(self.dir):
            raise CheckpointError(f"{self.dir}: checkpoint folder not found")
        idx = os.path.join(self.dir, INDEX)
        if os.path.exists(idx):
            return [os.path.join(self.dir, n) for n in sorted(set(_weight_map(idx).values()))]
        files = sorted(glob.glob(os.path.join(self.dir, "*.safetensors")))
        if not files:
            raise CheckpointError(f"{self.dir}: no *.safetensors files")
        return files

    def _open(self, path: str):
        h = self._handles.get(path)
        if h is None:
            _check_safetensors_file(path)
            try:
                h = safe_open(path, framework="pt")
            except Exception as e:  # safetensors raises its own error type for a bad header
                raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
            self._handles[path] = h
        return h

    def _missing(self, name: str) -> str:
        """One line for a tensor the checkpoint does not hold, naming where it was looked for."""
        idx = os.path.join(self.dir, INDEX)
        names = [os.path.basename(f) for f in self.files]
        where = os.path.basename(idx) if os.path.exists(idx) else \
            ", ".join(names) if len(names) <= 3 else f"any of its {len(names)} *.safetensors files"
        stored = self.stored_name(name)
        what = f"'{stored}' or '{name}'" if stored != name and name.endswith(".weight") else f"'{stored}'"
        return f"{self.dir}: missing tensor {what} (not in {where})"

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def _fetch(self, name: str, path: str) -> torch.Tensor:
        try:
            return self._open(path).get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read tensor '{name}' ({e})") from None

    def _stored_dtype(self, name: str, path: str) -> str:
        """safetensors dtype code of a tensor without reading it ('U8', 'BF16', ...)."""
        h = self._open(path)
        name = self.stored_name(name)
        try:
            return h.get_slice(name).get_dtype()
        except Exception as e:  # an index that names a tensor its file does not hold
            raise CheckpointError(f"{path}: cannot read tensor '{name}' ({e})") from None

    def get(self, name: str, shape: tuple[int, ...] | None = None, dtypes: tuple[torch.dtype, ...] | None = None,
            finite: bool = False) -> torch.Tensor:
        path = self.where.get(name)
        if path is None:
            raise CheckpointError(self._missing(name))
        stored = self._stored.get(name, name)
        t = self._fetch(stored, path)
        if stored.endswith(".weight_global_scale"):
            t = _reciprocal(t, stored, path)
        if self.log is not None:
            self.log.add(name, path, t)
        if dtypes is not None and t.dtype not in dtypes:
            want = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise CheckpointError(f"{path}: tensor '{stored}' has dtype {str(t.dtype).replace('torch.', '')}, "
                                  f"expected {want}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{path}: tensor '{stored}' has shape {list(t.shape)}, expected {list(shape)}")
        if finite and not all_finite(t):
            raise CheckpointError(f"{path}: tensor '{stored}' holds NaN or Inf")
        return t

    def get_float(self, name: str, shape: tuple[int, ...], dtype=torch.bfloat16) -> torch.Tensor:
        # finite: a NaN or inf weight would decode garbage with exit 0; one pass over what is read anyway
        return self.get(name, shape, (torch.bfloat16, torch.float32, torch.float16), finite=True).to(dtype)

    def linear(self, prefix: str, out_features: int, in_features: int, bias: bool = False) -> Linear:
        """A Linear at `prefix` ([out, in]), BF16 or NVFP4 as the checkpoint stores it."""
        wname = prefix + ".weight"
        path = self.where.get(wname)
        if path is None:
            raise CheckpointError(self._missing(wname))
        dtype = self._stored_dtype(wname, path)
        b = self.get_float(prefix + ".bias", (out_features,)) if bias else None
        if dtype == "F8_E4M3":
            return Linear(prefix, self._fp8(prefix, path, out_features, in_features), bias=b)
        if dtype != "U8":
            w = self.get_float(wname, (out_features, in_features))
            return Linear(prefix, w, bias=b)
        q = self._quantized(prefix, path, "NVFP4", "packed uint8 (NVFP4)",
                            "(hf_quant_config.json or quantization_config)")
        if in_features % nvfp4.BLOCK:
            raise CheckpointError(f"{path}: '{prefix}' in_features {in_features} is not a multiple of 16")
        w = self.get(wname, (out_features, in_features // 2), (torch.uint8,))
        s = self.get(prefix + ".weight_scale", (out_features, in_features // nvfp4.BLOCK), (torch.float8_e4m3fn,),
                     finite=True)
        s2 = self.get(prefix + ".weight_scale_2", None, (torch.float32,), finite=True)
        s2_at = f"{self.where[prefix + '.weight_scale_2']}: tensor '{self.stored_name(prefix + '.weight_scale_2')}'"
        if s2.numel() != 1:
            raise CheckpointError(f"{s2_at} has shape {list(s2.shape)}, expected a scalar")
        if float(s2) <= 0:
            raise CheckpointError(f"{s2_at} is {float(s2)}, expected > 0")
        # input_scale (compressed-tensors: input_global_scale), the W4A4 activation scale, is read past on purpose:
        # these kernels are W4A16.
        return Linear(prefix, w, s, s2.reshape(()), bias=b)

    def _quantized(self, prefix: str, path: str, kind: str, stored_as: str, where: str):
        """The quantization config for `prefix`'s weight, stored as `kind` (NVFP4 or FP8): one that has that kind and
        does not exclude the module, else one line naming the tensor."""
        q, name = self.config.quant, self.stored_name(prefix + ".weight")
        if q is None or not (q.nvfp4 if kind == "NVFP4" else q.fp8):
            has = "is missing" if q is None else f"is {q.algo}"
            raise CheckpointError(f"{path}: tensor '{name}' is {stored_as} but the checkpoint's quantization config "
                                  f"{has}: {kind} needs one {where}")
        if q.excluded(prefix):
            what = "its 'ignore' list" if q.layout == COMPRESSED_TENSORS else "exclude_modules"
            raise CheckpointError(f"{path}: tensor '{name}' is {kind} but the quantization config excludes "
                                  f"'{prefix}' ({what})")
        return q

    def _fp8(self, prefix: str, path: str, n: int, k: int) -> torch.Tensor:
        """An FP8 Linear's weight decoded to BF16 (ops/fp8.py): its codes times the scale beside it."""
        q = self._quantized(prefix, path, "FP8", "FP8 (float8_e4m3fn)",
                            "(quant_method 'fp8', compressed-tensors' float-quantized or ModelOpt's FP8)")
        w = self.get(prefix + ".weight", (n, k), (torch.float8_e4m3fn,))
        sname = f"{prefix}.{q.fp8_scale}"
        s = self.get(sname, None, (torch.float32, torch.bfloat16, torch.float16), finite=True)
        if fp8.layout(tuple(s.shape), n, k, q.fp8_block) is None:
            blocks = f", [{-(-n // q.fp8_block[0])}, {-(-k // q.fp8_block[1])}] (blocks of {q.fp8_block[0]} x " \
                     f"{q.fp8_block[1]})" if q.fp8_block else ""
            raise CheckpointError(f"{self.where[sname]}: tensor '{sname}' has shape {list(s.shape)}, expected [1], "
                                  f"[{n}, 1]{blocks} or [{n}, K / group] for a weight of [{n}, {k}]")
        if bool((s <= 0).any()):
            raise CheckpointError(f"{self.where[sname]}: tensor '{sname}' holds a scale <= 0")
        return fp8.dequantize(w, s, q.fp8_block)

    def fingerprint(self) -> str:
        """Cheap identity of the checkpoint: config, index, every file's size and header, and samples of its data
        (FINGERPRINT_SAMPLES reads of 64 KiB spread over each file): the same shapes with other weights (another
        seed, another fine-tune) differ here; a change confined to a few bytes between the samples does not."""
        h = hashlib.sha256()
        for extra in ("config.json", "hf_quant_config.json", INDEX):
            p = os.path.join(self.dir, extra)
            if os.path.exists(p):
                with open(p, "rb") as f:
                    h.update(f.read())
        for path in self.files:
            h.update(os.path.basename(path).encode())
            h.update(str(os.path.getsize(path)).encode())
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                h.update(f.read(min(n, 1 << 24)))
                start, span = 8 + n, max(size - 8 - n, 0)
                for i in range(FINGERPRINT_SAMPLES):
                    f.seek(start + span * i // FINGERPRINT_SAMPLES)
                    h.update(f.read(1 << 16))
        return h.hexdigest()[:16]


FINGERPRINT_SAMPLES = 32  # data reads per file in the start-up fingerprint (2 MiB a file)


def _reciprocal(t: torch.Tensor, name: str, path: str) -> torch.Tensor:
    """weight_scale_2 from compressed-tensors' weight_global_scale (fp32, finite, > 0): 1 / it, rounded once in fp32."""
    if t.dtype != torch.float32:
        raise CheckpointError(f"{path}: tensor '{name}' has dtype {str(t.dtype).replace('torch.', '')}, expected "
                              f"float32")
    if t.numel() and not (all_finite(t) and bool((t > 0).all())):
        raise CheckpointError(f"{path}: tensor '{name}' is {t.flatten()[:4].tolist()}, expected finite and > 0")
    return torch.reciprocal(t)


def value_range(t: torch.Tensor) -> torch.Tensor | None:
    """[min, max] of a floating tensor on its device (no host sync), None for an empty or integer one. A NaN anywhere
    is carried into both (aminmax), an Inf is one of them."""
    if not t.is_floating_point() or t.numel() == 0:
        return None
    return torch.stack(torch.aminmax(t.float() if t.element_size() == 1 else t))  # float8: no aminmax of its own


def finite_range(r: torch.Tensor | None) -> bool:
    """Whether a value_range holds no NaN or Inf (reads it back)."""
    return r is None or all(math.isfinite(v) for v in r.tolist())


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in `t`. One min/max pass: about 80 times faster on the CPU than isfinite().all(), which loading
    every weight of a large checkpoint would feel."""
    return finite_range(value_range(t))


def _weight_map(idx: str) -> dict[str, str]:
    """model.safetensors.index.json's weight_map: {tensor name: file name}."""
    try:
        with open(idx) as f:
            wm = json.load(f)["weight_map"]
    except (ValueError, RecursionError, KeyError, TypeError) as e:
        raise CheckpointError(f"{idx}: not a valid safetensors index ({type(e).__name__}: {e})") from None
    if not isinstance(wm, dict) or not all(isinstance(v, str) and v for v in wm.values()):
        raise CheckpointError(f"{idx}: not a valid safetensors index (weight_map must map tensor names to file names)")
    return wm


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_safetensors_file(path: str) -> None:
    """Catch truncation before safetensors does, with a message that says how many bytes are missing."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        n = struct.unpack("<Q", head)[0]
        if n > size - 8:
            raise CheckpointError(f"{path}: garbled or truncated safetensors header (claims {n} bytes, file has {size})")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise CheckpointError(f"{path}: garbled safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: garbled safetensors header (a JSON {type(header).__name__}, not an object)")
    end = 0
    for k, v in header.items():
        if k == "__metadata__":
            if not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values()):
                raise CheckpointError(f"{path}: garbled safetensors header: __metadata__ must map names to strings")
            continue
        # the entry's form, so that what follows (and safetensors' own checks) never meets a wrong type
        offs = v.get("data_offsets") if isinstance(v, dict) else None
        if (not isinstance(offs, list) or len(offs) != 2 or not all(_count(o) for o in offs) or offs[0] > offs[1]):
            raise CheckpointError(f"{path}: garbled safetensors header: tensor '{k}' has no valid data_offsets "
                                  f"({offs!r})")
        if not isinstance(v.get("dtype"), str):
            raise CheckpointError(f"{path}: garbled safetensors header: tensor '{k}' has no valid dtype "
                                  f"({v.get('dtype')!r})")
        shape = v.get("shape")
        if not isinstance(shape, list) or not all(_count(d) for d in shape):
            raise CheckpointError(f"{path}: garbled safetensors header: tensor '{k}' has no valid shape ({shape!r})")
        end = max(end, offs[1])
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: truncated safetensors file: data ends at byte {8 + n + end}, file has {size}")
