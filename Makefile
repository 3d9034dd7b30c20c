# Targets say what they do. Everything installs into ./.venv; nothing global but apt packages.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
CARGO_PROFILE ?= release

# System tools the tests and tools use (Debian names). Installed by `make deps` when root.
APT_PKGS := iproute2 iputils-ping procps iperf3 frr mptcpd netplan.io etcd-server g++

.PHONY: deps setup build demo test test-rust test-py test-gpu gpu-check gpu-bundle kernels kernels-check vllm-check lint fuzz clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "maturin>=1.5,<2" "numpy>=1.22" "pyyaml>=6" "pytest>=7" "hypothesis>=6" "libucx-cu12>=1.22,<2" "matplotlib>=3.5" "tqdm>=4.60" "grpcio>=1.60" "nvidia-cuda-runtime-cu12>=12,<13"
	# NIXL itself, for the same-run baselines and to check our NIXL-style scripts against it (no torch)
	$(VPY) -m pip install -q --no-deps "nixl-cu12==1.5.1"

## deps: install the system tools (root + apt); otherwise say which are missing
deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=$$(for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	  if [ -n "$$missing" ]; then echo "installing: $$missing"; \
	    DEBIAN_FRONTEND=noninteractive apt-get update -q && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; fi; \
	else echo "not root or no apt-get: install these yourself for the full test suite: $(APT_PKGS)"; fi

## setup: system tools, .venv, the Rust extension (release) installed into .venv
setup: deps $(VPY) build

## build: rebuild the extension, the NIXL plugin and the mr-pingpong baseline into .venv
build: $(VPY)
	# The NIXL backend plugin (crates/multirail-nixl; needs g++ from `make deps`), placed in the
	# Python package before maturin packs it: `multirail nixl-plugin dir` finds it there.
	cargo build -q --release -p multirail-nixl
	install -D -m 0755 target/release/libmultirail_nixl.so python/multirail/_nixl/libplugin_MULTIRAIL.so
	VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH maturin develop -q --release
	cargo build -q --release -p mr-pingpong

## demo: set up, then run the main job (bench local; over an emulated 2-rail testbed when root)
demo: setup
	$(VENV)/bin/multirail bench local --op READ --start-block-size 4KiB --max-block-size 64MiB --num-iter 20 --check-consistency
	@if [ "$$(id -u)" = 0 ]; then \
	  $(VENV)/bin/multirail testbed up --name mrdemo --rails 2 --rate 2gbit && \
	  $(VENV)/bin/multirail bench local --testbed mrdemo --op READ --start-block-size 64MiB --max-block-size 64MiB --num-iter 10 --check-consistency; \
	  rc=$$?; $(VENV)/bin/multirail testbed down --name mrdemo; exit $$rc; \
	else echo "not root: skipping the emulated multi-rail run (needs network namespaces)"; fi

## test: set up, then run every test (Rust and Python)
test: setup test-rust test-py

test-rust: $(VPY)
	cargo test -q --workspace --exclude multirail-py
	# UCX tests are ignored in a plain `cargo test`; here the .venv's libucx wheel is there: run them
	cargo test -q -p multirail-ucx -- --ignored
	MULTIRAIL_UCX_WHEEL_DIR="$$($(VPY) -c 'import libucx, os; print(os.path.join(os.path.dirname(libucx.__file__), "lib"))')" \
		cargo test -q -p multirail -- --ignored ucx

test-py:
	$(VPY) -m pytest -q tests

## test-gpu: on a machine with a GPU: the CUDA tests (ignored elsewhere) and the gpu-marked Python tests
test-gpu: $(VPY)
	MULTIRAIL_CUDA_WHEEL_DIRS="$${MULTIRAIL_CUDA_WHEEL_DIRS:-$$($(VPY) -c 'import site; print(":".join(site.getsitepackages()))')}" \
	  cargo test -p multirail-gpu -- --ignored
	# tests/test_gpu.py: CUDA memory staged over loopback tcp (DeviceBuffer, torch if installed)
	$(VPY) -m pytest -q -rs -m gpu tests

## gpu-check: on a GPU machine (as root for the 2-rail testbed): the CUDA tests, the GPU
## benchmarks, bench kv with VRAM, ibv_devices and the UCX transports, into gpu-check-report.md;
## exits non-zero on any failure (2: no usable GPU, said at the top of the report)
gpu-check: setup
	$(VPY) benchmarks/gpu_check.py --report gpu-check-report.md $(GPU_CHECK_ARGS)

## gpu-bundle: build here what benchmarks/gpu_check_offline.sh needs on a GPU machine without
## network or Rust (the extension in python/multirail/, the multirail-gpu test binaries in .dev/)
gpu-bundle: build
	rm -rf .dev/gpu-tests && mkdir -p .dev/gpu-tests
	cargo test -q --release -p multirail-gpu --test gpu --no-run --message-format=json 2>/dev/null \
	  | $(VPY) -c 'import json,sys; [print(m["executable"]) for m in map(json.loads, sys.stdin) if m.get("executable")]' \
	  | xargs -I{} install -m 0755 {} .dev/gpu-tests/gpu
	strip .dev/gpu-tests/gpu

## kernels: rebuild crates/multirail-gpu/kernels/gather.fatbin (SASS sm_80/90/100/120 + the PTX of
## gather.rs) with ptxas/fatbinary from pinned nvidia wheels (downloaded by pip; docs/gpu.md)
kernels:
	$(PY) crates/multirail-gpu/kernels/build.py

## kernels-check: the checked-in fatbin is byte for byte what `make kernels` makes
kernels-check:
	$(PY) crates/multirail-gpu/kernels/build.py --check

## vllm-check: (root) vLLM's CPU build, prefill and decode in two testbed namespaces over 2 x 2 Gbit/s
## rails through NixlConnector with backends ["MULTIRAIL"] and only NIXL_PLUGIN_DIR set: outputs
## equal a single instance's, KV on both rails, no request lost to a rail fault (tests/vllm/check.py).
## vLLM goes into its own venv, $(VLLM_VENV) (6.7 GB), never into .venv
VLLM_VENV := .venv-vllm
vllm-check: build
	$(PY) tests/vllm/install.py --venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python tests/vllm/check.py $(VLLM_CHECK_ARGS)

## lint: formatting and clippy with warnings as errors
lint:
	cargo fmt --all -- --check
	cargo clippy -q --workspace --all-targets -- -D warnings

## fuzz: run each cargo-fuzz target for FUZZ_SECONDS (default 60)
fuzz:
	bash fuzz/run.sh $${FUZZ_SECONDS:-60}

clean:
	rm -rf $(VENV) target
