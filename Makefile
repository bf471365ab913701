# rocket_mpi: `make run` sets everything up and runs the main job; `make test` runs the tests.
SHELL := /bin/bash
PY    := .venv/bin/python
PIP   := .venv/bin/pip
MPI   := .venv/bin/mpiexec
CKPT  ?= runs/default
RANKS ?= 2
PYVERBS := /usr/lib/python3/dist-packages/pyverbs

.PHONY: setup run test static-fire fabric-bench bench checkpoint kernels clean

setup: .venv/.ready

.venv/.ready: setup.cfg setup.py
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0 numpy safetensors mpi4py mpich tokenizers tqdm pytest transformers==5.24.0 matplotlib
	@# Debian's pyverbs (the PyPI sdist does not build here); optional: only the verbs fabric needs it
	@if [ ! -d $(PYVERBS) ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  (apt-get update -qq && apt-get install -y -qq python3-pyverbs perftest >/dev/null) || echo "note: apt-get could not install python3-pyverbs; the verbs fabric will be unavailable"; fi
	@if [ -d $(PYVERBS) ]; then ln -sfn $(PYVERBS) $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/pyverbs; \
	  else echo "note: $(PYVERBS) not found; the verbs fabric will be unavailable"; fi
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $@

$(CKPT)/config.json: | setup
	$(PY) -m rocket_mpi make-checkpoint --preset default --out $(CKPT)

checkpoint: $(CKPT)/config.json

# The main job: the default model's routed experts split over $(RANKS) ranks, 8 streams x 20 tokens.
run: setup $(CKPT)/config.json
	$(MPI) -n $(RANKS) $(PY) -m rocket_mpi decode --checkpoint $(CKPT) --streams 8 --tokens 20 --out runs/decode.json

test: setup
	$(PY) -m pytest -q tests

static-fire: setup $(CKPT)/config.json
	$(PY) -m rocket_mpi static-fire --checkpoint $(CKPT) --ranks $(RANKS) --sweep 1,8 --tokens 20

fabric-bench: setup
	$(MPI) -n 2 $(PY) -m rocket_mpi fabric-bench --fabric shm
	$(MPI) -n 2 $(PY) -m rocket_mpi fabric-bench --fabric mpi

bench: setup $(CKPT)/config.json
	$(PY) scripts/bench.py --checkpoint $(CKPT)

# compile the CUDA sources with plain nvcc (no GPU needed) and parse bindings.cpp against torch's
# headers; CI runs this where nvcc exists
kernels: setup
	@if ! command -v nvcc >/dev/null; then echo "nvcc not found: skipping the kernel compile check"; \
	elif [ ! -f csrc/Makefile ]; then echo "csrc/Makefile missing: no kernels to compile"; \
	else $(MAKE) -C csrc && $(MAKE) -C csrc bindings PY=$(abspath $(PY)); fi

clean:
	rm -rf runs build *.egg-info
