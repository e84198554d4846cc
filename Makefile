PYTHON ?= python3

.PHONY: install test

install:
	$(PYTHON) -m pip install -e ".[test]"

test: install
	$(PYTHON) -m pytest
