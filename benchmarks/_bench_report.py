"""Turn the raw measurements of ckpt_bench.py into ratios, target verdicts and printed tables.

Pure functions of the result dict rank 0 writes, so the arithmetic is checked without running
a benchmark. Times are medians over the measured saves of the slowest rank of each save.
"""

from __future__ import annotations

import statistics
from typing import Any

GB = 1e9
GIB = float(1 << 30)

# (summary key, comparison, bound, what it says). One place for every target the task sets.
TARGETS = [
    ("blocking_vs_dcp_best", "<=", 0.8, "blocking <= 0.8 x best dcp.async_save blocking"),
    ("blocking_vs_memcpy", "<=", 1.2, "blocking <= 1.2 x copy into preallocated buffers"),
    ("total_vs_disk", "<=", 1.25, "total <= 1.25 x state bytes / disk write bandwidth"),
    ("verify_vs_disk_read", ">=", 1.0, "verify throughput >= cold disk read bandwidth"),
    ("rss_growth", "<=", 0.05, "RSS growth after N slurmft saves <= 5 % of after the first"),
]


def median_times(saves: list[dict[str, float]]) -> tuple[float, float]:
    """Median blocking and total seconds over measured saves."""
    return (statistics.median(s["blocking_s"] for s in saves),
            statistics.median(s["total_s"] for s in saves))


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """The JSON summary: medians per method, physical limits, the ratios the targets are about."""
    limits = raw["limits"]
    state_bytes = raw["state_bytes"]
    methods = {}
    for name, m in raw["methods"].items():
        blocking, total = median_times(m["saves"])
        methods[name] = {"blocking_s": blocking, "total_s": total, "extra_mem_bytes": m["extra_mem_bytes"],
                         "measured_saves": len(m["saves"]), "kind": m["kind"]}
    candidates = {n: v for n, v in methods.items() if v["kind"] == "dcp_async"}
    if not candidates:
        raise ValueError("no dcp.async_save configuration was measured")
    best_name = min(candidates, key=lambda n: (candidates[n]["blocking_s"], candidates[n]["total_s"]))
    slurmft = next(v for v in methods.values() if v["kind"] == "slurmft")
    sf = raw["slurmft"]
    verify_bw = sf["verify_bytes"] / sf["verify_s"]
    read_bw = state_bytes / limits["read_s"]
    return {
        "state_bytes": state_bytes,
        "world_size": raw["world_size"],
        "methods": methods,
        "limits": {
            "copy_s": limits["copy_s"],
            "write_s": limits["write_s"],
            "write_gbps": state_bytes / limits["write_s"] / GB,
            "cold_read_s": limits["read_s"],
            "cold_read_gbps": read_bw / GB,
            "page_cache_eviction": limits["read_eviction"],
            "hash_s": limits["hash_s"],
            "hash_gbps": state_bytes / limits["hash_s"] / GB,
            "hash_algo": limits["hash_algo"],
        },
        "verify": {"bytes": sf["verify_bytes"], "cold_s": sf["verify_s"], "cold_gbps": verify_bw / GB,
                   "warm_s": sf["verify_warm_s"], "warm_gbps": sf["verify_bytes"] / sf["verify_warm_s"] / GB,
                   "page_cache_eviction": sf["verify_eviction"]},
        "rss_first_bytes": sf["rss_first"],
        "rss_last_bytes": sf["rss_last"],
        "rss_saves": sf["rss_saves"],
        "dcp_best_mode": best_name,
        "blocking_vs_dcp_best": slurmft["blocking_s"] / candidates[best_name]["blocking_s"],
        "blocking_vs_memcpy": slurmft["blocking_s"] / limits["copy_s"],
        "total_vs_disk": slurmft["total_s"] / limits["write_s"],
        "verify_vs_disk_read": verify_bw / read_bw,
        "rss_growth": (sf["rss_last"] - sf["rss_first"]) / sf["rss_first"],
    }


def verdicts(summary: dict[str, Any]) -> list[tuple[str, float, str, bool]]:
    """(what, measured ratio, bound as text, met) for every target."""
    out = []
    for key, op, bound, what in TARGETS:
        value = summary[key]
        met = value <= bound if op == "<=" else value >= bound
        out.append((what, value, f"{op} {bound:g}", met))
    return out


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "| " + " | ".join("-" * w for w in widths) + " |"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def render(summary: dict[str, Any]) -> str:
    """Markdown tables (they paste into the README as they are)."""
    state_gib = summary["state_bytes"] / GIB
    lim = summary["limits"]
    best = summary["dcp_best_mode"]
    rows = []
    for name, m in summary["methods"].items():
        label = f"{name} (best dcp.async_save)" if name == best else name
        rows.append([label, f"{m['blocking_s']:.3f}", f"{m['total_s']:.3f}",
                     f"{m['extra_mem_bytes'] / GIB:.2f}"])
    methods = _md_table(["method", "blocking s", "total s", "extra memory GiB"], rows)
    ver = summary["verify"]
    limit_rows = [
        ["copy state into preallocated buffers", f"{lim['copy_s']:.3f}",
         f"{summary['state_bytes'] / lim['copy_s'] / GB:.2f}"],
        ["write state bytes + fsync", f"{lim['write_s']:.3f}", f"{lim['write_gbps']:.2f}"],
        [f"read back cold ({lim['page_cache_eviction']})", f"{lim['cold_read_s']:.3f}",
         f"{lim['cold_read_gbps']:.2f}"],
        [f"hash in memory ({lim['hash_algo']})", f"{lim['hash_s']:.3f}", f"{lim['hash_gbps']:.2f}"],
        [f"slurmft verify_checkpoint, cold ({ver['page_cache_eviction']}, 1 process)",
         f"{ver['cold_s']:.3f}", f"{ver['cold_gbps']:.2f}"],
        ["slurmft verify_checkpoint, warm page cache", f"{ver['warm_s']:.3f}", f"{ver['warm_gbps']:.2f}"],
    ]
    limits = _md_table(["physical limit (both ranks at once)", "seconds", "GB/s"], limit_rows)
    target_rows = [[what, f"{value:.3f}", bound, "yes" if met else "NO"]
                   for what, value, bound, met in verdicts(summary)]
    targets = _md_table(["slurmft target", "measured", "target", "met"], target_rows)
    head = (f"state: {state_gib:.2f} GiB of FSDP2 model + Adam state on {summary['world_size']} ranks "
            f"(gloo, CPU); medians of the slowest rank; RSS checked over {summary['rss_saves']} saves")
    return "\n\n".join([head, methods, limits, targets])
