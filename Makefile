# The two commands of README: `make demo` (set-up + the main job) and `make test` (set-up + the tests).
.PHONY: setup demo test lint bench

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/verl-p2p demo

test: setup
	.venv/bin/python -m ruff check .
	.venv/bin/python -m ruff format --check .
	.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder --durations=25

bench: setup
	.venv/bin/verl-p2p bench
