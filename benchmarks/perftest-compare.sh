#!/usr/bin/env bash
# The verbs fabric beside perftest on the same sizes and rails: ib_write_bw on every rail at once (summed),
# ib_write_lat on rail 0, and the report's table with its "of perftest" column (fabric_bench.py does the work).
# Two ranks with RDMA: two nodes under Slurm (jobs/fabric-bench.sbatch), or set MPIEXEC for your launcher.
# Exits 1 with one line where perftest or an RDMA device is missing: a comparison that did not run is not a pass.
#   benchmarks/perftest-compare.sh [--rails 2] [--sizes 2K..4M] [--rail-split-min-bytes 2048] [fabric-bench flags]
set -euo pipefail
cd "$(dirname "$0")/.."
exec ${MPIEXEC:-.venv/bin/mpiexec -n 2} .venv/bin/python -m rocket_mpi fabric-bench --fabric verbs --perftest "$@"
