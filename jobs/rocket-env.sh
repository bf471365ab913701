# The environment every jobs/*.sbatch script starts with (sourced, not submitted):
#   ROOT=${ROCKET_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}; . "$ROOT/jobs/rocket-env.sh"
# - goes to the repo root (where .venv/bin/python is), from the submit directory or ROCKET_ROOT;
# - RUNS: where the jobs write their JSON / PNG: runs/ in the repo root (created here), or ROCKET_RUNS;
# - the MPI type srun gives the ranks, exported as SLURM_MPI_TYPE (srun's --mpi), so a plain `srun` and
#   static-fire's `--launcher srun` both use it: ROCKET_SRUN_MPI=pmi2|pmix|... if set, else the one the MPI
#   under .venv/bin/python speaks (MPICH, as the PyPI mpich wheel brings: pmi2; Open MPI: pmix) where
#   `srun --mpi=list` offers it, else the cluster's MpiDefault (with a warning); MPICH under pmi2 gets its OFI
#   netmod (MPIR_CVAR_CH4_NETMOD=ofi; why: below);
# - threads per rank from the allocation (--cpus-per-task, default 1), also handed to srun's steps;
# - rdma_ready: true where this node has an ACTIVE RDMA port, perftest and pyverbs (verbs / --perftest).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
    echo "rocket_mpi job: $PWD/.venv/bin/python not found: submit from the repo root after 'make setup'" \
         "(or set ROCKET_ROOT to it)" >&2
    exit 1
fi
export PYTHONUNBUFFERED=1
mkdir -p "${ROCKET_RUNS:-runs}"
RUNS=$(cd "${ROCKET_RUNS:-runs}" && pwd)

THREADS=${SLURM_CPUS_PER_TASK:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$THREADS}
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
    export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK  # srun (22.05+) no longer reads SLURM_CPUS_PER_TASK
fi

_mpi_lib=$(.venv/bin/python -c 'import mpi4py; mpi4py.rc.initialize = False
from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])' 2>/dev/null || true)
if [ -n "${ROCKET_SRUN_MPI:-}" ]; then
    export SLURM_MPI_TYPE=$ROCKET_SRUN_MPI
elif [ -z "${SLURM_MPI_TYPE:-}" ]; then
    case "$_mpi_lib" in
        *"Open MPI"*) _mpi_want=pmix ;;
        *MPICH*|*MVAPICH*|*"Intel(R) MPI"*) _mpi_want=pmi2 ;;
        *) _mpi_want= ;;
    esac
    if [ -n "$_mpi_want" ] && srun --mpi=list 2>&1 | grep -qw "$_mpi_want"; then
        export SLURM_MPI_TYPE=$_mpi_want
    else
        echo "rocket_mpi job: warning: MPI '${_mpi_lib:-not importable}' wants srun --mpi=${_mpi_want:-?}, which" \
             "srun --mpi=list does not offer; srun uses the cluster's MpiDefault (set ROCKET_SRUN_MPI to choose)" >&2
    fi
    unset _mpi_want
fi
# MPICH speaks PMI-1 to srun's pmi2 plugin, which takes each request in ONE read of at most 1024 bytes. MPICH's
# UCX netmod puts its start-up address exchange in lines of up to ~1.1 KB: one arrives cut, and a job on several
# nodes hangs in MPI_Init (slurmstepd: "mpi/pmi2: value not properly terminated in client request"). The OFI
# netmod's addresses are a few dozen bytes. Set MPIR_CVAR_CH4_NETMOD yourself to choose otherwise.
case "$_mpi_lib" in
    MPICH*) [ "${SLURM_MPI_TYPE:-}" != pmi2 ] || export MPIR_CVAR_CH4_NETMOD=${MPIR_CVAR_CH4_NETMOD:-ofi} ;;
esac
unset _mpi_lib
echo "rocket_mpi job ${SLURM_JOB_ID:-?}: ${SLURM_NNODES:-?} node(s) (${SLURM_JOB_NODELIST:-?}), ${SLURM_NTASKS:-?} task(s)," \
     "srun --mpi=${SLURM_MPI_TYPE:-(MpiDefault)}${MPIR_CVAR_CH4_NETMOD:+ (MPICH netmod $MPIR_CVAR_CH4_NETMOD)}," \
     "$THREADS thread(s) per rank, output in $RUNS"

rdma_ready() {
    grep -qs ACTIVE /sys/class/infiniband/*/ports/*/state && command -v ib_write_bw >/dev/null \
        && command -v ib_write_lat >/dev/null && .venv/bin/python -c 'import pyverbs' 2>/dev/null
}
