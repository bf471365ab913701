"""Prompts: a JSON file of token-id lists or strings, or a deterministic default set."""
from __future__ import annotations

import json
import os

import torch

from rocket_mpi.errors import RocketError


def default_prompts(streams: int, vocab_size: int, seed: int = 1234) -> list[list[int]]:
    """Stream s's prompt depends only on (seed, s): M=1 is stream 0 of M=8. Lengths differ per stream."""
    out = []
    for s in range(streams):
        g = torch.Generator().manual_seed(seed * 7919 + s)
        n = 3 + (s * 5) % 11
        out.append(torch.randint(2, vocab_size, (n,), generator=g).tolist())
    return out


def load_tokenizer(ckpt_dir: str):
    path = os.path.join(ckpt_dir, "tokenizer.json")
    if not os.path.exists(path):
        return None
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(path)
    except Exception as e:
        raise RocketError(f"{path}: not a readable tokenizer ({e})") from None


def read_prompts(path: str, ckpt_dir: str, streams: int | None) -> tuple[list[list[int]], bool]:
    """-> (token-id lists, were they text). `streams` cycles or cuts the file's prompts to M."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise RocketError(f"--prompts {path}: file not found") from None
    except json.JSONDecodeError as e:
        raise RocketError(f"--prompts {path}: not valid JSON ({e})") from None
    if not isinstance(raw, list) or not raw:
        raise RocketError(f"--prompts {path}: expected a non-empty JSON list of token-id lists or strings")
    text = all(isinstance(p, str) for p in raw)
    if text:
        tok = load_tokenizer(ckpt_dir)
        if tok is None:
            raise RocketError(f"--prompts {path}: text prompts need {os.path.join(ckpt_dir, 'tokenizer.json')}")
        ids = [tok.encode(p).ids for p in raw]
    else:
        for i, p in enumerate(raw):
            if not isinstance(p, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise RocketError(f"--prompts {path}: entry {i} is neither a string nor a list of token ids")
        ids = raw
    if streams:
        ids = [ids[i % len(ids)] for i in range(streams)]
    return ids, text
