"""fabric-bench under mpiexec -n 2 for the CPU fabrics this machine has (shm, mpi): the table has its rows and
columns and sane positive numbers (never timing assertions); rank-count and perftest errors are one line;
the size and perftest parsers on known text."""
import argparse
import math
import os

import pytest

from conftest import rocket_mpi
from rocket_mpi.cli import fabric_bench as fb

SMALL = ["--sizes", "2K,64K", "--iters", "6", "--reps", "2"]


def table(stdout: str) -> list[dict]:
    rows = fb.parse_table(stdout)
    assert [r["message"] for r in rows] == ["2 KiB", "64 KiB"], stdout
    for r in rows:
        for k, v in r.items():
            if k != "message":
                assert math.isfinite(v) and v > 0, (k, v, stdout)
    return rows


def one_error_line(r, needle):
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0 and len(lines) == 1 and needle in lines[0], r.stderr
    return lines[0]


@pytest.mark.parametrize("fabric", ["shm", "mpi"])
def test_fabric_bench_table(fabric):
    r = rocket_mpi(2, "fabric-bench", "--fabric", fabric, *SMALL, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"fabric-bench: fabric {fabric}, 2 ranks" in r.stdout
    rows = table(r.stdout)
    assert set(rows[0]) == {"message", "oneway GB/s", "pingpong us", "duplex GB/s"}


def test_fabric_bench_shm_two_rails_and_plot(tmp_path):
    png = tmp_path / "fb.png"
    r = rocket_mpi(2, "fabric-bench", "--fabric", "shm", "--rails", "2", "--split-min", "4096", "--plot", str(png),
                   *SMALL, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = table(r.stdout)
    assert "1-rail GB/s" in rows[0] and "2 virtual rails, split at 4096 B" in r.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not importable" in r.stdout
    else:
        assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_fabric_bench_needs_two_ranks():
    r = rocket_mpi(3, "fabric-bench", "--fabric", "mpi", *SMALL, timeout=120)
    one_error_line(r, "needs exactly 2 ranks")
    assert "got 3" in r.stderr


def test_perftest_without_device_is_one_line():
    from rocket_mpi.cli.fabric_bench import perftest_status
    why = perftest_status()
    if why is None:
        pytest.skip("perftest and an RDMA device are here: the comparison itself would run")
    r = rocket_mpi(2, "fabric-bench", "--fabric", "verbs", "--perftest", *SMALL, timeout=120)
    one_error_line(r, "--perftest: nothing to compare")


def test_parse_sizes():
    assert fb.parse_sizes("2K..16K") == [2048, 4096, 8192, 16384]
    assert fb.parse_sizes("1M,2K,8KiB,2K") == [2048, 8192, 1 << 20]
    assert fb.parse_sizes(fb.DEFAULT_SIZES)[-1] == 4 << 20
    for bad in ("1000", "2K..1K", "x", ",", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            fb.parse_sizes(bad)


def test_table_round_trip():
    res = [{"bytes": 2048, "oneway_gbs": 3.91, "one_rail_gbs": 4.56, "pingpong_us": 3.54, "duplex_gbs": 7.5},
           {"bytes": 1 << 20, "oneway_gbs": 23.06, "one_rail_gbs": 12.8, "pingpong_us": 49.79, "duplex_gbs": 46.2}]
    rows = fb.parse_table(fb.format_table(res, "fabric verbs"))
    assert rows[1] == {"message": "1 MiB", "oneway GB/s": 23.06, "1-rail GB/s": 12.8, "pingpong us": 49.79,
                       "duplex GB/s": 46.2}
    cmp = fb.format_perftest(res, {2048: (21.52, 2.58), 1 << 20: (23.15, 80.4)}, 2)
    assert "of perftest" in cmp and " 18%" in cmp and "100%" in cmp


# perftest 4.5 output, trimmed to the lines that matter
BW_OUT = """
---------------------------------------------------------------------------------------
                    RDMA_Write BW Test
 Dual-port       : OFF          Device         : rocep1s0f1
 Number of qps   : 1            Transport type : IB
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]
 65536      1000             92.61              92.57              0.176574
---------------------------------------------------------------------------------------
"""
LAT_OUT = """
 #bytes #iterations  t_min[usec]  t_max[usec]  t_typical[usec]  t_avg[usec]  t_stdev[usec]  99% percentile[usec]
 2048       1000        2.41         6.10         2.58            2.62         0.11           3.02
"""


def test_perftest_parsers_and_commands():
    assert fb.parse_perftest("ib_write_bw", 65536, BW_OUT) == pytest.approx(92.57 / 8)
    assert fb.parse_perftest("ib_write_lat", 2048, LAT_OUT) == pytest.approx(2.58)
    with pytest.raises(fb.FabricError, match="no result row"):
        fb.parse_perftest("ib_write_bw", 4096, BW_OUT)
    from rocket_mpi.fabric.verbs import Rail
    cmd = fb.perftest_cmd("ib_write_bw", Rail("rocep1s0f1", 1), 3, 65536, 1000, 18516, "node2")
    assert cmd[:3] == ["ib_write_bw", "-d", "rocep1s0f1"] and "--report_gbits" in cmd and cmd[-1] == "node2"
    assert cmd[cmd.index("-x") + 1] == "3" and cmd[cmd.index("-p") + 1] == "18516"


def test_job_and_script_are_thin():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    job = open(os.path.join(root, "jobs", "fabric-bench.sbatch")).read()
    assert "#SBATCH --nodes=2" in job and "--ntasks-per-node=1" in job
    assert "fabric-bench --fabric auto" in job and "--fabric verbs --perftest" in job and "rdma_ready" in job
    script = os.path.join(root, "benchmarks", "perftest-compare.sh")
    assert os.access(script, os.X_OK) and "fabric-bench --fabric verbs --perftest" in open(script).read()


def test_graph_and_versus_errors_are_one_line():
    r = rocket_mpi(2, "fabric-bench", "--fabric", "shm", "--graph", *SMALL, timeout=120)
    one_error_line(r, "--graph needs --device cuda and a GPU fabric (cuda-ipc, nccl, shm, verbs), not cpu/shm")
    r = rocket_mpi(2, "fabric-bench", "--fabric", "shm", "--versus", "cuda-ipc", *SMALL, timeout=120)
    one_error_line(r, "--versus cuda-ipc compares two fabrics' graphed exchanges: it needs --graph")
