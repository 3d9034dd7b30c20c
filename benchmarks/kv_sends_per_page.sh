#!/bin/bash
# Send syscalls per page of `multirail bench kv` (issue 22, docs/benchmarks.md "Issue 22: kv over
# ucx (session 9)"). Root; needs perf and a testbed that is up (`multirail testbed up --name T`).
#
#   benchmarks/kv_sends_per_page.sh TESTBED OUT [extra bench kv args, e.g. --page-tokens 8]
#
# Starts `bench kv --transport ucx --requests 40`, waits for its kv phase, then for 5 s counts the
# sendto/sendmsg/writev/recvfrom/recvmsg/readv syscalls and task-clock of the bench's processes
# (perf stat attached by PID) and the bytes the initiator's rails sent (namespace TESTBED-b);
# prints syscalls per page = count / (bytes / page size). A count: it does not depend on the host
# load the way a rate does. The bench's own output is in OUT.log, its JSON in OUT.json.
set -eu
tb=$1; out=$2; shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
"$here/.venv/bin/multirail" bench kv --testbed "$tb" --model llama-3.1-70b --tp 8 --isl 4096 --requests 40 \
    --no-nixl --transport ucx --json "$out.json" "$@" > "$out.log" 2>&1 &
bp=$!
for _ in $(seq 1 400); do grep -q " kv$" "$out.log" && break; sleep 0.3; done
sleep 1
desc() { local p; for p in $(pgrep -P "$1"); do echo "$p"; desc "$p"; done; }
pids=$(desc $bp | paste -sd,)
devs=$(ip netns exec "$tb-b" ls /sys/class/net | grep "^$tb" || true)
rb() { local s=0 d; for d in $devs; do s=$((s + $(ip netns exec "$tb-b" cat /sys/class/net/$d/statistics/tx_bytes))); done; echo $s; }
b0=$(rb)
perf stat -x, -e task-clock,syscalls:sys_enter_sendto,syscalls:sys_enter_sendmsg,syscalls:sys_enter_writev,syscalls:sys_enter_recvfrom,syscalls:sys_enter_recvmsg,syscalls:sys_enter_readv \
    -p "$pids" -o "$out.stat" -- sleep 5 > /dev/null 2>&1
b1=$(rb)
wait $bp || true
python3 - "$out.stat" "$b0" "$b1" "$out.json" <<'PY'
import json, sys
st, b0, b1, js = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
v = {}
for line in open(st):
    p = line.strip().split(",")
    if len(p) > 2 and p[0] and p[0][0].isdigit():
        v[p[2].split(":")[-1]] = float(p[0])
try:
    d = json.load(open(js))
    page, ratio = d["kv"]["page_bytes"], d.get("ratio_to_contiguous")
except (OSError, ValueError, KeyError):
    sys.exit("the bench did not finish (see the .log): no page size / ratio")
pages = (b1 - b0) / page
sends = sum(v.get(k, 0) for k in ("sys_enter_sendto", "sys_enter_sendmsg", "sys_enter_writev"))
recvs = sum(v.get(k, 0) for k in ("sys_enter_recvfrom", "sys_enter_recvmsg", "sys_enter_readv"))
print(f"page {page} B: sends/page {sends / pages:.2f}, recvs/page {recvs / pages:.2f}, "
      f"CPU ms/MB {v.get('task-clock', 0) / ((b1 - b0) / 1e6):.2f}, kv/contiguous {ratio}")
PY
