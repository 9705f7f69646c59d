# Two commands for a fresh machine:
#   make demo   replays the built-in synthetic workload through the real stack
#   make test   installs everything (virtualenv, torch==2.13.0 first) and runs ruff, mypy, pytest
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: demo test lint typecheck unit docs install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: a bare requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[all,dev,gpu]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tiering replay

lint: $(STAMP)
	$(VENV)/bin/ruff check tiering tiers tests benchmarks
	$(VENV)/bin/ruff format --check tiering tiers tests benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest -q

# The documentation site, into the git-ignored site/; --strict fails on a broken link or
# anchor, a page missing from mkdocs.yml's nav, or a nav entry without a page.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

test: docs lint typecheck unit

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
