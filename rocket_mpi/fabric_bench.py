"""fabric-bench: the transport table for a fabric backend (owned by the verbs/fabric-bench work)."""
from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("fabric-bench", help="transport table of a fabric (run under mpirun -np 2)")
    p.add_argument("--fabric", default="auto")


def main(args) -> int:
    from rocket_mpi.errors import RocketError
    raise RocketError("fabric-bench is being written")
