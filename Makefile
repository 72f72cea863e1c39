# Quick start: `make serve` and `make test`. Both bootstrap .venv on first use.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_VERSION ?= 2.13.0
ARGS ?=

.PHONY: serve test venv test-deps clean

# torch goes in first and pinned: an unpinned torch (pulled by a dependency) would fetch a multi-GB CUDA build.
$(VENV)/.torch:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found (openk3 needs Python 3.11)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==$(TORCH_VERSION)
	touch $@

$(VENV)/.installed: $(VENV)/.torch pyproject.toml
	$(PIP) install --quiet -e .
	touch $@

$(VENV)/.test-installed: $(VENV)/.installed pyproject.toml
	$(PIP) install --quiet -e ".[test]"
	touch $@

venv: $(VENV)/.installed

test-deps: $(VENV)/.test-installed

serve: $(VENV)/.installed
	$(VENV)/bin/openk3 serve $(ARGS)

# One OpenMP thread: the suite runs many tiny-model forwards whose ops are far below the size
# where a second thread pays off (and a busy machine makes thread hand-offs very slow).
test: $(VENV)/.test-installed
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -p no:cacheprovider $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
