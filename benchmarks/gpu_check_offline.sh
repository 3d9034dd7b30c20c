#!/usr/bin/env bash
# `make gpu-check` on a GPU machine that has no network and no Rust toolchain (a lent cloud GPU
# box with only the CUDA image's Python): what the check needs is built on this machine by
# `make gpu-bundle`, travels with the checkout, and runs there against that machine's Python.
#
#   here:  make gpu-bundle          # python/multirail/_core.abi3.so, _nixl/, .dev/gpu-tests/
#   there: bash benchmarks/gpu_check_offline.sh OUTDIR [gpu_check.py args, e.g. --quick]
#
# The engine's abi3 extension (Python >= 3.10) runs on that machine's python3, which must have
# numpy and pytest (the CUDA images do); libcudart is found in its site-packages (the cu12 or cu13
# runtime wheels) or the system, as crates/multirail-gpu/src/cuda.rs says. OUTDIR gets the
# report, the machine facts and the whole logs as one tarball.
set -u
out=${1:?usage: gpu_check_offline.sh OUTDIR [gpu_check.py args]}; shift
cd "$(dirname "$0")/.."
mkdir -p "$out"
py=${PYTHON:-$(command -v python3)}
[ -f python/multirail/_core.abi3.so ] || { echo "no python/multirail/_core.abi3.so: run 'make gpu-bundle' first" >&2; exit 3; }
{
  echo "## machine"; uname -a; nproc; free -g | head -2
  echo "## python: $py"; "$py" -V
  "$py" -c 'import numpy, pytest; print("numpy", numpy.__version__, "pytest", pytest.__version__)'
  echo "## nvidia-smi"; nvidia-smi 2>&1 | head -20
  echo "## libcudart candidates"; "$py" -c 'import site,glob; [print(p) for d in site.getsitepackages() for p in glob.glob(d+"/nvidia/*/lib/libcudart.so*")]'
  ldconfig -p | grep -E 'libcudart|libcuda\.so|libibverbs|libucp' || true
  echo "## RDMA"; ls /sys/class/infiniband 2>&1; ls /dev/infiniband 2>&1
  echo "## tools"; for t in ip tc iperf3 ibv_devices ucx_info etcd nvcc; do printf '%s: %s\n' $t "$(command -v $t || echo missing)"; done
  echo "## netns/veth/tbf"; n=mrgc$$; ip netns add $n && ip netns del $n && echo "netns ok"
  ip link add mrgcv$$ type veth peer name mrgcw$$ 2>&1 && ip link del mrgcv$$ && echo "veth ok"
} >"$out/machine-facts.txt" 2>&1
# Every section runs on this machine's python3, with the checkout's python/ (holding the prebuilt
# extension) first on the path.
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" MULTIRAIL_CHECK_PYTHON="$py"
"$py" benchmarks/gpu_check.py --rust-tests .dev/gpu-tests --report "$out/gpu-check-report.md" \
  --logs "$out/logs" "$@"
rc=$?
tar czf "$out/logs.tgz" -C "$out" logs && rm -rf "$out/logs"
exit $rc
