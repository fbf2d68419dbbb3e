.PHONY: setup demo test lint
setup:
	@bash tools/setup.sh

demo: setup
	.venv/bin/vatspec demo

test: setup
	.venv/bin/python -m pytest -q

lint: setup
	.venv/bin/ruff check .
