# Quick start: `make serve` and `make test`. Both bootstrap .venv on first use.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_VERSION ?= 2.13.0
# auto: the CUDA build when an NVIDIA GPU is visible, else the CPU build (scripts/torch_variant.py)
TORCH_VARIANT ?= auto
ARGS ?=

.PHONY: serve test venv test-deps torch-plan clean

# torch goes in first, pinned, in the variant chosen for this machine: PyPI's Linux torch wheel is
# the CUDA build (several GB of nvidia-* packages), which a machine without a GPU does not need.
$(VENV)/.torch:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found (openk3 needs Python 3.11)"; exit 1; }
	@extra=$$($(PYTHON) scripts/torch_variant.py --variant "$(TORCH_VARIANT)" --pip-args) || exit 1; \
	set -x; $(PYTHON) -m venv $(VENV) && \
	$(PIP) install --quiet --upgrade pip && \
	$(PIP) install --quiet torch==$(TORCH_VERSION) $$extra
	@$(PY) -W ignore -c "import torch; print('torch', torch.__version__, 'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU build')"
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

# What the bootstrap would install here, without installing anything.
torch-plan:
	@$(PYTHON) scripts/torch_variant.py --variant "$(TORCH_VARIANT)" --torch-version $(TORCH_VERSION)

clean:
	rm -rf $(VENV) build *.egg-info
