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
    ("overhead_vs_dcp_best", "<=", 0.5, "in-loop overhead per save <= 0.5 x best dcp.async_save's"),
    ("incremental_bytes_ratio", "<=", 0.15, "incremental save of a 90 %-frozen state: bytes <= 0.15 x a whole save's"),
    ("local_total_vs_disk", "<=", 1.25, "local tier: durable on the local disk <= 1.25 x state bytes / its write bandwidth"),
]


def _median(values) -> float:
    return statistics.median(list(values))


def best_dcp_mode(raw_methods: dict[str, Any]) -> str:
    """The dcp.async_save configuration with the lowest median blocking / copy (then total / write)."""
    def key(name: str) -> tuple[float, float]:
        saves = raw_methods[name]["saves"]
        return (_median(x["blocking_s"] / x["copy_s"] for x in saves),
                _median(x["total_s"] / x["write_s"] for x in saves))

    candidates = [n for n, m in raw_methods.items() if m["kind"] == "dcp_async"]
    if not candidates:
        raise ValueError("no dcp.async_save configuration was measured")
    return min(candidates, key=key)


def summarize_in_loop(loop: dict[str, Any]) -> dict[str, Any]:
    """Medians per method of the in-loop windows; DCP's best (the dcp.async_save configuration
    with the least overhead); slurmft's overhead against it and against a bare copy.

    ``overhead_vs_dcp_best`` is None when DCP's best showed no overhead at all (a ratio to noise).
    """
    methods = {}
    for name, m in loop["methods"].items():
        saves = m["saves"]
        methods[name] = {"kind": m["kind"], "measured_saves": len(saves), "window_steps": m["window_steps"],
                         "plain_s": _median(x["plain_s"] for x in saves),
                         "with_save_s": _median(x["with_save_s"] for x in saves),
                         "after_window_s": _median(x["after_window_s"] for x in saves),
                         "overhead_s": _median(x["overhead_s"] for x in saves),
                         "overhead_vs_copy": _median(x["overhead_s"] / x["copy_s"] for x in saves)}
    dcp = [n for n, v in methods.items() if v["kind"] in ("dcp_async", "dcp_defaults")]
    if not dcp:
        raise ValueError("no dcp.async_save configuration was measured in the loop")
    best = min(dcp, key=lambda n: methods[n]["overhead_s"])
    slurmft = next(v for v in methods.values() if v["kind"] == "slurmft")
    best_overhead = methods[best]["overhead_s"]
    return {"methods": methods, "dcp_best_mode": best,
            "overhead_vs_dcp_best": slurmft["overhead_s"] / best_overhead if best_overhead > 0 else None,
            "overhead_vs_memcpy": slurmft["overhead_vs_copy"]}


def summarize_incremental(inc: dict[str, Any]) -> dict[str, Any]:
    """Per state: the incremental series' bytes and time as fractions of the whole series'."""
    full_every = inc["full_every"]
    out: dict[str, Any] = {"frozen_share": inc["frozen_share"], "full_every": full_every, "states": {}}
    for name, series in inc.items():
        if name in ("frozen_share", "full_every"):
            continue
        whole, incremental = series["whole"], series["incremental"]
        ratio = incremental["bytes_written"] / whole["bytes_written"]
        out["states"][name] = {**series, "bytes_ratio": ratio,
                               # one whole save and full_every - 1 incremental ones
                               "bytes_ratio_per_cycle": (1 + (full_every - 1) * ratio) / full_every,
                               "time_ratio": incremental["total_s"] / whole["total_s"]}
    return out


def summarize_local_tier(raw: dict[str, Any], slurmft_in_loop_overhead_s: float) -> dict[str, Any]:
    """Until durable on the local disks against a write + fsync of the same bytes there (per save,
    then the median), without and with replicas; the in-loop overhead with every save copied to
    the run dir in the background, against slurmft's without the tier (None if that was <= 0)."""
    loop = raw["in_loop"]["saves"]
    overhead = _median(x["overhead_s"] for x in loop)
    return {"same_disk": raw["same_disk"],
            "local_s": _median(r["local_s"] for r in raw["own"]),
            "local_with_replica_s": _median(r["local_s"] for r in raw["with_replica"]),
            "write_s": _median(r["write_s"] for r in raw["own"] + raw["with_replica"]),
            "local_total_vs_disk": _median(r["local_s"] / r["write_s"] for r in raw["own"]),
            "local_total_vs_disk_with_replica": _median(r["local_s"] / r["write_s"] for r in raw["with_replica"]),
            "in_loop_overhead_s": overhead,
            "in_loop_after_window_s": _median(x["after_window_s"] for x in loop),
            "in_loop_overhead_vs_slurmft": (overhead / slurmft_in_loop_overhead_s
                                            if slurmft_in_loop_overhead_s > 0 else None)}


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """The JSON summary: medians per method, physical limits, the ratios the targets are about.

    Ratios are per save against the probe taken just before it (the machine is shared; its disk
    and CPUs change speed from minute to minute), then the median over saves.
    """
    state_bytes = raw["state_bytes"]
    methods = {}
    for name, m in raw["methods"].items():
        saves = m["saves"]
        methods[name] = {
            "kind": m["kind"], "measured_saves": len(saves), "extra_mem_bytes": m["extra_mem_bytes"],
            "blocking_s": _median(x["blocking_s"] for x in saves),
            "total_s": _median(x["total_s"] for x in saves),
            "until_finish_returned_s": _median(x["until_finish_returned_s"] for x in saves),
            "blocking_vs_copy": _median(x["blocking_s"] / x["copy_s"] for x in saves),
            "total_vs_write": _median(x["total_s"] / x["write_s"] for x in saves),
        }
    candidates = {n: v for n, v in methods.items() if v["kind"] == "dcp_async"}
    best = best_dcp_mode(raw["methods"])
    loop = summarize_in_loop(raw["in_loop"])
    slurmft = next(v for v in methods.values() if v["kind"] == "slurmft")
    probes = [x for m in raw["methods"].values() for x in m["saves"]]
    ver = raw["verify"]
    verify_bytes = ver["verify_bytes"]
    return {
        "state_bytes": state_bytes,
        "world_size": raw["world_size"],
        "methods": methods,
        "limits": {
            "copy_s": _median(x["copy_s"] for x in probes),
            "write_s": _median(x["write_s"] for x in probes),
            "write_s_range": [min(x["write_s"] for x in probes), max(x["write_s"] for x in probes)],
            "probes": len(probes),
            "cold_read_s": _median(p["read_s"] for p in ver["pairs"]),
            "page_cache_eviction": ver["eviction"],
            "hash_s": raw["hash_s"],
            "hash_algo": raw["hash_algo"],
        },
        "verify": {"bytes": verify_bytes, "cold_s": _median(p["verify_s"] for p in ver["pairs"]),
                   "warm_s": ver["verify_warm_s"]},
        "rss_first_bytes": raw["slurmft"]["rss_first"],
        "rss_last_bytes": raw["slurmft"]["rss_last"],
        "rss_saves": raw["slurmft"]["rss_saves"],
        "dcp_best_mode": best,
        "blocking_vs_dcp_best": slurmft["blocking_vs_copy"] / candidates[best]["blocking_vs_copy"],
        "blocking_vs_memcpy": slurmft["blocking_vs_copy"],
        "total_vs_disk": slurmft["total_vs_write"],
        "verify_vs_disk_read": _median((verify_bytes / p["verify_s"]) / (state_bytes / p["read_s"])
                                       for p in ver["pairs"]),
        "rss_growth": (raw["slurmft"]["rss_last"] - raw["slurmft"]["rss_first"]) / raw["slurmft"]["rss_first"],
        "in_loop": loop,
        "overhead_vs_dcp_best": loop["overhead_vs_dcp_best"],
        "overhead_vs_memcpy": loop["overhead_vs_memcpy"],
        "incremental": (incremental := summarize_incremental(raw["incremental"])),
        "incremental_bytes_ratio": incremental["states"]["fine-tuning"]["bytes_ratio"],
        "incremental_bytes_ratio_per_cycle": incremental["states"]["fine-tuning"]["bytes_ratio_per_cycle"],
        "local_tier": (local := summarize_local_tier(
            raw["local_tier"], next(v for v in loop["methods"].values() if v["kind"] == "slurmft")["overhead_s"])),
        "local_total_vs_disk": local["local_total_vs_disk"],
    }


def verdicts(summary: dict[str, Any]) -> list[tuple[str, float, str, bool]]:
    """(what, measured ratio, bound as text, met) for every target."""
    out = []
    for key, op, bound, what in TARGETS:
        value = summary[key]
        if value is None:  # nothing to compare against (see summarize_in_loop)
            out.append((what, float("nan"), f"{op} {bound:g}", False))
            continue
        met = value <= bound if op == "<=" else value >= bound
        out.append((what, value, f"{op} {bound:g}", met))
    return out


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "| " + " | ".join("-" * w for w in widths) + " |"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def render(summary: dict[str, Any]) -> str:
    """Markdown tables (they paste into docs/performance.md as they are)."""
    state_bytes = summary["state_bytes"]
    lim = summary["limits"]
    best = summary["dcp_best_mode"]
    rows = []
    for name, m in summary["methods"].items():
        label = f"{name} (best dcp.async_save)" if name == best else name
        rows.append([label, f"{m['blocking_s']:.3f}", f"{m['total_s']:.3f}", f"{m['blocking_vs_copy']:.2f}",
                     f"{m['total_vs_write']:.2f}", f"{m['extra_mem_bytes'] / GIB:.2f}"])
    methods = _md_table(["method", "blocking s", "total s", "blocking / copy", "total / write",
                         "extra memory GiB"], rows)
    ver = summary["verify"]
    low, high = lim["write_s_range"]
    limit_rows = [
        [f"copy state into preallocated buffers (median of {lim['probes']})", f"{lim['copy_s']:.3f}",
         f"{state_bytes / lim['copy_s'] / GB:.2f}"],
        [f"write state bytes + fsync (median of {lim['probes']}; {low:.2f}-{high:.2f} s)",
         f"{lim['write_s']:.3f}", f"{state_bytes / lim['write_s'] / GB:.2f}"],
        [f"read back cold ({lim['page_cache_eviction']})", f"{lim['cold_read_s']:.3f}",
         f"{state_bytes / lim['cold_read_s'] / GB:.2f}"],
        [f"hash in memory ({lim['hash_algo']})", f"{lim['hash_s']:.3f}", f"{state_bytes / lim['hash_s'] / GB:.2f}"],
        ["slurmft verify_checkpoint, cold (1 process)", f"{ver['cold_s']:.3f}",
         f"{ver['bytes'] / ver['cold_s'] / GB:.2f}"],
        ["slurmft verify_checkpoint, warm page cache", f"{ver['warm_s']:.3f}",
         f"{ver['bytes'] / ver['warm_s'] / GB:.2f}"],
    ]
    limits = _md_table(["physical limit (both ranks at once)", "seconds", "GB/s"], limit_rows)
    loop = summary["in_loop"]
    loop_rows = [[f"{name} (best in the loop)" if name == loop["dcp_best_mode"] else name,
                  f"{m['plain_s']:.3f}", f"{m['with_save_s']:.3f}", f"{m['overhead_s']:+.3f}",
                  f"{m['overhead_vs_copy']:+.2f}", f"{m['after_window_s']:.3f}"]
                 for name, m in loop["methods"].items()]
    window = next(iter(loop["methods"].values()))["window_steps"]
    in_loop = _md_table([f"in the training loop: {window} steps", "without a save s", "with a save s",
                         "overhead per save s", "overhead / copy", "still to durable after s"], loop_rows)
    inc = summary["incremental"]
    what = {"fine-tuning": f"about {inc['frozen_share']:.0%} frozen", "pre-training": "every tensor changes"}
    inc_rows = [[f"{name} ({what.get(name, '')})",
                 f"{s['whole']['bytes_written'] / 1e6:.1f}", f"{s['incremental']['bytes_written'] / 1e6:.1f}",
                 f"{s['bytes_ratio']:.3f}", f"{s['bytes_ratio_per_cycle']:.3f}", f"{s['whole']['total_s']:.3f}",
                 f"{s['incremental']['total_s']:.3f}", f"{s['time_ratio']:.2f}"]
                for name, s in inc["states"].items()]
    incremental = _md_table(["state, a training step before each save", "whole save MB", "incremental MB",
                             "bytes ratio", f"bytes ratio, 1 whole in {inc['full_every']}", "whole save s",
                             "incremental s", "time ratio"], inc_rows)
    tier = summary["local_tier"]
    vs = tier["in_loop_overhead_vs_slurmft"]
    tier_rows = [
        ["durable on the local disk, own shards", f"{tier['local_s']:.3f}", f"{tier['local_total_vs_disk']:.2f}"],
        ["durable on the local disk, with a replica of the other node's", f"{tier['local_with_replica_s']:.3f}",
         f"{tier['local_total_vs_disk_with_replica']:.2f}"],
        ["write + fsync of the same bytes there (the probe)", f"{tier['write_s']:.3f}", "1.00"],
        ["in-loop overhead per save, every save copied to the run dir behind",
         f"{tier['in_loop_overhead_s']:+.3f}", "-" if vs is None else f"{vs:.2f} x slurmft without the tier"],
    ]
    disk = "the same disk as the run dir" if tier["same_disk"] else "its own disk"
    local_tier = _md_table([f"node-local tier (2 ranks posing as 2 nodes; local dir on {disk})", "seconds",
                            "/ write probe"], tier_rows)
    target_rows = [[what, f"{value:.3f}", bound, "yes" if met else "NO"]
                   for what, value, bound, met in verdicts(summary)]
    targets = _md_table(["slurmft target (per-save ratios against the probe just before)", "measured",
                         "target", "met"], target_rows)
    head = (f"state: {state_bytes / GIB:.2f} GiB of FSDP2 model + Adam state on {summary['world_size']} "
            f"ranks (gloo, CPU); medians over saves of the slowest rank; every save preceded by a copy "
            f"and a write probe; RSS checked over {summary['rss_saves']} slurmft saves")
    return "\n\n".join([head, methods, limits, in_loop, incremental, local_tier, targets])
