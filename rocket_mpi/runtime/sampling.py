"""Choosing a stream's next token: greedy, or a draw with temperature, top-k and top-p; and when a stream ends.

A draw depends only on the stream's own logits, its seed and the position of the token it draws (0 for the first
generated token): the uniform number comes from a counter-based hash of (seed, position), not from a generator
whose state the other streams advance, so a stream draws the same tokens alone, beside others, in any slot, on
one rank or N. The arithmetic is one row at a time in float64 on the CPU, with ties in the logits ordered by
token id, so the same logits give the same token on every rank of a job (the handshake checks the ranks run the
same torch).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rocket_mpi.errors import RocketError

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that scatters nearby inputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """A number in [0, 1) that depends on (seed, position) alone, the same on every machine."""
    return (_mix64(_mix64(seed & _MASK64) ^ (position & _MASK64)) >> 11) / float(1 << 53)


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy (argmax, ties to the lower token id); top_k 0 and top_p 1 keep every token."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def problem(self) -> str:
        """'' if the values are usable, else what is wrong with them (one phrase, for a flag or a request)."""
        t, p, k = self.temperature, self.top_p, self.top_k
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0.0 <= t < float("inf"):
            return f"temperature must be a finite number >= 0, got {t!r}"
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 < p <= 1.0:
            return f"top_p must be in (0, 1], got {p!r}"
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            return f"top_k must be an integer >= 0 (0: every token), got {k!r}"
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            return f"seed must be an integer, got {self.seed!r}"
        return ""

    def check(self) -> "Sampling":
        why = self.problem()
        if why:
            raise RocketError(why)
        return self

    def for_stream(self, s: int) -> "Sampling":
        """Stream s of a prompts file draws with seed + s, so streams given the same prompt differ."""
        return Sampling(self.temperature, self.top_p, self.top_k, self.seed + s)


GREEDY = Sampling()


def draw(logits: torch.Tensor, s: Sampling, position: int) -> int:
    """One stream's next token from its logits [V] (any float dtype, any device)."""
    row = logits.detach().to("cpu", torch.float64)
    if s.greedy:
        return int(torch.argmax(row))
    x = row / s.temperature
    v = x.numel()
    if s.top_k or s.top_p < 1.0:  # most likely first, equal logits in token order (a stable sort)
        x, order = torch.sort(x, descending=True, stable=True)
        if s.top_k and s.top_k < v:
            x, order = x[:s.top_k], order[:s.top_k]
    else:
        order = None
    p = torch.exp(x - x.max())
    cum = torch.cumsum(p, 0)
    if s.top_p < 1.0:  # the fewest most likely tokens whose mass reaches top_p
        n = int(torch.searchsorted(cum, s.top_p * float(cum[-1]))) + 1
        cum = cum[:min(n, cum.numel())]
    i = int(torch.searchsorted(cum, uniform(s.seed, position) * float(cum[-1]), right=True))
    i = min(i, cum.numel() - 1)
    return int(order[i]) if order is not None else i


def choose(rows: torch.Tensor, sampling: list[Sampling], positions: list[int]) -> list[int]:
    """Each row's next token (rows [n, V] on any device; row i draws with sampling[i] at positions[i]): the greedy
    rows in one argmax where they are, the sampled ones from one copy to the host (not a wait per row)."""
    out = [0] * len(sampling)
    greedy = [i for i, sp in enumerate(sampling) if sp.greedy]
    sampled = [i for i, sp in enumerate(sampling) if not sp.greedy]
    if greedy:
        picked = (rows if len(greedy) == len(sampling) else rows[greedy]).argmax(dim=-1).tolist()
        for i, t in zip(greedy, picked):
            out[i] = t
    if sampled:
        host = rows[sampled].float().cpu()
        for j, i in enumerate(sampled):
            out[i] = draw(host[j], sampling[i], positions[i])
    return out


MAX_LOGPROBS = 20  # alternatives per token a request may ask for (as OpenAI's chat API allows)


def logprobs(row: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probability of `token` under one stream's next-token logits (log-softmax in fp32, before any
    temperature or truncation), and its `top` most likely tokens with theirs, most likely first (ties: lower id
    first). Computed from that stream's row alone, so it does not depend on the other streams of the batch."""
    lp = torch.log_softmax(row.float(), dim=-1)   # on the row's device: only what is asked for comes back
    best = []
    if top:
        vals, ids = lp.topk(top)
        best = sorted(zip(ids.tolist(), vals.tolist()), key=lambda p: (-p[1], p[0]))
    return float(lp[token]), best


@dataclass(frozen=True)
class Stop:
    """When a stream ends before its token budget: at one of `eos` ids (unless ignore_eos), or once its text
    contains one of `strings` (which needs a tokenizer)."""
    eos: tuple[int, ...] = ()
    strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def reason(self, tokens: list[int], decode=None) -> str:
        """'' while the stream goes on, else why it ended: 'stop' (an end-of-text id or a stop string)."""
        if tokens and not self.ignore_eos and tokens[-1] in self.eos:
            return "stop"
        if self.strings and decode is not None and tokens:
            tail = decode(tokens[-_STOP_WINDOW:])
            if any(st in tail for st in self.strings):
                return "stop"
        return ""


_STOP_WINDOW = 64  # the last tokens decoded to look for a stop string (a stop string is far shorter)


def cut_at_stop(text: str, strings: tuple[str, ...]) -> str:
    """The text before the first stop string (the OpenAI API leaves the stop string out)."""
    at = min((i for i in (text.find(st) for st in strings) if i >= 0), default=-1)
    return text if at < 0 else text[:at]
