PYTHON ?= python3

.PHONY: install test demo

install:
	$(PYTHON) -m pip install -e ".[test]"

test: install
	$(PYTHON) -m pytest

demo:
	$(PYTHON) -m pip install -e ".[demo]"
	$(PYTHON) demo/run_demo.py
