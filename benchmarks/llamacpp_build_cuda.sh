#!/usr/bin/env bash
# Build llama.cpp's CUDA tools for benchmarks/bench_llamacpp.py on a machine without a GPU (nvcc is enough) and
# archive them for a GPU machine that is lent for short calls: there `bench_llamacpp.py --unpack` restores them and
# every benchmark step fits one call.
#   OUTDIR/llama.cpp   llama.cpp's source (benchmarks/llamacpp_prepare.sh OUTDIR first)
#   OUTDIR/toolkit     where the toolkit lacks them: cuBLAS from PyPI's nvidia-cublas wheel (the CUDA major of nvcc)
#                      and a libcuda.so stub (soname libcuda.so.1, the driver calls ggml-cuda makes as dummies: the
#                      driver's own library comes at run time);
#                      a toolkit root of links over nvcc's with those added
#   OUTDIR/work        the build (build-cuda/)
#   OUTDIR/build       the archive: llama-build-cuda.tar.xz.NN (carry it with OUTDIR/conv and OUTDIR/wheels)
# Usage: benchmarks/llamacpp_build_cuda.sh OUTDIR [ARCH]     (ARCH: CUDA architecture, default 90)
# On the GPU machine the unpacked tools find cuBLAS and the CUDA runtime in the Python's nvidia-* wheels (torch's)
# or the toolkit there: bench_llamacpp.py puts those folders on LD_LIBRARY_PATH and checks them with ldd.
set -euo pipefail
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: $0 OUTDIR [ARCH]" >&2
  exit 2
fi
OUT=$(cd "$1" && pwd)
ARCH=${2:-90}
PY=${PY:-python3}
[ -f "$OUT/llama.cpp/CMakeLists.txt" ] || { echo "$0: no $OUT/llama.cpp (run benchmarks/llamacpp_prepare.sh $1)" >&2; exit 1; }
NVCC=$(command -v nvcc || true)
[ -n "$NVCC" ] || { echo "$0: nvcc not found" >&2; exit 1; }
# the toolkit: CUDA_HOME, else the folder above nvcc's where it holds include/cuda.h (nvcc may be a wrapper or a link
# elsewhere, e.g. /usr/local/bin), else /usr/local/cuda
CUDA=${CUDA_HOME:-$(cd "$(dirname "$(readlink -f "$NVCC")")/.." && pwd)}
[ -f "$CUDA/include/cuda.h" ] || CUDA=/usr/local/cuda
[ -f "$CUDA/include/cuda.h" ] || { echo "$0: no CUDA toolkit found for $NVCC (set CUDA_HOME)" >&2; exit 1; }
MAJOR=$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
echo "== toolkit $CUDA (CUDA $MAJOR)"

ROOT=$OUT/toolkit/root
rm -rf "$ROOT"
mkdir -p "$ROOT/lib64/stubs" "$ROOT/include"
for d in "$CUDA"/*; do
  case $(basename "$d") in lib64|include) ;; *) ln -s "$d" "$ROOT/";; esac
done
for f in "$CUDA"/lib64/* "$CUDA"/targets/*/lib/*; do [ -e "$f" ] && ln -sf "$f" "$ROOT/lib64/"; done
for f in "$CUDA"/include/* "$CUDA"/targets/*/include/*; do [ -e "$f" ] && ln -sf "$f" "$ROOT/include/"; done
if [ ! -e "$ROOT/lib64/libcublas.so" ]; then
  echo "== cuBLAS: nvidia-cublas==$MAJOR.* from PyPI"
  rm -rf "$OUT/toolkit/cublas"
  mkdir -p "$OUT/toolkit/cublas"
  timeout 900 "$PY" -m pip download --no-deps --only-binary :all: "nvidia-cublas==$MAJOR.*" -d "$OUT/toolkit/cublas" >/dev/null
  "$PY" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
    "$(ls "$OUT"/toolkit/cublas/*.whl | head -1)" "$OUT/toolkit/cublas/x"
  LIB=$(dirname "$(find "$OUT/toolkit/cublas/x" -name "libcublas.so.$MAJOR" | head -1)")
  for f in "$LIB"/*; do ln -sf "$f" "$ROOT/lib64/"; done
  ln -sf "$LIB/libcublas.so.$MAJOR" "$ROOT/lib64/libcublas.so"
  ln -sf "$LIB/libcublasLt.so.$MAJOR" "$ROOT/lib64/libcublasLt.so"
  for f in "$LIB"/../include/*; do ln -sf "$f" "$ROOT/include/"; done
fi
if ! ls "$ROOT"/lib64/stubs/libcuda.so "$ROOT"/lib64/libcuda.so >/dev/null 2>&1; then
  # the driver calls ggml-cuda makes (their names after cuda.h's versioning macros), each a stub: the library then
  # needs libcuda.so.1, which the driver provides at run time (a stub without them is dropped from the link)
  echo "== libcuda.so stub (no driver here)"
  names=$(grep -rhoE "\bcu[A-Z][A-Za-z0-9_]+\s*\(" "$OUT/llama.cpp/ggml/src/ggml-cuda" | sed 's/\s*($//' | sort -u)
  printf '#include <cuda.h>\n%s\n' "$names" | gcc -E -P -I"$CUDA/include" - | tail -n "$(echo "$names" | wc -l)" \
    | grep -E '^cu[A-Za-z0-9_]+$' | sed 's/.*/int &(void) { return 999; }/' > "$OUT/toolkit/libcuda_stub.c"
  echo "   $(wc -l < "$OUT/toolkit/libcuda_stub.c") driver symbols"
  gcc -shared -fPIC -o "$ROOT/lib64/stubs/libcuda.so" -Wl,-soname,libcuda.so.1 "$OUT/toolkit/libcuda_stub.c"
fi

echo "== build and archive"
CUDAToolkit_ROOT=$ROOT CUDACXX=$ROOT/bin/nvcc "$PY" "$(dirname "$0")/bench_llamacpp.py" --llama "$OUT/llama.cpp" \
  --work "$OUT/work" --build --steps "" --archive "$OUT/build" --jobs "$(nproc)" \
  --cmake-arg=-DCMAKE_CUDA_ARCHITECTURES="$ARCH" --cmake-arg=-DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined
ls -l "$OUT/build"
