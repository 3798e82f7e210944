# Two entry points do all set-up on a fresh machine: `make verify` and `make test`.
PYTHON  ?= python3
VENV    ?= .venv
TORCH   ?= torch==2.13.0
LAYOUTS ?= cases/dsv3.yaml
ARGS    ?=
BIN      = $(VENV)/bin
STAMP    = $(VENV)/.bitparity-installed

CASE    ?= cases/smoke.yaml
BUDGET  ?= 10m

.PHONY: verify test bench bench-gpu fuzz venv clean

# The stamp depends on the manifest and the torch pin, so editing either refreshes the venv.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

verify: $(STAMP)
	$(BIN)/bitparity verify $(LAYOUTS) $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

bench: $(STAMP)
	$(BIN)/python bench/bench_fuzz.py
	$(BIN)/python bench/bench_overlap.py
	$(BIN)/python bench/bench_verify.py $(ARGS)

# the long hypothesis profile for the layout properties, then random layouts against CASE's baseline
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz $(BIN)/python -m pytest -q tests/test_strategies.py
	$(BIN)/bitparity fuzz $(CASE) --budget $(BUDGET) $(ARGS)

# on a CUDA machine (torch with CUDA and Triton): fingerprint kernel and capture-overhead benchmarks
bench-gpu:
	python3 bench/bench_fingerprint_gpu.py
	python3 bench/bench_gpu_capture.py

clean:
	rm -rf $(VENV) reports/*/
