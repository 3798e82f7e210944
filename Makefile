# Two entry points do all set-up on a fresh machine: `make verify` and `make test`.
# PY=3.12: build the venv with that Python (pyenv's, else pythonX.Y on PATH) in .venv-3.12; megatron-core >= 0.17
# needs Python >= 3.12 (the `megatron` extra takes 0.16.x under 3.11, 0.19.x under 3.12).  Left empty: PYTHON.
PY      ?=
ifeq ($(PY),)
PYTHON  ?= python3
VENV    ?= .venv
else
PYTHON  ?= $(firstword $(wildcard $(shell pyenv root 2>/dev/null)/versions/$(PY)*/bin/python$(PY)) \
                       $(shell command -v python$(PY) 2>/dev/null))
VENV    ?= .venv-$(PY)
endif
TORCH   ?= torch==2.13.0
LAYOUTS ?= cases/dsv3.yaml
ARGS    ?=
BIN      = $(VENV)/bin
# two stamps: what the verify targets need (bitparity, torch, megatron-core), then the test tools on top (pytest,
# ruff, triton for the kernel tests, transformers as an oracle): a fresh clone's `make verify` does not wait for the
# second (~15 s of its ~300, measured 2026-12-06)
STAMP_RUN = $(VENV)/.bitparity-run
STAMP     = $(VENV)/.bitparity-installed

CASE    ?= cases/smoke.yaml
BUDGET  ?= 10m

# pytest-xdist workers: the suite keeps ~0.6 of 2 cores busy on its own (rank start-up, gloo waits, watchdogs),
# so three workers take it from 9.5 to 6 minutes on 2 cores (measured on an AMD EPYC)
PYTEST_WORKERS ?= 3
# test-portability sends whole modules to one worker: a module-scoped fixture (a case run once, read by many tests)
# runs once, not once per worker that draws one of its tests (495 -> 412 s for one setting on 2 cores, AMD EPYC).
# test and test-megatron keep xdist's default: whole modules left their last minutes to one worker (make test 777 s
# against 725 s; test-megatron 940 s against 853 s: test_sources and test_megatron_overlap are ~10 minutes each).
# (--dist loadgroup does not group under pytest 9 with xdist 3.8: xdist renames item._nodeid, pytest 9 reads _id.)
PORTABILITY_DIST ?= loadscope

# Another machine's arithmetic, at home: the expectation-bearing tests and the small cases again under other
# ATen kernel sets and MKL's reproducible branch, so an expectation that flips with the CPU fails here.  A setting
# joins variables with commas: ATen's scalar kernels (other reduction orders than a vectorised CPU's) and MKL's
# reproducible branch (other GEMM paths than this CPU's) at once are one other machine, in one pass (CI's 90
# minutes); `make test-portability PORTABILITY_SETTINGS="ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE"` runs
# each alone.  ATEN_CPU_CAPABILITY=avx2 is a CPU without AVX-512 (skipped on one: it is this CPU's own).
PORTABILITY_SETTINGS ?= ATEN_CPU_CAPABILITY=default,MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=avx2
PORTABILITY_TESTS    ?= tests/test_optimizer.py tests/test_reductions.py tests/test_expert_parallel.py tests/test_verify_e2e.py \
                        tests/test_overlap.py tests/test_faults.py tests/test_evidence.py tests/test_model.py \
                        tests/test_megatron_trainer.py tests/test_crossimpl.py tests/test_mla_convention.py \
                        tests/test_signature.py tests/test_dataflow.py tests/test_long.py tests/test_nonfinite.py \
                        tests/test_loss_masks.py tests/test_version_expectations.py
# (cases/smoke.yaml is not here: tests/test_verify_e2e.py runs it and asserts its verdicts)
# PORTABILITY_MARK picks the tests of PORTABILITY_TESTS that run (pytest -m): CI, which runs the megatron versioned
# subset under the first setting already, leaves out what that pass ran (.ci/run)
PORTABILITY_MARK     ?= not arithmetic_free
PORTABILITY_CASES    ?= cases/overlap-ep.yaml cases/megatron-dsv3.yaml cases/megatron-overlap.yaml \
                        cases/megatron-upstream-bugs.yaml cases/megatron-distopt.yaml cases/megatron-proxy.yaml \
                        cases/megatron-resume.yaml

# Goldens (harness.judging.golden): the bits of cases/<c>.yaml for GOLDEN_ITERS steps in goldens/<c>, recorded and
# checked under one arithmetic, so a change that moves every layout alike fails `make verify-golden` (CI), a
# slow-onset one too.  ties: router top-k ties, where a tie-break change moves the MTP losses on every layout.
GOLDEN_ENV   ?= ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE
GOLDEN_CASES ?= smoke ties
GOLDEN_ITERS ?= 8
# The long profile: the dsv3 layouts for LONG_ITERS steps (bugs that show only after a few updates)
LONG_ITERS  ?= 8

# Megatron-LM's own training loop with the bitparity capture (README "Capture inside your own training job"): the
# tiny model of cases/pretrain/tiny-moe-mtp.args trained twice, MTP after the last decoder layer (Et|tmL) and MTP in
# a stage without decoder layers (Ett|mL; both co-located with the loss in Megatron's sense), 2 ranks over gloo, then
# `bitparity compare`; then resumed under the other layout, and migrated to HybridModel (pretrain_hybrid.py).  MEGATRON_LM=<checkout>: the checkout's pretrain_gpt.py
# (its megatron/ first on the path; the venv's bin first on PATH: rank 0 compiles the checkout's dataset helpers
# with `python3 -m pybind11`); else bitparity's stand-in on the installed megatron-core (>= 0.17: PY=3.12).
MEGATRON_LM ?=
PRETRAIN_SCRIPT = $(if $(MEGATRON_LM),$(MEGATRON_LM)/pretrain_gpt.py,megatron_trainer/standin/pretrain_gpt.py)
# the migration leg: layout a's blocks as HybridModel's pattern, pretrain_hybrid.py with bitparity's local stack spec
HYBRID_SCRIPT   = $(if $(MEGATRON_LM),$(MEGATRON_LM)/pretrain_hybrid.py,megatron_trainer/standin/pretrain_hybrid.py)
CAPTURE_DIR ?= reports/capture
# where its `bitparity compare` reports go (tests/test_pretrain_capture.py runs the demo into a temporary directory)
CAPTURE_REPORTS ?= reports

.PHONY: lint verify verify-megatron verify-overlap verify-distopt verify-proxy verify-resume verify-hybrid verify-upstream-bugs verify-golden golden verify-long test test-torchrun test-megatron test-portability bench bench-gpu fuzz venv clean capture-demo

# The stamp depends on the manifest and the torch pin, so editing either refreshes the venv.
$(STAMP_RUN): pyproject.toml Makefile
	@test -n "$(PYTHON)" || { echo "make: no Python $(PY) here (pyenv versions / python$(PY) on PATH)" >&2; exit 2; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[megatron]"
	touch $(STAMP_RUN)

$(STAMP): $(STAMP_RUN)
	$(BIN)/python -m pip install --quiet -e ".[test,megatron]"
	touch $(STAMP)

venv: $(STAMP)

verify: $(STAMP_RUN)
	$(BIN)/bitparity verify $(LAYOUTS) $(ARGS)

# PR #2136's validation on the real megatron-core (trainer: megatron-core; the `megatron` extra), on CPU/gloo
verify-megatron: $(STAMP_RUN)
	$(BIN)/bitparity verify cases/megatron-dsv3.yaml $(ARGS)

# PR #2136's 1F1B-overlap check on megatron-core: overlap off / on / on + delayed wgrad, DP=2 EP=2 (4 and 8 ranks),
# fp32 and bf16
verify-overlap: $(STAMP_RUN)
	$(BIN)/bitparity verify cases/megatron-overlap.yaml $(ARGS)
	$(BIN)/bitparity verify cases/megatron-overlap-bf16.yaml $(ARGS)

# the distributed optimizer (ZeRO-1, sharded fingerprints) vs plain DDP at DP=2 and DP=4, its overlaps on vs off
verify-distopt: $(STAMP_RUN)
	$(BIN)/bitparity verify cases/megatron-distopt.yaml $(ARGS)

# Megatron's DeepSeek-V3 proxy configuration at tiny size: TP 2 + SP, P 4 interleaved, EP 2, DP 2, the distributed
# optimizer with both overlaps, MTP (16 rank processes); layouts bitwise at TP 2, TP 1 vs 2 by rounding
verify-proxy: $(STAMP_RUN)
	$(BIN)/bitparity verify cases/megatron-proxy.yaml $(ARGS)

# save after step 0, resume in new processes under the same and other layouts (megatron's dist_checkpointing)
verify-resume: $(STAMP_RUN)
	$(BIN)/bitparity verify cases/megatron-resume.yaml $(ARGS)

# GPTModel -> HybridModel bit for bit (megatron-core >= 0.17: PY=3.12; 0.16.1 lists its hybrid runs as not run)
verify-hybrid: $(STAMP_RUN)
	$(BIN)/bitparity verify cases/megatron-hybrid.yaml $(ARGS)

# megatron-core's own history: upstream bugs caught on the release that had them and passing on the one that
# fixed them (and the open ones caught on every version); run under PY=3.12 too (CI runs both)
verify-upstream-bugs: $(STAMP_RUN)
	$(BIN)/bitparity verify cases/megatron-upstream-bugs.yaml $(ARGS)

# every run of GOLDEN_CASES bitwise equal to its golden (CI)
capture-demo: $(STAMP_RUN)
	@set -e; mkdir -p $(CAPTURE_DIR); args="$$(grep -v '^ *#' cases/pretrain/tiny-moe-mtp.args)"; \
	for run in "layout-a Et|tmL" "layout-b Ett|mL"; do set -- $$run; \
	  echo "== $(PRETRAIN_SCRIPT), layout $$2 -> $(CAPTURE_DIR)/$$1"; \
	  PATH="$(abspath $(BIN)):$$PATH" OMP_NUM_THREADS=1 $(BIN)/python -m torch.distributed.run --standalone --nproc_per_node 2 \
	    -m megatron_trainer.pretrain --bitparity-out $(CAPTURE_DIR)/$$1 --bitparity-init 7 $(PRETRAIN_SCRIPT) \
	    $$args --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout "$$2" > $(CAPTURE_DIR)/$$1.log 2>&1 \
	    || { tail -30 $(CAPTURE_DIR)/$$1.log; exit 1; }; \
	done; \
	$(BIN)/bitparity compare $(CAPTURE_DIR)/layout-a $(CAPTURE_DIR)/layout-b --out $(CAPTURE_REPORTS) --name capture-demo $(ARGS); \
	echo "== resume: layout Ett|mL saves at iteration 2 and exits, a new job loads it under Et|tmL -> $(CAPTURE_DIR)/resumed"; \
	rm -rf $(CAPTURE_DIR)/resumed $(CAPTURE_DIR)/resumed-ckpt; \
	for leg in "Ett|mL --save $(CAPTURE_DIR)/resumed-ckpt --save-interval 2 --exit-interval 2" \
	           "Et|tmL --load $(CAPTURE_DIR)/resumed-ckpt"; do set -- $$leg; layout=$$1; shift; \
	  PATH="$(abspath $(BIN)):$$PATH" OMP_NUM_THREADS=1 $(BIN)/python -m torch.distributed.run --standalone --nproc_per_node 2 \
	    -m megatron_trainer.pretrain --bitparity-out $(CAPTURE_DIR)/resumed --bitparity-init 7 $(PRETRAIN_SCRIPT) \
	    $$args --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout "$$layout" "$$@" \
	    >> $(CAPTURE_DIR)/resumed.log 2>&1 || { tail -30 $(CAPTURE_DIR)/resumed.log; exit 1; }; \
	done; \
	$(BIN)/bitparity compare $(CAPTURE_DIR)/layout-a $(CAPTURE_DIR)/resumed --out $(CAPTURE_REPORTS) --name capture-demo-resume $(ARGS); \
	echo "== migration: $(HYBRID_SCRIPT), hybrid_layer_pattern +E|+E/+E (layout a's blocks) -> $(CAPTURE_DIR)/hybrid"; \
	PATH="$(abspath $(BIN)):$$PATH" OMP_NUM_THREADS=1 $(BIN)/python -m torch.distributed.run --standalone --nproc_per_node 2 \
	  -m megatron_trainer.pretrain --bitparity-out $(CAPTURE_DIR)/hybrid --bitparity-init 7 $(HYBRID_SCRIPT) \
	  $$args --pipeline-model-parallel-size 2 --hybrid-layer-pattern "+E|+E/+E" \
	  --spec megatron_trainer.hybrid_spec hybrid_stack_spec > $(CAPTURE_DIR)/hybrid.log 2>&1 \
	  || { tail -30 $(CAPTURE_DIR)/hybrid.log; exit 1; }; \
	$(BIN)/bitparity compare $(CAPTURE_DIR)/layout-a $(CAPTURE_DIR)/hybrid --out $(CAPTURE_REPORTS) --name capture-demo-migration $(ARGS)

verify-golden: $(STAMP_RUN)
	@set -e; for c in $(GOLDEN_CASES); do \
	  env $(GOLDEN_ENV) $(BIN)/bitparity verify cases/$$c.yaml --train-iters $(GOLDEN_ITERS) --golden goldens/$$c \
	    --out reports/golden $(ARGS); \
	done

# refresh the goldens after an intended change (review the diff of goldens/ before committing it); on another
# CPU family with the same bits it adds that family to each golden.json's checked_on
golden: $(STAMP_RUN)
	@set -e; for c in $(GOLDEN_CASES); do \
	  env $(GOLDEN_ENV) $(BIN)/bitparity verify cases/$$c.yaml --train-iters $(GOLDEN_ITERS) --write-golden goldens/$$c \
	    --out reports/golden $(ARGS); \
	done

# nightly: every dsv3 layout for LONG_ITERS steps (~25 min on 2 cores; ci-examples/nightly-long.yml)
verify-long: $(STAMP_RUN)
	$(BIN)/bitparity verify $(LAYOUTS) --train-iters $(LONG_ITERS) --out reports/long $(ARGS)

# ruff (pyproject [tool.ruff]: pyflakes, import order, the complexity cap), the first thing `make test` does
lint: $(STAMP)
	$(BIN)/ruff check .

# the suite without the megatron-core and torchrun-launch tests (~6 min on an idle 2-core AMD EPYC, 2026-12-06; ~12 under load), after the lint ...
test: $(STAMP) lint
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) -m "not megatron and not torchrun" $(ARGS)

# ... the ranks launched by torchrun instead of the forkserver (~1.5 min) ...
test-torchrun: $(STAMP)
	$(BIN)/python -m pytest -q -m torchrun $(ARGS)

# ... and the megatron-core trainer's (~11 min on 3.11, ~15 on 3.12 on a 2-core AMD EPYC, measured 2026-12-06;
# CI runs all three).  MEGATRON_TESTS=versioned: only the tests whose outcome can depend on the megatron-core
# release (every megatron case run and its stated outcomes, the compat points, the upstream bugs, megatron's own
# behaviours and refusals); the ones marked newest_megatron (a defect planted to show one of bitparity's checks
# catches it, bitparity's own refusals, --megatron-base/--megatron-head) judge bitparity's own code, the same on
# every release: CI runs them on the newest release (PY=3.12) and the versioned subset on 0.16.x (682 -> 234-342 s
# on 2 cores, measured 2026-12-06).  A value other than all (the default) or versioned stops make before the venv.
MEGATRON_TESTS ?= all
ifneq ($(filter test-megatron,$(MAKECMDGOALS)),)
ifneq ($(filter-out all versioned,$(MEGATRON_TESTS))$(word 2,$(MEGATRON_TESTS)),)
$(error MEGATRON_TESTS=$(MEGATRON_TESTS): all (the default) or versioned)
endif
endif
MEGATRON_MARK   = $(if $(filter versioned,$(MEGATRON_TESTS)),megatron and not newest_megatron,megatron)
test-megatron: $(STAMP)
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) -m "$(MEGATRON_MARK)" $(ARGS)

# A setting that is this CPU's own arithmetic (ATEN_CPU_CAPABILITY=avx2 on a CPU without AVX-512) ran in `make test`
# already: skipped, with a line saying so.  Tests marked arithmetic_free (refusals, names, process handling) judge
# no floating-point result and are not run again.
test-portability: $(STAMP)
	@set -e; own="ATEN_CPU_CAPABILITY=$$(env -u ATEN_CPU_CAPABILITY $(BIN)/python -c \
	  'import torch; print(torch.backends.cpu.get_cpu_capability().lower())')"; \
	for setting in $(PORTABILITY_SETTINGS); do \
	  if [ "$$setting" = "$$own" ]; then echo "== arithmetic: $$setting is this CPU's own (make test ran it): skipped"; continue; fi; \
	  echo "== arithmetic: $$setting"; vars=$$(echo "$$setting" | tr , ' '); \
	  env $$vars $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist $(PORTABILITY_DIST) -p no:cacheprovider -m "$(PORTABILITY_MARK)" $(PORTABILITY_TESTS) $(ARGS); \
	  for case in $(PORTABILITY_CASES); do \
	    env $$vars $(BIN)/bitparity verify $$case --out reports/portability/$$setting; \
	  done; \
	done

bench: $(STAMP)
	$(BIN)/python bench/bench_fuzz.py
	$(BIN)/python bench/bench_overlap.py
	$(BIN)/python bench/bench_grouped.py --out bench/results/grouped_cpu.json
	$(BIN)/python bench/bench_ep_channel.py --out bench/results/ep_channel_cpu.json
	$(BIN)/python bench/bench_verify.py $(ARGS)
	$(BIN)/python bench/bench_megatron.py
	$(BIN)/python bench/bench_pretrain_launch.py --out bench/results/pretrain_launch_cpu.json

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
