#!/usr/bin/env bash
# Gather what benchmarks/bench_llamacpp.py needs on a machine without network, on a machine with it:
#   OUTDIR/llama.cpp  llama.cpp's source as llama-cpp-python $VERSION vendors it, trimmed to what a CPU or CUDA build
#                     of the tools and the HF-to-GGUF converter need (convert_hf_to_gguf.py, conversion/, gguf-py/)
#   OUTDIR/conv       the converter alone (those three and the licence), for a call that unpacks a build made in
#                     an earlier one (bench_llamacpp.py --archive / --unpack)
#   OUTDIR/wheels     the converter's Python dependencies beyond torch, numpy, safetensors and transformers that a
#                     plainer environment may lack (cp312 manylinux x86_64 or pure Python: pyyaml, tqdm); the GPU
#                     image's python3 has them, bench_llamacpp.py installs from here only what its Python cannot import
# Usage: benchmarks/llamacpp_prepare.sh OUTDIR   (then carry OUTDIR to the GPU machine, e.g. as .llamacpp/)
#
# The converter, for a Glm4MoeForCausalLM checkpoint with a byte-level BPE tokenizer.json, imports: torch, numpy,
# safetensors (the weights), transformers (AutoConfig for the config, AutoTokenizer for the vocabulary; tokenizers
# under it), gguf from gguf-py (which imports yaml at import time and tqdm while writing). sentencepiece and
# mistral_common are only for other tokenizers; requests only for remote models.
set -euo pipefail

VERSION=0.3.36
if [ $# -ne 1 ]; then
  echo "usage: $0 OUTDIR" >&2
  exit 2
fi
OUT=$1
PIP=${PIP:-pip}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

echo "== llama-cpp-python $VERSION sdist"
timeout 900 "$PIP" download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$TMP" >/dev/null
tar -xzf "$TMP/llama_cpp_python-$VERSION.tar.gz" -C "$TMP"
SRC="$TMP/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -f "$SRC/CMakeLists.txt" ] || { echo "no vendor/llama.cpp in the sdist" >&2; exit 1; }

echo "== trimmed llama.cpp -> $OUT/llama.cpp"
rm -rf "$OUT/llama.cpp"
cp -a "$SRC" "$OUT/llama.cpp"
(
cd "$OUT/llama.cpp"
# .git is a gitlink to a folder the sdist does not hold (the build's version info says "unknown" either way)
rm -rf .git .github .devops .gemini .pi docs models media benches skills ci
# tests, examples and pocs are only configured with LLAMA_BUILD_TESTS / LLAMA_BUILD_EXAMPLES (both off)
rm -rf tests examples pocs
# the server, its CLI client and the web UI are only configured with LLAMA_BUILD_SERVER (off)
rm -rf tools/server tools/cli tools/ui
# ggml backends other than the CPU and CUDA ones (each is only configured with its GGML_<NAME> option;
# ggml-hip and ggml-musa are the CUDA sources built for other vendors)
for b in blas cann et hexagon hip metal musa opencl openvino rpc sycl virtgpu vulkan webgpu zdnn zendnn; do
  rm -rf "ggml/src/ggml-$b"
done
echo "llama.cpp (llama-cpp-python $VERSION) trimmed by benchmarks/llamacpp_prepare.sh" > TRIMMED
)
du -sh "$OUT/llama.cpp"

echo "== the converter alone -> $OUT/conv (for bench_llamacpp.py --unpack: a build made in another call)"
rm -rf "$OUT/conv"
mkdir -p "$OUT/conv"
cp -a "$OUT/llama.cpp/convert_hf_to_gguf.py" "$OUT/llama.cpp/conversion" "$OUT/llama.cpp/gguf-py" \
  "$OUT/llama.cpp/LICENSE" "$OUT/conv/"
du -sh "$OUT/conv"

echo "== wheels -> $OUT/wheels"
rm -rf "$OUT/wheels"
mkdir -p "$OUT/wheels"
timeout 900 "$PIP" download --no-deps --only-binary :all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$OUT/wheels" pyyaml tqdm >/dev/null
ls -1 "$OUT/wheels"
du -sh "$OUT"
