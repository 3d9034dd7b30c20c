"""Prometheus metrics of multirail agents (issue #11).

`AgentCollector` is a custom prometheus_client collector: every scrape reads the engine's
counters right then (initiator side: `Agent.rail_stats(peer)`, `peer_counters(peer)`; serving
side: `served_stats()`, `refused_requests()`) and the Python-side tallies (transfers per peer,
registered memory). Nothing polls in the background.

Two ways to serve it:

* ``Agent(name, {"metrics_port": N, "metrics_host": "127.0.0.1"})``: that agent, on
  http://127.0.0.1:N/metrics (N = 0: any free port, see `Agent.metrics_url`);
* `serve(port, host)`: every agent of the process (what ``multirail bench --metrics-port``
  uses), plus the standard process metrics.

docs/metrics.md lists every metric and says where each number comes from.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Iterable, Iterator

from multirail.errors import AddressInUseError, InvalidArgumentError, MultirailError

__all__ = ["AgentCollector", "MetricsServer", "serve", "serve_agent"]


def _live_agents() -> list[Any]:
    from multirail import agent as agent_mod  # the engine: imported only when scraped

    return [a for a in list(agent_mod._LIVE) if not getattr(a, "_closed", False)]


class AgentCollector:
    """Reads multirail agents at scrape time. `agents`: one Agent, or a callable returning the
    agents to report (default: every open agent of this process)."""

    def __init__(self, agents: Any = None) -> None:
        if agents is None:
            self._agents: Callable[[], Iterable[Any]] = _live_agents
        elif callable(agents) and not hasattr(agents, "rail_stats"):
            self._agents = agents
        else:
            ref = weakref.ref(agents)  # the server must not keep the agent alive

            def one() -> list[Any]:
                a = ref()
                return [] if a is None or getattr(a, "_closed", False) else [a]
            self._agents = one

    def describe(self) -> list[Any]:
        return []  # names are dynamic; skip the registry's duplicate check (and a scrape at registration)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        rail = ["agent", "peer", "rail"]
        served = ["agent", "peer", "rail", "index"]  # index: the local rail's, "side" for the side channel
        fam = {
            "bytes": CounterMetricFamily(
                "multirail_rail_bytes", "Payload bytes this agent's transfers moved on the rail, by direction "
                "(read: READ payloads landed here; write: WRITE payloads the peer acknowledged)",
                labels=rail + ["direction"]),
            "chunks": CounterMetricFamily(
                "multirail_rail_chunks", "Chunks completed on the rail, by direction", labels=rail + ["direction"]),
            "reissued": CounterMetricFamily(
                "multirail_rail_chunks_reissued", "Chunks of this rail requeued to other rails after it failed", labels=rail),
            "down": CounterMetricFamily("multirail_rail_down", "Times the rail was declared down (failures)", labels=rail),
            "readmit": CounterMetricFamily(
                "multirail_rail_readmissions", "Times the rail was readmitted after being down", labels=rail),
            "stalls": CounterMetricFamily(
                "multirail_rail_stalls", "Connections of the rail declared stalled (no byte within stall_timeout "
                "while requests were outstanding)", labels=rail),
            "up": GaugeMetricFamily("multirail_rail_up", "1 while the rail carries chunks, 0 while it is down", labels=rail),
            "rate": GaugeMetricFamily(
                "multirail_rail_rate_bytes_per_second", "Delivery rate the planner measured for the rail", labels=rail),
            "weight": GaugeMetricFamily(
                "multirail_rail_weight", "The rail's share of the measured rate of the peer's up rails (what the "
                "weighted policy stripes by; 0 when down)", labels=rail),
            "conns": GaugeMetricFamily("multirail_rail_connections", "Open TCP connections on the rail", labels=rail),
            "tier": GaugeMetricFamily(
                "multirail_rail_tier", "The tier (0: nearest) the rail last served a transfer's memory location as "
                "(AgentConfig.affinity, docs/topology.md), with that location and the tier's class (PIX ... SYS)",
                labels=rail + ["location", "class"]),
            "fallback": CounterMetricFamily(
                "multirail_rail_fallback_bytes", "Bytes the rail carried as a farther tier, while every nearer rail "
                "of the transfer's memory location was down", labels=rail),
            "info": GaugeMetricFamily(
                "multirail_rail_info", "Rail identity (value 1)", labels=rail + ["index", "local_addr", "remote_addr"]),
            "transport": GaugeMetricFamily(
                "multirail_rail_transport", "What carries the rail now (value 1): transport (tcp, ucx/rc_mlx5, "
                "ucx/tcp, ...) and reason (auto: no RDMA device, explicit, fallback after N ucx failures, ...)",
                labels=rail + ["transport", "reason"]),
            "fallbacks": CounterMetricFamily(
                "multirail_rail_transport_fallbacks", "Times the rail fell back from ucx to tcp (its ucx path kept "
                "failing while its IP path worked), on the current link", labels=rail),
            "switches": CounterMetricFamily(
                "multirail_rail_transport_switches", "Changes of the rail's transport (fallbacks to tcp and retries "
                "of ucx after a cool-down), on the current link", labels=rail),
            "retry": GaugeMetricFamily(
                "multirail_rail_ucx_retry_seconds", "Seconds until a fallen-back rail tries ucx again (-1: no retry "
                "pending)", labels=rail),
            "xfers": CounterMetricFamily(
                "multirail_peer_transfers", "Transfers this agent posted to the peer, by outcome (counted when the "
                "outcome is seen: wait, transfer_sync, check_xfer_state, xfer_error, re-post or release)",
                labels=["agent", "peer", "op", "outcome"]),
            "xbytes": CounterMetricFamily(
                "multirail_peer_transfer_bytes", "Bytes of completed transfers with the peer by direction (read: "
                "into this agent, write: out of it)", labels=["agent", "peer", "direction"]),
            "fences": CounterMetricFamily(
                "multirail_peer_fenced_connections", "Dead connections of this agent that the peer confirmed "
                "fenced before their WRITEs were reissued", labels=["agent", "peer"]),
            "fenced_by": CounterMetricFamily(
                "multirail_fenced_connections", "Inbound connections the peer's Fence aborted here (serving side)",
                labels=["agent", "peer"]),
            # serving side: what peers read from / wrote into this agent, per local rail
            "s_bytes": CounterMetricFamily(
                "multirail_served_bytes", "Payload bytes this agent served to the peer on the local rail, by direction "
                "(read: READ data sent out of this agent's memory; write: WRITE data landed in it)",
                labels=served + ["direction"]),
            "s_reqs": CounterMetricFamily(
                "multirail_served_requests", "READ/WRITE requests this agent served to the peer on the local rail, by "
                "direction", labels=served + ["direction"]),
            "s_refused": CounterMetricFamily(
                "multirail_served_refused", "Requests of the peer this agent refused on the local rail, by status "
                "(peer _unauthenticated: before the handshake completed)", labels=served + ["status"]),
            "s_conns": CounterMetricFamily(
                "multirail_served_connections", "Connections from the peer this agent accepted on the local rail "
                "(handshake completed; UCX sessions included)", labels=served),
            "s_ucx": CounterMetricFamily(
                "multirail_served_ucx_sessions", "UCX sessions the peer opened on the local rail (their one-sided "
                "bytes are not counted here)", labels=served),
            # GPU memory (docs/gpu.md): staging per rail (initiator side) and per served rail
            "stage_bytes": CounterMetricFamily(
                "multirail_rail_staged_bytes", "GPU memory this agent staged on the rail, by stage (d2h: copied out "
                "of its GPU memory to send; h2d: received into it; wire: bounce buffers sent or received)",
                labels=rail + ["stage"]),
            "stage_busy": CounterMetricFamily(
                "multirail_rail_staging_busy_seconds", "Time the rail's staging pipelines spent in each stage (all "
                "connections added up)", labels=rail + ["stage"]),
            "stage_pool": GaugeMetricFamily(
                "multirail_rail_staging_pool_bytes", "Pinned bounce memory held by the rail's connections",
                labels=rail),
            "s_stage_bytes": CounterMetricFamily(
                "multirail_served_staged_bytes", "GPU memory this agent staged serving the peer on the local rail, "
                "by stage (d2h: READs of its GPU memory; h2d: WRITEs landed in it)", labels=served + ["stage"]),
            "ipc_bytes": CounterMetricFamily(
                "multirail_peer_ipc_bytes", "Bytes moved to or from the peer's GPU memory by CUDA IPC (same host: "
                "device copies, no rail)", labels=["agent", "peer"]),
            "stale": GaugeMetricFamily(
                "multirail_peer_stale", "1 while the metadata store holds a newer incarnation of the peer than the "
                "one loaded (transfers refused until it is fetched again)", labels=["agent", "peer"]),
            "reg_bytes": GaugeMetricFamily(
                "multirail_registered_bytes", "Bytes of memory registered with the agent", labels=["agent", "mem_type"]),
            "reg_regions": GaugeMetricFamily("multirail_registered_regions", "Registered regions", labels=["agent"]),
            "refused": CounterMetricFamily(
                "multirail_refused_requests", "Requests from peers this agent refused (bad frame, key, bounds, access)",
                labels=["agent"]),
            "agent": GaugeMetricFamily(
                "multirail_agent_info", "Agent identity (value 1)", labels=["agent", "incarnation", "host", "port"]),
            "store_up": GaugeMetricFamily(
                "multirail_metadata_store_up", "1 while the agent's metadata store (etcd) answers its keep-alives",
                labels=["agent"]),
            "grants": CounterMetricFamily(
                "multirail_metadata_lease_grants", "etcd leases granted for the agent's record (more than 1: the "
                "lease was lost and the record published again)", labels=["agent"]),
        }
        for a in list(self._agents()):
            try:
                self._one(a, fam)
            except MultirailError:
                continue  # closed under us
        yield from fam.values()

    @staticmethod
    def _served(a: Any, fam: dict[str, Any]) -> None:
        """The serving side (engine `served_stats()`): one row per (peer, local rail)."""
        name = a.name
        fenced: dict[str, int] = {}
        for r in a.served_stats():
            idx = r.get("rail_index")
            lab = [name, str(r["peer"]), str(r["rail"]), "side" if idx is None else str(idx)]
            for direction, key in (("read", "read"), ("write", "written")):
                fam["s_bytes"].add_metric(lab + [direction], int(r.get(f"bytes_{key}", 0)))
                fam["s_reqs"].add_metric(lab + [direction], int(r.get(f"requests_{key}", 0)))
            for status, n in sorted((r.get("refused_by_status") or {}).items()):
                fam["s_refused"].add_metric(lab + [str(status)], int(n))
            fam["s_conns"].add_metric(lab, int(r.get("connections", 0)))
            fam["s_ucx"].add_metric(lab, int(r.get("ucx_sessions", 0)))
            for stage, st in _stages(r):
                fam["s_stage_bytes"].add_metric(lab + [stage], int(st.get("bytes", 0)))
            fenced[str(r["peer"])] = fenced.get(str(r["peer"]), 0) + int(r.get("fenced", 0))
        for peer, n in fenced.items():
            fam["fenced_by"].add_metric([name, peer], n)

    def _one(self, a: Any, fam: dict[str, Any]) -> None:
        name = a.name
        fam["agent"].add_metric([name, f"{a.incarnation:016x}", str(a.host), str(a.port)], 1)
        fam["refused"].add_metric([name], a.refused_requests())
        self._served(a, fam)
        # registered memory (the Python registration table: one RegDescs per register call)
        by_mem: dict[str, int] = {}
        regions = 0
        seen: set[int] = set()
        for reg in list(a._regs.values()):
            if id(reg) in seen:
                continue
            seen.add(id(reg))
            by_mem[reg.mem_type] = by_mem.get(reg.mem_type, 0) + reg.total_bytes
            regions += len(reg.region_ids)
        for mem in by_mem or {"DRAM": 0}:
            fam["reg_bytes"].add_metric([name, mem], by_mem.get(mem, 0))
        fam["reg_regions"].add_metric([name], regions)
        # per peer: transfers (Python tallies)
        for (peer, op), (done, failed, nbytes) in list(a._xstats.items()):
            fam["xfers"].add_metric([name, peer, op.lower(), "done"], done)
            fam["xfers"].add_metric([name, peer, op.lower(), "failed"], failed)
            fam["xbytes"].add_metric([name, peer, op.lower()], nbytes)
        stale = dict(a._stale)
        # per rail of each peer (engine counters)
        for peer in list(a._peers):
            fam["stale"].add_metric([name, peer], 1 if peer in stale else 0)
            try:
                stats = a.rail_stats(peer)
                pc = a.peer_counters(peer)
                fam["fences"].add_metric([name, peer], int(pc["fenced_connections"]))
                fam["ipc_bytes"].add_metric([name, peer], int(pc.get("ipc_bytes", 0)))
            except MultirailError:
                continue  # forgotten, or no link yet
            total_up = sum(float(s.get("rate_gbps", 0.0)) for s in stats if s.get("up"))
            for i, s in enumerate(stats):
                lab = [name, peer, str(s.get("name") or i)]
                up = bool(s.get("up"))
                rate = float(s.get("rate_gbps", 0.0)) * 1e9 / 8
                for direction, key in (("read", "read"), ("write", "written")):
                    fam["bytes"].add_metric(lab + [direction], int(s.get(f"bytes_{key}", 0)))
                    fam["chunks"].add_metric(lab + [direction], int(s.get(f"chunks_{key}", 0)))
                fam["reissued"].add_metric(lab, int(s.get("reissued", 0)))
                fam["down"].add_metric(lab, int(s.get("times_down", 0)))
                fam["readmit"].add_metric(lab, int(s.get("readmissions", 0)))
                fam["stalls"].add_metric(lab, int(s.get("stalls", 0)))
                fam["up"].add_metric(lab, 1 if up else 0)
                fam["rate"].add_metric(lab, rate)
                fam["weight"].add_metric(lab, (float(s.get("rate_gbps", 0.0)) / total_up) if up and total_up > 0 else 0.0)
                fam["conns"].add_metric(lab, int(s.get("connections", 0)))
                if s.get("tier") is not None:
                    fam["tier"].add_metric(lab + [str(s.get("tier_location") or ""), str(s.get("tier_class") or "")],
                                           int(s["tier"]))
                fam["fallback"].add_metric(lab, int(s.get("fallback_bytes") or 0))
                fam["info"].add_metric(lab + [str(i), str(s.get("local_addr", "")), str(s.get("remote_addr", ""))], 1)
                fam["transport"].add_metric(lab + [str(s.get("transport", "")), str(s.get("transport_reason", ""))], 1)
                fam["fallbacks"].add_metric(lab, int(s.get("fallbacks") or 0))
                fam["switches"].add_metric(lab, int(s.get("transport_switches") or 0))
                retry = s.get("next_ucx_retry_s")
                fam["retry"].add_metric(lab, float(retry) if retry is not None else -1.0)
                for stage, st in _stages(s):
                    fam["stage_bytes"].add_metric(lab + [stage], int(st.get("bytes", 0)))
                    fam["stage_busy"].add_metric(lab + [stage], float(st.get("busy_s", 0.0)))
                fam["stage_pool"].add_metric(lab, int((s.get("staging") or {}).get("pool_bytes", 0)))
        st = a._store
        if st is not None:
            status = st.status()
            fam["store_up"].add_metric([name], 1 if status["up"] else 0)
            fam["grants"].add_metric([name], status["lease_grants"])


def _stages(row: dict) -> list[tuple[str, dict]]:
    """(stage, {"ops","bytes","busy_s"}) of a rail_stats/served_stats row's staging totals."""
    st = row.get("staging") or {}
    return [(k, st[k]) for k in ("d2h", "wire", "h2d") if isinstance(st.get(k), dict)]


class MetricsServer:
    """A running /metrics endpoint (prometheus_client's WSGI server on a daemon thread)."""

    def __init__(self, httpd: Any, thread: threading.Thread, host: str) -> None:
        self._httpd, self._thread, self.host = httpd, thread, host
        self.port: int = int(httpd.server_port)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving (bounded: the serve loop notices within 0.5 s)."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        self._thread.join(2.0)

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _start(collector: AgentCollector, port: int, host: str, process: bool) -> MetricsServer:
    try:
        from prometheus_client import CollectorRegistry, start_http_server
        from prometheus_client.process_collector import ProcessCollector
    except ImportError as e:  # pragma: no cover - packaging problem
        raise MultirailError(f"metrics need prometheus_client ({e}): pip install prometheus-client") from None
    if not 0 <= int(port) <= 65535:
        raise InvalidArgumentError(f"metrics port {port} is out of range (0..65535)")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    if process:
        ProcessCollector(registry=registry)
    try:
        httpd, thread = start_http_server(int(port), addr=host, registry=registry)
    except OSError as e:
        if e.errno == 98:  # EADDRINUSE
            raise AddressInUseError(f"metrics port {host}:{port} is already in use") from None
        raise
    return MetricsServer(httpd, thread, host)


def serve_agent(agent: Any, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve one agent's metrics (held weakly: the server never keeps it alive)."""
    return _start(AgentCollector(agent), port, host, process=False)


def serve(port: int, host: str = "127.0.0.1", agents: Any = None) -> MetricsServer:
    """Serve the metrics of every open agent of this process (or of `agents`: an Agent or a
    callable returning agents), plus the process collector (CPU, memory, file descriptors)."""
    return _start(AgentCollector(agents), port, host, process=True)
