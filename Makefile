# Everything a fresh machine needs, from a fresh clone: `make demo` and `make test` (type check, then tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch (a plain `torch` requirement pulls a multi-GB CUDA build).
# GPU users: `make install TORCH_SPEC=torch` or install their own torch into the venv first.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test bench bench-paper clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[torch,examples,test,jax]"
	# Compile the summation kernels into numba's cache now (18 CPU-s), not in every daemon's first start.
	$(PY) -c "from bps_runtime import kernels; kernels.warm_up()"
	touch $@

# Authenticated: bps-launch makes configs/local.toml's token (~/.config/bps/token, mode 600) on the first run.
demo: install
	$(BYTECODE)
	$(VENV)/bin/bps-launch --config configs/local.toml -- $(PY) examples/train_digits.py

# Our packages' bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (as in many CI images) every daemon
# and rank the tests start would otherwise compile them again (0.2 CPU-s a start, and the suite starts ~800).
BYTECODE := $(PY) -m compileall -q bps_runtime bps_server bps_worker protocol

# Test files side by side where there are 2 cores or more (one per two cores, at least 3; tests/conftest.py).
test: install
	$(BYTECODE)
	$(PY) -m mypy
	$(PY) -m pytest -n auto --dist loadfile

bench: install
	$(PY) benchmarks/push_pull_vs_gloo.py

# The paper's experiment on emulated machines (network namespaces + tc; root only): table, RESULTS.md, PNG.
bench-paper: install
	$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install --quiet -e ".[bench]"
	$(PY) benchmarks/paper_vs_allreduce.py --write-results

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
	find . -name __pycache__ -not -path './$(VENV)/*' -prune -exec rm -rf {} +
