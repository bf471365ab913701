"""Fabric backends behind one interface (base.Fabric.exchange)."""
from __future__ import annotations

import socket

from rocket_mpi.errors import AgreedError, FabricError
from rocket_mpi.fabric.base import LocalFabric
from rocket_mpi.fabric.cuda_ipc import CudaIpcFabric
from rocket_mpi.fabric.mpi import MpiFabric
from rocket_mpi.fabric.nccl import NcclFabric
from rocket_mpi.fabric.shm import ShmFabric
from rocket_mpi.fabric.verbs import VerbsFabric, port_states

BACKENDS = ("auto", "local", "shm", "mpi", "verbs", "cuda-ipc", "nccl")
# with a SlotExchange on a GPU: the fixed-shape step runs over them (shm and verbs through a host proxy, fabric/slots.py)
GRAPHED_FABRICS = ("local", "cuda-ipc", "nccl", "shm", "verbs")


def verbs_status() -> str | None:
    """None when this host has an ACTIVE RDMA port that pyverbs can open, else why not (one line)."""
    try:
        import pyverbs.device  # noqa: F401
    except ImportError:
        return "pyverbs is not installed (apt-get install python3-pyverbs)"
    try:
        states = port_states()
    except FabricError as e:
        return str(e)
    if not any(st == 4 for ports in states.values() for st in ports.values()):  # 4: IBV_PORT_ACTIVE
        return "no ACTIVE port on RDMA device(s) " + ", ".join(f"{d} ({len(p)} port(s))" for d, p in states.items())
    return None


def choose(name: str, comm, device: str, hostname: str | None = None) -> str:
    """Resolve --fabric auto (choose_why without the reason)."""
    return choose_why(name, comm, device, hostname)[0]


def choose_why(name: str, comm, device: str, hostname: str | None = None) -> tuple[str, str]:
    """(fabric, why): --fabric auto resolved, and what decided it (one line for the log). On one host: shm (CPU
    ranks) or cuda-ipc (GPU ranks). Across hosts: verbs where every rank has an ACTIVE RDMA port that pyverbs opens
    (decided together: a rank without RDMA must not leave the others on verbs), else mpi (CPU) or nccl (GPU).
    hostname: this rank's host as the choice sees it (default: the real one; tests stand one machine in for several
    with Settings.hostname)."""
    if comm is None or comm.size == 1:
        return "local", "one rank"
    hosts = set(comm.allgather(hostname or socket.gethostname()))
    if name != "auto":
        return name, "--fabric " + name
    kind = "GPU" if device == "cuda" else "CPU"
    if len(hosts) == 1:
        return ("cuda-ipc" if device == "cuda" else "shm"), f"{kind} ranks on one host"
    rdma = comm.allgather(verbs_status())
    where = f"{kind} ranks on {len(hosts)} hosts"
    if all(why is None for why in rdma):
        return "verbs", f"{where}, every rank has an ACTIVE RDMA port"
    rank = next(r for r, why in enumerate(rdma) if why is not None)
    return ("nccl" if device == "cuda" else "mpi"), f"{where}; rank {rank}: {rdma[rank]}"


def fabric_precheck(name: str, device: str = "cpu") -> None:
    """Local checks a fabric needs before its (collective) set-up, so a missing device is reported once."""
    if name == "verbs":
        why = verbs_status()
        if why is not None:
            raise FabricError(f"fabric verbs: {why}; use --fabric mpi (any hosts) or shm (one host)")
    if name in ("cuda-ipc", "nccl") and device != "cuda":
        raise FabricError(f"fabric {name} moves rows between GPUs: it needs --device cuda")
    if name == "cuda-ipc":
        try:
            import cuda.bindings.driver  # noqa: F401
        except ImportError:
            raise FabricError("fabric cuda-ipc needs cuda-bindings (pip install cuda-bindings); "
                              "use --fabric nccl") from None
    if name not in BACKENDS:
        raise FabricError(f"--fabric {name}: unknown (choose from {', '.join(BACKENDS)})")


def make_fabric(name: str, comm, max_rows: int, hidden: int, timeout: float, rails=None,
                rail_split_min_bytes: int = 8192, gid_index=None, device=None, hostname: str | None = None):
    if name == "local":
        return LocalFabric(0, 1, max_rows, hidden, timeout)
    if name == "shm":
        hosts = set(comm.allgather(hostname or socket.gethostname()))
        if len(hosts) > 1:  # every rank saw the same host list: they agree, rank 0 says it once
            raise AgreedError(f"fabric shm needs all ranks on one host, these span {len(hosts)} hosts; "
                              f"use --fabric mpi or verbs")
        return ShmFabric(comm, max_rows, hidden, timeout, rails=len(rails) if isinstance(rails, list) else (rails or 1),
                         rail_split_min_bytes=rail_split_min_bytes)
    if name == "mpi":
        return MpiFabric(comm, max_rows, hidden, timeout)
    if name == "verbs":
        why = verbs_status()
        if why is not None:
            raise FabricError(f"fabric verbs: {why}; use --fabric mpi (any hosts) or shm (one host)")
        return VerbsFabric(comm, max_rows, hidden, timeout, rails=rails, rail_split_min_bytes=rail_split_min_bytes,
                           gid_index=gid_index)
    if name == "nccl":
        return NcclFabric(comm, max_rows, hidden, timeout, device)
    if name == "cuda-ipc":
        return CudaIpcFabric(comm, max_rows, hidden, timeout, device)
    raise FabricError(f"--fabric {name}: unknown (choose from {', '.join(BACKENDS)})")
