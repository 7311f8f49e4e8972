# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
APT_PACKAGES := fonts-noto-color-emoji dataset-fashion-mnist chromium nginx
DEMO_DIR ?= artifacts/demo

.PHONY: install test lint demo serve clean system-deps docs

install: $(STAMP)

# The versions are constraints.txt's, the one set the suite runs with (a change to it or to pyproject re-installs;
# tests/project/test_installed_versions.py checks .venv against it, and its header says how to refresh it).
$(STAMP): pyproject.toml constraints.txt
	$(MAKE) system-deps
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip -c constraints.txt
	$(BIN)/python -m pip install --quiet -e ".[train,dev,ray,track,milvus]" -c constraints.txt
	touch $(STAMP)

# Debian packages: real offline data (the Noto emoji font, Fashion-MNIST), chromium for the browser test and
# nginx for the deployment (deploy/nginx.conf) and its test; nginx is installed, not started.
system-deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then echo "system packages present:$(APT_PACKAGES)"; \
	elif [ "$$(id -u)" = "0" ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	else echo "Not root: install the data packages with: sudo apt-get install -y$$missing"; fi

# two processes, each taking whole test files (fixtures stay within their file), then the latency tests by themselves:
# docs/BENCHMARKS.md, "Test suite"
test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not alone"
	$(BIN)/python -m pytest -q -m alone

lint: install
	$(BIN)/ruff check .

# Builds the emoji data, trains, evaluates, exports ONNX, indexes the test gallery, then serves the app.
demo: install
	$(BIN)/retrieval demo --out $(DEMO_DIR)

# The app on the artifacts `make demo` built (http://127.0.0.1:7860).
serve: install
	$(BIN)/python app.py

clean:
	rm -rf $(VENV) artifacts runs .pytest_cache

# The options tables in docs/, made from the configs' declarations (cli/doc_tables.py; a test checks them).
docs: install
	$(BIN)/python -m retrieval.cli.doc_tables .
	$(BIN)/python benchmarks/render_tables.py
