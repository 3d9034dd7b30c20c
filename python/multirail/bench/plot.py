"""`--plot FILE.png`: pictures of a bench run (matplotlib, the optional `multirail[plot]` extra).

* Sweeps (`bench local` / `bench initiator`): throughput against block size. Each block size is a
  bar made of the rails' shares stacked (NIC counter bytes when the counters were read, else
  the engine's own per-rail accounting), the engine's measured rate as a line over them, and
  the rails' capacity (the sum of the rails' rates, when known) as a horizontal line; an
  iperf3 baseline, when present, as a dashed line.
* kv (`bench kv`): left, the per-request transfer time CDF of every workload (kv, contiguous,
  NIXL); right, each workload's throughput as stacked per-rail bars with the capacity line.

The figure is written with the Agg backend (no display needed).
"""

from __future__ import annotations

from typing import Any, Sequence

from multirail.bench.core import UsageError, format_size

INSTALL = "pip install 'multirail[plot]'"


def require_matplotlib() -> None:
    """UsageError (exit 2) with the install command when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(f"--plot needs matplotlib, which is not installed: {INSTALL} "
                         "(or pip install matplotlib)") from None


def _plt() -> Any:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _get(obj: Any, key: str, default: Any = None) -> Any:
    return obj.get(key, default) if isinstance(obj, dict) else getattr(obj, key, default)


def _rail_parts(row: Any) -> tuple[list[str], list[float], str]:
    """(rail names, Gbps each, source) of one row: counters, else the engine's accounting."""
    rails = _get(row, "rails") or []
    source = "NIC counters"
    if not rails or not any(_get(r, "bytes", 0) for r in rails):
        rails, source = _get(row, "engine_rails") or [], "engine accounting"
    return [str(_get(r, "name")) for r in rails], [float(_get(r, "gbps", 0.0)) for r in rails], source


def _capacity(row: Any) -> float | None:
    caps = [_get(r, "capacity_gbps") for r in (_get(row, "rails") or [])]
    return float(sum(caps)) if caps and all(caps) else None


_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def _stacked(ax: Any, xs: Sequence[float], rows: Sequence[Any], width: Any) -> tuple[set[str], float | None]:
    """Stack each row's rails at its x; returns (counter sources used, capacity if known everywhere)."""
    names: list[str] = []
    for r in rows:
        for n in _rail_parts(r)[0]:
            if n not in names:
                names.append(n)
    bottoms = [0.0] * len(rows)
    sources: set[str] = set()
    for ci, name in enumerate(names):
        vals = []
        for r in rows:
            rn, rg, src = _rail_parts(r)
            sources.add(src)
            vals.append(rg[rn.index(name)] if name in rn else 0.0)
        ax.bar(xs, vals, width=width, bottom=bottoms, color=_COLORS[ci % len(_COLORS)],
               label=f"rail {name}", edgecolor="white", linewidth=0.5)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    caps = [_capacity(r) for r in rows]
    cap = max(c for c in caps if c) if any(caps) else None
    return sources, cap


def plot_sweep(rows: Sequence[Any], baselines: Sequence[Any], path: str, title: str = "multirail bench") -> None:
    plt = _plt()
    sweep = [r for r in rows if _get(r, "worker") == "multirail"]
    fig, ax = plt.subplots(figsize=(9, 5.8), dpi=120)
    if sweep:
        sweep = sorted(sweep, key=lambda r: _get(r, "block_size"))
        xs = list(range(len(sweep)))
        sources, cap = _stacked(ax, xs, sweep, 0.7)
        ax.plot(xs, [_get(r, "gbps") for r in sweep], "k.-", label="multirail (engine: bytes / wall time)", zorder=5)
        ax.set_xticks(xs)
        ax.set_xticklabels([format_size(int(_get(r, "block_size"))) + (f" x{_get(r, 'batch_size')}"
                                                                          if _get(r, "batch_size", 1) > 1 else "")
                            for r in sweep], rotation=45, ha="right")
        if cap:
            ax.axhline(cap, color="#C44E52", linestyle="-", linewidth=1.5, label=f"rails' capacity ({cap:.2f} Gbps)")
        for b in baselines:
            if str(_get(b, "worker", "")).startswith("iperf3"):
                ax.axhline(_get(b, "gbps"), color="#555555", linestyle="--", linewidth=1,
                           label=f"{_get(b, 'worker')} ({_get(b, 'gbps'):.2f} Gbps)")
        ax.set_xlabel("block size (x batch)")
        src = " / ".join(sorted(sources))
        ax.set_ylabel(f"throughput, Gbps (bars: per-rail share, {src})")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, fontsize=8, frameon=False)
        ax.grid(axis="y", alpha=0.3)
        ax.set_title(f"{title}: throughput by block size")
    else:
        ax.text(0.5, 0.5, "no sweep rows", ha="center", va="center")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_kv(doc: dict[str, Any], path: str) -> None:
    plt = _plt()
    rows = doc.get("rows", [])
    kv = doc.get("kv", {})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2), dpi=120, gridspec_kw={"width_ratios": [3, 2]})
    styles = {"multirail kv": ("#4C72B0", "-"), "multirail contiguous": ("#555555", "--")}
    for r in rows:
        lat = sorted(r.get("latencies_us") or [])
        if not lat:
            continue
        n = len(lat)
        color, ls = styles.get(r["worker"], ("#DD8452", "-."))
        ys = [(i + 1) / n for i in range(n)]
        ax1.step([x / 1e3 for x in lat], ys, where="post", color=color, linestyle=ls, linewidth=1.8,
                 label=f"{r['worker']}: p50 {r['lat_p50_us'] / 1e3:.2f} ms, p99 {r['lat_p99_us'] / 1e3:.2f} ms")
    ax1.set_xlabel("per-request transfer time, ms (first layer posted -> every layer's notification held by decode)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_ylim(0, 1.02)
    ax1.grid(alpha=0.3)
    ax1.legend(loc="lower right", fontsize=8)
    ax1.set_title(f"{kv.get('model', '')} tp{kv.get('tp', '')}, isl {kv.get('isl', '')}, "
                  f"{kv.get('page_tokens', '')}-token pages ({format_size(int(kv.get('page_bytes', 0) or 1))}), "
                  f"layout {kv.get('layout', '')}: latency CDF", fontsize=10)
    bars = [r for r in rows if r.get("gbps")]
    if bars:
        xs = list(range(len(bars)))
        sources, cap = _stacked(ax2, xs, bars, 0.6)
        ax2.plot(xs, [r["gbps"] for r in bars], "k.", markersize=10, label="workload rate (bytes / wall time)", zorder=5)
        for x, r in zip(xs, bars):
            ax2.annotate(f"{r['gbps']:.2f}", (x, r["gbps"]), textcoords="offset points", xytext=(0, 6),
                         ha="center", fontsize=8)
        if cap:
            ax2.axhline(cap, color="#C44E52", linewidth=1.5, label=f"rails' capacity ({cap:.2f} Gbps)")
        ax2.set_xticks(xs)
        ax2.set_xticklabels([r["worker"].replace("multirail ", "multirail\n") for r in bars], fontsize=8)
        ax2.set_ylabel(f"throughput, Gbps (bars: per-rail share, {' / '.join(sorted(sources))})")
        ax2.legend(loc="lower right", fontsize=7)
        ax2.grid(axis="y", alpha=0.3)
        ratio = doc.get("ratio_to_contiguous")
        ax2.set_title("throughput" + (f": kv = {100 * ratio:.1f}% of contiguous" if ratio else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
