PYTHON ?= python3

.PHONY: install lint test mutation demo

install:
	$(PYTHON) -m pip install -e ".[test]"

lint: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

test: install
	$(PYTHON) -m pytest

# every OAI detail broken on purpose, one at a time, in a copy of the project: its tests must fail (tools/mutation_check.py)
mutation: install
	$(PYTHON) tools/mutation_check.py $(MUTATION_FLAGS)

demo:
	$(PYTHON) -m pip install -e ".[demo]"
	$(PYTHON) demo/run_demo.py
