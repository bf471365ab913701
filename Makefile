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

.venv/.ready: pyproject.toml setup.cfg setup.py
	python3 -m venv .venv
	$(PIP) install --upgrade pip setuptools wheel
	@# The CPU torch this venv is checked with (setup.cfg declares the range, torch>=2.4,<3), first: the
	@# --no-build-isolation install below runs setup.py with it. Every other dependency and pin: setup.cfg.
	$(PIP) install torch==2.13.0
	@# Debian's pyverbs (the PyPI sdist does not build here); optional: only the verbs fabric needs it
	@if [ ! -d $(PYVERBS) ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  (apt-get update && apt-get install -y python3-pyverbs perftest) || echo "note: apt-get could not install python3-pyverbs; the verbs fabric will be unavailable"; fi
	@if [ -d $(PYVERBS) ]; then ln -sfn $(PYVERBS) $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/pyverbs; \
	  else echo "note: $(PYVERBS) not found; the verbs fabric will be unavailable"; fi
	$(PIP) install --no-build-isolation -e '.[test,bench]'
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

# the transport tables of the CPU fabrics, each with its plot (runs/fabric-bench-NAME.png)
fabric-bench: setup
	@mkdir -p runs
	$(MPI) -n 2 $(PY) -m rocket_mpi fabric-bench --fabric shm --plot runs/fabric-bench-shm.png
	$(MPI) -n 2 $(PY) -m rocket_mpi fabric-bench --fabric mpi --plot runs/fabric-bench-mpi.png

bench: setup $(CKPT)/config.json
	$(PY) benchmarks/bench.py --checkpoint $(CKPT)

# compile the CUDA sources with plain nvcc (no GPU needed) and parse bindings.cpp against torch's
# headers; CI runs this where nvcc exists
kernels: setup
	@if ! command -v nvcc >/dev/null; then echo "nvcc not found: skipping the kernel compile check"; \
	elif [ ! -f csrc/Makefile ]; then echo "csrc/Makefile missing: no kernels to compile"; \
	else $(MAKE) -C csrc && $(MAKE) -C csrc bindings PY=$(abspath $(PY)); fi

clean:
	rm -rf runs build *.egg-info
