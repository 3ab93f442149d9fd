"""Tables, ratios and the issue's Done-when checks for bench_memory_tier.py.

All ratios are computed here, once, from the raw seconds, so the printed table and the
JSON results cannot disagree. Conventions (each line says which way is better):
- first saves and steady state: stock / tierckpt and memcpy / tierckpt (higher is better);
- async_save blocking: tierckpt / stock (lower is better; the goal is <= 0.25).
The stock references are the BEST stock figure of the run (the strictest comparison):
the fastest stock FileSystemWriter save over thread_count 1 and 2, and the shortest stock
async_save blocking time over calls 2..N.
"""

from __future__ import annotations

from typing import Any

GB = 1e9

# The Done-when thresholds.
FIRST_SAVES_MIN = 2.0  # saves 2..N with compute between: stock best / tierckpt
ASYNC_MAX = 0.25  # async blocking, calls 2..N, new writer: tierckpt / stock
STEADY_MIN = 0.5  # steady-state save: memcpy / save
LOAD_MIN = 0.75  # load: memcpy / load
LOAD_OVER_CEILING_MIN = 0.9  # issue 27: a verified local load at >= 0.9x its ceiling


def ratios(res: dict[str, Any]) -> dict[str, Any]:
    """Every ratio of one scenario, keyed as the JSON results name them."""
    stock_best = min(res["stock_fsw_tc1_s"] + res["stock_fsw_tc2_s"])
    memcpy = min(res["memcpy_s"] + res["memcpy_1thread_s"])
    out: dict[str, Any] = {
        "stock_fsw_best_s": stock_best,
        "memcpy_ref_s": memcpy,
        "first_back_to_back_stock_over_tier": [
            stock_best / s for s in res["first_saves_back_to_back_s"]
        ],
        "first_with_compute_stock_over_tier": [
            stock_best / s for s in res["first_saves_with_compute_s"]
        ],
        "steady_memcpy_over_save": memcpy / min(res["steady_saves_s"]),
        "steady_stock_over_save": stock_best / min(res["steady_saves_s"]),
        "load_memcpy_over_load": memcpy / min(res["load_s"]),
        "load_stock_over_load": min(res["stock_load_s"]) / min(res["load_s"]),
        "async_tier_over_stock": {},
    }
    if res.get("verified_copy_s"):  # results recorded before this figure existed lack it
        out["verified_copy_ref_s"] = min(res["verified_copy_s"])
        out["ceiling_memcpy_over_verified_copy"] = memcpy / out["verified_copy_ref_s"]
        out["load_over_verified_copy_ceiling"] = out["verified_copy_ref_s"] / min(res["load_s"])
    if res.get("verified_read_s"):
        out["verified_read_ref_s"] = min(res["verified_read_s"])
        out["ceiling_memcpy_over_verified_read"] = memcpy / out["verified_read_ref_s"]
        out["load_over_verified_read_ceiling"] = out["verified_read_ref_s"] / min(res["load_s"])
    for executor in ("thread", "process"):
        stock = res["async"].get(f"stock {executor}")
        if stock is None:
            continue
        ref = min(stock["blocking_s"][1:])
        out[f"async_stock_{executor}_ref_s"] = ref
        out[f"async_floor_{executor}_memcpy_over_stock"] = memcpy / ref
        for variant in ("reused", "new"):
            tier = res["async"][f"tierckpt {executor} {variant} writer"]["blocking_s"]
            out["async_tier_over_stock"][f"{executor} {variant}"] = [s / ref for s in tier]
    return out


def _row(label: str, values: list[float], fmt: str = "{:>7.3f}") -> str:
    return f"  {label:<50}" + "".join(fmt.format(v) for v in values)


def render(res: dict[str, Any], saves: int) -> str:
    """The scenario's table, as printed."""
    r = ratios(res)
    nbytes = res["bytes"]
    stock_best = r["stock_fsw_best_s"]

    def rate(s: float) -> str:
        return f"{s:>7.3f} s {nbytes / s / GB:>6.2f} GB/s"

    threads = res["torch_threads_per_rank"] * res["world"]
    lines = [
        f"\n## {res['title']} ({nbytes / 2**30:.2f} GiB in all; torch threads per rank: "
        f"{res['torch_threads_per_rank']})",
        "baselines (same run, same bytes)",
        f"  {'memcpy: copy_ into pre-touched tensors, ' + str(threads) + ' thread(s) in all':<58}"
        f"{rate(min(res['memcpy_s']))}  runs {_fmt(res['memcpy_s'])}",
        f"  {'memcpy: 1 thread (ranks one after the other)':<58}"
        f"{rate(min(res['memcpy_1thread_s']))}  runs {_fmt(res['memcpy_1thread_s'])}",
        f"  {'memcpy reference (fastest of the above, start and end)':<58}{rate(r['memcpy_ref_s'])}",
    ]
    for kind, label, what in (
        (
            "copy",
            f"verified copy: copy_ + xxh3 per MiB, {threads} thread(s), no file",
            "ceiling of memcpy / save and memcpy / load while every byte is verified",
        ),
        (
            "read",
            f"verified read: preadv from tmpfs + xxh3 per MiB, {threads} thread(s)",
            "ceiling of memcpy / load from a file (the kernel's page-cache copy included)",
        ),
    ):
        if f"verified_{kind}_ref_s" in r:
            runs = res[f"verified_{kind}_s"]
            lines.append(f"  {label:<58}{rate(r[f'verified_{kind}_ref_s'])}  runs {_fmt(runs)}")
            ratio = r[f"ceiling_memcpy_over_verified_{kind}"]
            lines.append(f"    memcpy / verified {kind} {ratio:.2f}x: the {what}")
    for tc in (1, 2):
        runs = res[f"stock_fsw_tc{tc}_s"]
        label = f"stock FileSystemWriter -> new tmpfs dir, thread_count={tc}"
        lines.append(f"  {label:<58}{rate(min(runs))}  runs {_fmt(runs)}")
    runs = res["stock_load_s"]
    lines.append(f"  {'stock FileSystemReader <- tmpfs (bit-exact)':<58}{rate(min(runs))}")
    header = "".join(f"{'#' + str(i + 1):>7}" for i in range(saves))
    lines += [
        f"first saves, fresh default daemon, new writer per save {header}",
        _row("back to back (s)", res["first_saves_back_to_back_s"]),
        _row(
            f"  stock best {stock_best:.3f} s / tierckpt (x)",
            r["first_back_to_back_stock_over_tier"],
        ),
        _row(f"{res['compute']} before each save (s)", res["first_saves_with_compute_s"]),
        _row(
            f"  stock best {stock_best:.3f} s / tierckpt (x)",
            r["first_with_compute_stock_over_tier"],
        ),
    ]
    steady, load = res["steady_saves_s"], res["load_s"]
    settling = res.get("settling_saves_s", [])
    lines += [
        f"steady state (after {saves + len(settling)} saves back to back, retention "
        f"recycling), best of {len(steady)}",
        f"  {'settling saves #' + str(saves + 1) + '.. (s)':<58}{_fmt(settling)}",
        f"  {'sync save, new writer':<58}{rate(min(steady))}  runs {_fmt(steady)}",
        f"    memcpy / save {r['steady_memcpy_over_save']:.2f}x   "
        f"stock best / save {r['steady_stock_over_save']:.2f}x",
        f"  {'load newest (verified, bit-exact)':<58}{rate(min(load))}  runs {_fmt(load)}",
        f"    memcpy / load {r['load_memcpy_over_load']:.2f}x   "
        f"stock FileSystemReader / load {r['load_stock_over_load']:.2f}x",
        f"async_save blocking: time until dcp.async_save returns (s)  {header}",
    ]
    for executor in ("thread", "process"):
        stock = res["async"].get(f"stock {executor}")
        if stock is None:
            continue
        ref = r[f"async_stock_{executor}_ref_s"]
        lines.append(
            _row(f"stock {executor.upper()}, new FileSystemWriter per call", stock["blocking_s"])
        )
        for variant in ("reused", "new"):
            tier = res["async"][f"tierckpt {executor} {variant} writer"]
            lines.append(_row(f"tierckpt {executor.upper()}, {variant} writer", tier["blocking_s"]))
            lines.append(
                _row(
                    f"  / stock best of #2.. ({ref:.3f} s) (x, lower better)",
                    r["async_tier_over_stock"][f"{executor} {variant}"],
                )
            )
    lines.append(
        "async_save until durable (s): "
        + "; ".join(f"{name} {_fmt(v['until_durable_s'])}" for name, v in res["async"].items())
    )
    return "\n".join(lines)


def _fmt(values: list[float]) -> str:
    return " ".join(f"{v:.3f}" for v in values)


def summary(scenarios: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's Done-when items, PASS or MISS per scenario, as text and as records."""
    items: list[dict[str, Any]] = []
    for res in scenarios:
        r = ratios(res)
        res["ratios"] = r
        title = res["title"]
        saves = r["first_with_compute_stock_over_tier"][1:]
        items.append(
            _item(
                title,
                f"saves 2..N, {res['compute']} between: stock best/save >= 2",
                saves,
                min(saves) >= FIRST_SAVES_MIN,
            )
        )
        for key, values in r["async_tier_over_stock"].items():
            if key.endswith(" new"):
                later = values[1:]
                executor = key.split()[0]
                label = (
                    f"async blocking {executor.upper()} new writer, calls 2..N: tier/stock <= 0.25"
                )
                floor = r[f"async_floor_{executor}_memcpy_over_stock"]
                items.append(_item(title, label, later, max(later) <= ASYNC_MAX, floor=floor))
        ceiling = r.get("ceiling_memcpy_over_verified_copy")
        steady = r["steady_memcpy_over_save"]
        items.append(
            _item(
                title,
                "steady-state save: memcpy/save >= 0.5",
                [steady],
                steady >= STEADY_MIN,
                ceiling=ceiling,
            )
        )
        load = r["load_memcpy_over_load"]
        items.append(
            _item(title, "load: memcpy/load >= 0.75", [load], load >= LOAD_MIN, ceiling=ceiling)
        )
        for key, what in (
            ("load_over_verified_copy_ceiling", "verified copy (no file)"),
            ("load_over_verified_read_ceiling", "verified read (preadv from tmpfs)"),
        ):
            if key in r:
                label = f"issue 27: load >= 0.9x the {what} ceiling"
                items.append(_item(title, label, [r[key]], r[key] >= LOAD_OVER_CEILING_MIN))
    text = ["\n## Done-when (issue 10), ratios from this run"]
    for it in items:
        values = " ".join(f"{v:.2f}" for v in it["values"])
        limit = ""
        if it.get("floor") is not None:
            limit = f"  (floor memcpy/stock {it['floor']:.2f})"
        elif it.get("ceiling") is not None:
            limit = f"  (ceiling, verified copy {it['ceiling']:.2f})"
        text.append(f"  {it['verdict']:<5} {it['scenario']:<22} {it['label']:<68} {values}{limit}")
    return {"items": items, "text": "\n".join(text)}


def _item(
    scenario: str,
    label: str,
    values: list[float],
    ok: bool,
    *,
    floor: float | None = None,
    ceiling: float | None = None,
) -> dict[str, Any]:
    """One Done-when check. `floor`: the lowest ratio a one-copy stage allows (memcpy over
    stock); `ceiling`: the highest one a verified one-copy path allows (memcpy over a
    verified copy); either says how far the bar is from what this machine can do."""
    item: dict[str, Any] = {
        "scenario": scenario,
        "label": label,
        "values": values,
        "verdict": "PASS" if ok else "MISS",
    }
    if floor is not None:
        item["floor"] = floor
    if ceiling is not None:
        item["ceiling"] = ceiling
    return item
