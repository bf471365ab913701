"""The host-side proxy of the doorbell fabrics' graphed exchange: a native thread (csrc/proxy.cpp) per rank, driven
through ctypes.

Our GPU writes a ready record {seq, rows} into host memory once this rank's block of an exchange is staged; the
proxy sees it, has the block put into every peer's region and rings the peer's doorbell words. Where it runs was
the choice that set the exchange's latency: a Python thread would hold the GIL while it polls and fight the main
thread, which spends a graphed decode polling the step's completion (benchmarks/bench_proxy.py measures the two
side by side on the CPU). So the loop is native and polls without the GIL. On shm the GPU has already put the rows
into the peers' segments (csrc/proxy_bells.cu) and the native loop only rings (release stores of seq into the
doorbell words, mapped here); verbs posts its RDMA writes through pyverbs, so the native loop calls back into Python
for each exchange (ctypes takes the GIL for the call; the step's wait gives it up, runtime/graph.py).

The thread stops with the fabric (close) or at interpreter exit (atexit), whichever comes first, and dies with the
process on any other ending: it never outlives the job.
"""
from __future__ import annotations

import atexit
import ctypes
import weakref

from rocket_mpi.errors import FabricError
from rocket_mpi.ops import _ext

MAX_RANKS = 64          # kMaxRanks in csrc/proxy.cpp (the device plan's limit)
IDLE_SLEEP_US = 2000    # idle this long, the proxy sleeps 50 us between polls instead of spinning
POST = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64)


class ProxyArgs(ctypes.Structure):
    """csrc/proxy.cpp ProxyArgs, field for field."""
    _fields_ = [("ready", ctypes.c_void_p), ("bell", ctypes.c_void_p * MAX_RANKS), ("post", POST), ("ctx", ctypes.c_void_p),
                ("row_bytes", ctypes.c_int64), ("slot_bytes", ctypes.c_int64), ("max_rows", ctypes.c_int64),
                ("last", ctypes.c_uint64), ("rank", ctypes.c_int32), ("n_ranks", ctypes.c_int32),
                ("rails", ctypes.c_int32), ("idle_sleep_us", ctypes.c_int32)]


def library() -> ctypes.CDLL:
    """The proxy's native code, compiled into the CUDA extension (rocket_mpi._C)."""
    mod = _ext.load()
    if mod is None:
        raise FabricError(f"the doorbell fabrics' graphed exchange needs the extension: {_ext.reason()}")
    return bind(ctypes.CDLL(mod.__file__))


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the proxy's C functions on `lib` (the extension, or a build of csrc/proxy.cpp alone) and check that
    both sides agree on ProxyArgs."""
    lib.rocket_proxy_start.restype = ctypes.c_void_p
    lib.rocket_proxy_start.argtypes = [ctypes.POINTER(ProxyArgs), ctypes.c_char_p, ctypes.c_int]
    for fn in (lib.rocket_proxy_stop, lib.rocket_proxy_free):
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p]
    lib.rocket_proxy_status.restype = ctypes.c_int
    lib.rocket_proxy_status.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
                                        ctypes.POINTER(ctypes.c_uint64), ctypes.c_char_p, ctypes.c_int]
    lib.rocket_proxy_args_size.restype = ctypes.c_int64
    if lib.rocket_proxy_args_size() != ctypes.sizeof(ProxyArgs):
        raise FabricError(f"the proxy's native code was built with another ProxyArgs ({lib.rocket_proxy_args_size()} "
                          f"bytes, {ctypes.sizeof(ProxyArgs)} here): rebuild the extension")
    return lib


_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for p in list(_LIVE):
        p.stop()


class Proxy:
    """One rank's proxy thread. ready: address of the two ready records (host memory our GPU writes); last: every
    seq up to it is done. Transport: bell (native, the rows already put: per rank, the address of our rail-0 doorbell
    word on that rank, mapped in this process; None for us), or post (callback: post(seq, rows) puts and rings,
    raising on failure)."""

    def __init__(self, lib: ctypes.CDLL, *, ready: int, rank: int, size: int, rails: int, row_bytes: int,
                 slot_bytes: int, max_rows: int, last: int, bell: list[int | None] | None = None, post=None,
                 who: str = ""):
        if size > MAX_RANKS:
            raise FabricError(f"{who}the proxy takes at most {MAX_RANKS} ranks, got {size}")
        self.lib, self.who = lib, who
        self.error: str | None = None  # the callback's exception, where it raised
        self._final: tuple[int, int, str | None] = (last, 0, None)  # status() once stopped
        self._handle = None
        a = ProxyArgs(ready=ready, ctx=None, row_bytes=row_bytes, slot_bytes=slot_bytes, max_rows=max_rows,
                      last=last & ((1 << 64) - 1), rank=rank, n_ranks=size, rails=rails, idle_sleep_us=IDLE_SLEEP_US)
        if post is not None:
            self._post = POST(self._callback(post))  # kept alive as long as the thread may call it
            a.post = self._post
        else:
            self._post = None
            for r in range(size):
                a.bell[r] = bell[r]
        err = ctypes.create_string_buffer(512)
        self._handle = lib.rocket_proxy_start(ctypes.byref(a), err, len(err))
        if not self._handle:
            raise FabricError(f"{who}cannot start the proxy: {err.value.decode(errors='replace')}")
        _LIVE.add(self)

    def _callback(self, post):
        def call(_ctx, seq, rows):
            try:
                post(int(seq), int(rows))
                return 0
            except BaseException as e:  # noqa: BLE001 - kept for status(); the thread stops
                self.error = f"{type(e).__name__}: {e}" if not isinstance(e, FabricError) else str(e)
                return 1
        return call

    def status(self) -> tuple[int, int, str | None]:
        """(the last seq put and rung, exchanges handled, why the thread stopped or None)."""
        if not self._handle:
            return self._final
        handled, count = ctypes.c_uint64(), ctypes.c_uint64()
        msg = ctypes.create_string_buffer(512)
        bad = self.lib.rocket_proxy_status(self._handle, ctypes.byref(handled), ctypes.byref(count), msg, len(msg))
        why = None
        if bad:
            why = msg.value.decode(errors="replace") + (f": {self.error}" if self.error else "")
        return handled.value, count.value, why

    @property
    def running(self) -> bool:
        return bool(self._handle)

    def stop(self) -> None:
        """Stop and join the thread (without the GIL: a callback in flight finishes). Idempotent."""
        handle = self._handle
        if handle:
            self.lib.rocket_proxy_stop(handle)
            self._final = self.status()
            self._handle = None
            self.lib.rocket_proxy_free(handle)
