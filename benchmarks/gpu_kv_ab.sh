#!/usr/bin/env bash
# `bench kv` with VRAM on both sides, this checkout's build against another build of multirail,
# interleaved on one GPU machine (fresh processes; the first run of each case byte-checked):
# staged with 8 and 64 KiB pages (--gpu-ipc off) and by CUDA IPC (--gpu-ipc on).
#
#   bash benchmarks/gpu_kv_ab.sh OUTDIR BASE_PYTHON_DIR [ROUNDS]
#
# BASE_PYTHON_DIR is the other build's python/ directory, its _core.abi3.so inside (build it in a
# worktree of that commit: `cargo build --release -p multirail-py`, then copy target/release/
# lib_core.so to python/multirail/_core.abi3.so). OUTDIR gets summary.txt (the rows of every run)
# and the whole outputs as one tarball. GPU=standin runs it without a GPU (a smoke test).
# docs/benchmarks.md, "GPU on an H100", has a run of it.
set -u
out=${1:?usage: gpu_kv_ab.sh OUTDIR BASE_PYTHON_DIR [ROUNDS]}
base=${2:?usage: gpu_kv_ab.sh OUTDIR BASE_PYTHON_DIR [ROUNDS]}
rounds=${3:-3}
cd "$(dirname "$0")/.."
new=$PWD/python
[ -f "$base/multirail/_core.abi3.so" ] || { echo "no $base/multirail/_core.abi3.so" >&2; exit 3; }
mkdir -p "$out"
logs=$(mktemp -d)
sum=$out/summary.txt
: >"$sum"
export PYTHONUNBUFFERED=1
kv=(-m multirail bench kv --model llama-3.1-8b --isl 4096 --requests 5 --initiator-seg-type VRAM
    --target-seg-type VRAM --gpu "${GPU:-cuda}" --timeout 60 --no-nixl)
run() {
  local name=$1 pp=$2; shift 2
  PYTHONPATH=$pp timeout 120 "${PYTHON:-python3}" "${kv[@]}" "$@" >"$logs/$name.txt" 2>&1
  echo "== $name rc=$?" >>"$sum"
  grep -E "multirail kv |multirail contig|kv / contig|rror" "$logs/$name.txt" | head -5 >>"$sum"
}
for i in $(seq 1 "$rounds"); do
  chk=(); [ "$i" = 1 ] && chk=(--check-consistency)
  for b in new base; do
    pp=$new; [ "$b" = base ] && pp=$base
    run "staged8k-$b-$i" "$pp" --gpu-ipc off --tp 8 "${chk[@]}"
    run "staged-$b-$i" "$pp" --gpu-ipc off "${chk[@]}"
    run "ipc-$b-$i" "$pp" --gpu-ipc on "${chk[@]}"
    run "ipc8k-$b-$i" "$pp" --gpu-ipc on --tp 8 "${chk[@]}"
  done
done
cat "$sum"
tar czf "$out/logs.tgz" -C "$logs" . && rm -rf "$logs"
