# The two set-up commands of the README, and a few helpers. Each target creates .venv and installs
# what it needs on first use, so a fresh clone needs nothing but Python 3.11.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
HOST    ?= 127.0.0.1
PORT    ?= 8000
EXECUTOR ?= sim
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/gradient
TEST_REDIS_URL    ?= redis://127.0.0.1:6379/0

.PHONY: run test check lint typecheck pytest migrate demo clean

# The service alone (run, migrate, demo): no test or lint tools.
$(RUN_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	touch $(RUN_STAMP)

# With the dev extras (check, test): the tests, ruff, mypy, import-linter, Playwright.
$(STAMP): pyproject.toml $(RUN_STAMP)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

## run: the service with whatever DATABASE_URL / REDIS_URL say (embedded SQLite and in-process passes by default)
run: $(RUN_STAMP)
	$(BIN)/python manage.py migrate --noinput
	$(BIN)/python manage.py serve --host $(HOST) --port $(PORT)

migrate: $(RUN_STAMP)
	$(BIN)/python manage.py migrate --noinput

## test: lint (ruff, and the layer contracts of docs/architecture.md), type check, then the whole suite
test: check pytest

check: lint typecheck

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check gradient tests bench
	$(BIN)/lint-imports --no-logo

typecheck: $(STAMP)
	$(BIN)/mypy gradient

pytest: $(STAMP)
	DATABASE_URL=$${DATABASE_URL:-$(TEST_DATABASE_URL)} REDIS_URL=$${REDIS_URL-$(TEST_REDIS_URL)} \
	  $(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) var/*.sqlite3

## demo: the service, three workers and sample evaluations (http://127.0.0.1:8000/admin/, admin/admin);
## EXECUTOR=nix runs the local Nix on examples/flakes instead of simulated graphs; PORT=9000 listens there
demo: $(RUN_STAMP)
	$(BIN)/python manage.py migrate --noinput
	$(BIN)/python manage.py demo --port $(PORT) --executor $(EXECUTOR)
