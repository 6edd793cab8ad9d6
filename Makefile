# The two commands: `make up` runs the platform (embedded mode), `make test` runs the whole suite.
# Both install what is missing first; every step is idempotent.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.gpupool-installed
PYTEST_ARGS ?=

.PHONY: up test install system-packages clean

$(STAMP): setup.cfg pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $@

install: $(STAMP) system-packages node_modules/.bin/configurable-http-proxy

# JupyterHub's proxy, from the npm registry into the repository (package.json pins the range).
node_modules/.bin/configurable-http-proxy: package.json
	npm install --no-audit --no-fund --silent
	@touch $@

# Debian packages the platform and the tests use (PostgreSQL for the production database tests,
# Node.js for configurable-http-proxy, git for the dataset registries, acl for the team folders' default ACLs,
# headless Chromium and its driver for the browser tests). Installed only when missing, and only when we can.
system-packages:
	@missing=""; \
	command -v initdb >/dev/null || test -x /usr/lib/postgresql/15/bin/initdb || missing="$$missing postgresql"; \
	command -v npm >/dev/null || missing="$$missing nodejs npm"; \
	command -v git >/dev/null || missing="$$missing git"; \
	command -v setfacl >/dev/null || missing="$$missing acl"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null || missing="$$missing chromium-driver"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing:$$missing"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else echo "missing system packages:$$missing (install them, e.g. apt-get install$$missing)"; fi; \
	fi

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# UP_ARGS go to `gpupool up`, e.g. make up UP_ARGS="--port 9000 --policies policies/examples"
UP_ARGS ?=
up: install
	$(BIN)/gpupool up $(UP_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info
