# Two commands on a fresh machine with Python 3.11 and pip: `make run` and `make test`.
# torch==2.13.0 goes in first, pinned: pip's find-links here (/opt/wheels) hold its CPU build. From
# plain PyPI on Linux that pin is the multi-GB CUDA build; on a CPU-only machine elsewhere install
# it into .venv first with `pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu`
# (see README): the line below then finds it installed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test test-fast clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

## Install, then run the embedded default (configs/tiny.yaml) end to end on this machine.
run: install
	$(BIN)/tandem run configs/tiny.yaml

## Install, then run the whole test suite (real SeaweedFS and engines on loopback): two pytest
## workers side by side, each taking whole files (a file's servers start once), since most of
## the suite waits on servers rather than computing, longest files first (tests/conftest.py);
## then, alone, the tests that assert timings.
test: install
	$(BIN)/pytest -n 2 --dist loadfile --no-loadscope-reorder -m "not timing" --durations=15; shared=$$?; \
	$(BIN)/pytest -m timing; alone=$$?; \
	for code in $$shared $$alone; do [ $$code -ne 5 ] || echo "pytest collected no tests: failing" >&2; done; \
	[ $$shared -eq 0 ] && [ $$alone -eq 0 ]

## The tests that start no server.
test-fast: install
	$(BIN)/pytest -m "not s3 and not slow and not deployed and not browser"

clean:
	rm -rf $(VENV) runs .pytest_cache
