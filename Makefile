# Two entry points do all set-up on a fresh machine: `make verify` and `make test`.
PYTHON  ?= python3
VENV    ?= .venv
TORCH   ?= torch==2.13.0
LAYOUTS ?= cases/dsv3.yaml
ARGS    ?=
BIN      = $(VENV)/bin
STAMP    = $(VENV)/.bitparity-installed

.PHONY: verify test bench venv clean

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
	$(BIN)/python bench/bench_verify.py $(ARGS)

clean:
	rm -rf $(VENV) reports/*/
