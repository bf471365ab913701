"""benchmarks/bench_llamacpp.py's build archive: a llama.cpp build made in one GPU-machine call travels to the next
as xz parts of at most ARCHIVE_PART bytes (--archive), unpacked bit for bit with the commands that built it
(--unpack); a missing, out-of-order or damaged part, or an archive without the tools, is one error naming what is
wrong."""
import importlib.util
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_llamacpp.py")


@pytest.fixture(scope="module")
def bl():
    spec = importlib.util.spec_from_file_location("bench_llamacpp", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake_build(bins):
    """The build's bin/: the tools, a versioned library and its link, and a file the archive leaves out."""
    bins.mkdir(parents=True)
    files = {}
    for i, name in enumerate((*("llama-bench", "llama-batched-bench", "llama-quantize", "llama-completion"),
                              "libggml-cuda.so.0.9.7")):
        files[name] = os.urandom(3000 + 500 * i)
        (bins / name).write_bytes(files[name])
    (bins / "libggml-cuda.so.0").symlink_to("libggml-cuda.so.0.9.7")
    (bins / "notes.txt").write_text("left out")
    return files


def test_archive_round_trip_in_parts(bl, tmp_path, monkeypatch):
    files = _fake_build(tmp_path / "bin")
    monkeypatch.setattr(bl, "ARCHIVE_PART", 4096)  # random bytes do not compress: several parts
    name = bl.archive_name(False)
    parts = bl.archive_build(tmp_path / "bin", tmp_path / "out", name, ["cmake -S a -B b", "cmake --build b"])
    assert len(parts) > 2 and all(p.stat().st_size <= 4096 for p in parts)
    assert [p.name for p in parts] == [f"{name}.{i:02d}" for i in range(len(parts))]
    got, made = bl.unpack_build(tmp_path / "out", name, tmp_path / "bin2")
    assert got == parts and made == ["cmake -S a -B b", "cmake --build b"]
    for f, data in files.items():
        assert (tmp_path / "bin2" / f).read_bytes() == data
    assert os.readlink(tmp_path / "bin2" / "libggml-cuda.so.0") == "libggml-cuda.so.0.9.7"
    assert not (tmp_path / "bin2" / "notes.txt").exists()
    # a second archive replaces the first's parts
    (tmp_path / "bin" / "llama-bench").write_bytes(b"small")
    again = bl.archive_build(tmp_path / "bin", tmp_path / "out", name, [])
    assert sorted((tmp_path / "out").iterdir()) == again


def test_archive_errors_name_the_problem(bl, tmp_path, monkeypatch):
    _fake_build(tmp_path / "bin")
    monkeypatch.setattr(bl, "ARCHIVE_PART", 4096)
    name = bl.archive_name(False)
    with pytest.raises(bl.StepFailed, match="no llama-build-cuda.tar.xz.00"):
        bl.unpack_build(tmp_path / "empty", name, tmp_path / "x")
    parts = bl.archive_build(tmp_path / "bin", tmp_path / "out", name, [])
    parts[1].unlink()
    with pytest.raises(bl.StepFailed, match=r"parts \[0, 2"):
        bl.unpack_build(tmp_path / "out", name, tmp_path / "x")
    parts = bl.archive_build(tmp_path / "bin", tmp_path / "out", name, [])
    parts[-1].write_bytes(parts[-1].read_bytes()[:-100])
    with pytest.raises(bl.StepFailed, match="do not unpack"):
        bl.unpack_build(tmp_path / "out", name, tmp_path / "y")
    (tmp_path / "bin" / "llama-quantize").unlink()
    with pytest.raises(bl.StepFailed, match="llama-quantize not built"):
        bl.archive_build(tmp_path / "bin", tmp_path / "out", name, [])


def test_flags_build_and_unpack_exclusive(tmp_path):
    conv = tmp_path / "conv"
    conv.mkdir()
    (conv / "convert_hf_to_gguf.py").write_text("")
    base = [sys.executable, BENCH, "--llama", str(conv), "--work", str(tmp_path / "w"), "--steps", ""]
    p = subprocess.run(base + ["--build"], capture_output=True, text=True)
    assert p.returncode == 2 and "holds no CMakeLists.txt" in p.stderr
    (conv / "CMakeLists.txt").write_text("")
    p = subprocess.run(base + ["--build", "--unpack", str(tmp_path)], capture_output=True, text=True)
    assert p.returncode == 2 and "one or the other" in p.stderr


def test_unpacked_tools_find_cuda_libraries_and_name_missing_ones(bl, tmp_path, monkeypatch):
    """A build archived on another machine has no RPATH to cuBLAS or the CUDA runtime: --unpack looks for them in the
    Python's nvidia-* wheels (a folder with no CUDA library is not added) and ldd names what is still missing."""
    lib = tmp_path / "site" / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcublas.so.13").write_bytes(b"")
    (tmp_path / "site" / "nvidia" / "nccl" / "lib").mkdir(parents=True)  # no libcu*: not a CUDA library folder
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site"), *sys.path])
    monkeypatch.delenv("CUDA_HOME", raising=False)
    dirs = bl.cuda_library_dirs()
    assert dirs[0] == str(lib) and not any(d.endswith(os.path.join("nccl", "lib")) for d in dirs)
    if subprocess.run(["sh", "-c", "command -v ldd"], capture_output=True).returncode != 0:
        pytest.skip("no ldd here to check the missing-library report")
    # a shared object that needs a library nowhere on the path
    src = tmp_path / "a.c"
    src.write_text("int f(void) { return 0; }\n")
    dep = tmp_path / "libnowhere_rocket.so"
    tool = tmp_path / "tool"
    cc = subprocess.run(["sh", "-c", f"cc -shared -fPIC -o {dep} {src} && echo 'int f(void); int main(void) "
                         f"{{ return f(); }}' | cc -x c - -o {tool} -L{tmp_path} -lnowhere_rocket"],
                        capture_output=True, text=True)
    if cc.returncode != 0:
        pytest.skip(f"no C compiler to build the check's binary: {cc.stderr.strip()[:200]}")
    assert bl.missing_libraries(tool) == ["libnowhere_rocket.so"]
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))
    assert bl.missing_libraries(tool) == []
