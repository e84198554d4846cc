PYTHON ?= python3

.PHONY: install lint test mutation demo

install:
	$(PYTHON) -m pip install -e ".[test]"

lint: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

test: install
	$(PYTHON) -m pytest

demo:
	$(PYTHON) -m pip install -e ".[demo]"
	$(PYTHON) demo/run_demo.py
