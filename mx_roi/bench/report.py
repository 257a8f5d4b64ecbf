"""What the bench prints: the header, the main table, the bound / busy / overhead /
memory / thread-setting summaries, and the time-vs-boxes plot."""
from __future__ import annotations

import math
from typing import List, Optional

from .memory import mb
from .workloads import (ATOL, BATCH, DIRECTIONS, FEAT_H, FEAT_W, FIXED_COST_TARGET_MS, IMAGE_H,
                        IMAGE_W, RTOL,
                        STRIDE)

__all__ = ["format_header", "format_table", "format_hardware", "format_legend",
           "format_tv_summary", "format_busy", "format_overhead", "format_memory", "format_thread_summary",
           "format_fixed_cost", "format_fixed_cost_markdown", "format_doors", "format_doors_summary",
           "format_markdown",
           "geomean", "plot"]


def format_header(m: dict, args) -> str:
    env = ", ".join(f"{k}={v}" for k, v in sorted(m["env"].items())) or "(none set)"
    feats = [f for f in m["mxnet_features"] if f in
             ("MKLDNN", "OPENMP", "BLAS_OPEN", "BLAS_MKL", "BLAS_ATLAS", "BLAS_APPLE",
              "CUDA", "CUDNN", "NCCL", "INT64_TENSOR_SIZE")]
    lines = [
        f"mx_roi.bench  {m['date']}  ctx={m['ctx']}"
        + (f" ({', '.join(m['gpus'])})" if m["gpus"] else ""),
        f"CPU: {m['cpu']}, {m['cpu_count']} logical cores ({m['cpu_affinity']} usable); "
        f"{m['platform']}; load average at start {m['loadavg']}",
        f"python {m['python']}, mxnet {m['mxnet']} ({', '.join(feats)}), numpy {m['numpy']}, "
        f"mx_roi {m['mx_roi']} (git {m['git'] or '?'}; native kernels: "
        f"{m.get('native_isa', '?')})",
        f"thread/env settings: {env}",
        f"threads: MXNet built-ins {m['threads']['mxnet']} (OpenMP), mx_roi "
        f"{m['threads']['ours']} (its pool and native kernels; NumPy's BLAS held at "
        f"{m['threads']['ours_blas_in_kernels'] or '?'} inside mx_roi kernels, "
        f"{m['threads']['numpy_blas'] or '?'} outside)",
        f"workload: data ({BATCH}, C, {FEAT_H}, {FEAT_W}) float32 = {IMAGE_H}x{IMAGE_W} image "
        f"at stride {STRIDE}; seeded random proposals; median of {args.repeat} interleaved "
        + ("runs (Custom door, native door, ...)" if getattr(args, "doors", False) else
           "runs (ours, builtin, ...)") + " after 1 warm-up each"
        + ("; QUICK (reduced sizes)" if args.quick else ""),
    ]
    tv = m.get("torchvision")
    if tv:
        where = (f"torch.set_num_threads({tv['threads']}) = mx_roi's thread count"
                 if tv.get("device", "cpu") == "cpu" else f"its CUDA kernels on {tv['device']}")
        lines.append(f"torchvision {tv['torchvision']} (torch {tv['torch']}): {where}; timed "
                     "as a third interleaved side where its ops agree with ours (np.allclose "
                     "of output and gradient first), '-' where the semantics differ")
    return "\n".join(lines)


def _ms(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def format_table(rows) -> str:
    with_tv = any("tv_op" in r for r in rows)
    tv_head = f" {'tv ms':>9} {'ours/tv':>8}" if with_tv else ""
    head = (f"{'op':<13} {'config':<52} {'dir':<8} {'kernels':<7} {'ours ms':>10} "
            f"{'builtin ms':>11} {'ours/bi':>8}{tv_head} {'bound ms':>9} {'reached':>8}  "
            f"{'check':<5} note")
    lines = [head, "-" * len(head)]
    for r in rows:
        bi, ours, ratio = _ms(r["builtin_ms"]), _ms(r["ours_ms"]), _ms(r["ratio"])
        tv = f" {_ms(r.get('tv_ms')):>9} {_ms(r.get('tv_ratio')):>8}" if with_tv else ""
        bound = (f"{r['bound_ms']:.2f}{r['bound_by'][0]}" if r.get("bound_ms") is not None
                 else "-")
        reached = f"{100 * r['reached']:.0f}%" if r.get("reached") is not None else "-"
        check = ("ERROR" if r.get("error") else "-" if r["check"] is None
                 else "ok" if r["check"]["ok"] else "FAIL")
        lines.append(f"{r['op']:<13} {r['config']:<52} {r['direction']:<8} "
                     f"{r.get('backend', '?'):<7} {ours:>10} {bi:>11} {ratio:>8}{tv} {bound:>9} "
                     f"{reached:>8}  {check:<5} {r['note']}")
    return "\n".join(lines)


def format_hardware(hw: dict) -> str:
    return (f"bound = max(bytes that must move / {hw['bandwidth'] / 1e9:.1f} GB/s copy "
            f"bandwidth, multiply-adds / {hw['fma_rate'] / 1e9:.1f} GFMA/s float32 matmul), "
            f"both measured here on {hw['threads']} thread(s) (mx_roi.bench.roofline); m/f = "
            "memory/multiply-add bound; reached = bound / ours")


def geomean(values) -> Optional[float]:
    values = [v for v in values if v is not None and v > 0]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))



def format_tv_summary(rows) -> Optional[str]:
    """Geometric means of ours / torchvision per direction, or None without the column."""
    if not any("tv_op" in r for r in rows):
        return None
    parts = []
    for direction in DIRECTIONS:
        vals = [r["tv_ratio"] for r in rows
                if r["direction"] == direction and r.get("tv_ratio") is not None]
        gm = geomean(vals)
        parts.append(f"{direction} {gm:.2f} over {len(vals)}" if gm else f"{direction} -")
    worst = max((r["tv_ratio"] for r in rows if r.get("tv_ratio") is not None), default=None)
    return ("ours/tv = ours / torchvision.ops median time at the same thread count; geometric "
            "mean " + ", ".join(parts) + (f"; worst {worst:.2f}" if worst else ""))


def format_legend() -> str:
    return ("ratio = ours / builtin median time (< 1: mx_roi faster); check = np.allclose(ours, "
            f"builtin, rtol={RTOL:g}, atol={ATOL:g}) on the benchmark inputs: forward output "
            "(fwd) and also the data gradient (fwd+bwd); kernels = the mx_roi backend our side "
            "ran on (native: the CUDA kernels compiled for the host, on threads; numpy: NumPy/"
            "BLAS; MX_ROI_BACKEND overrides the per-op default)")


def format_busy(busy_rows) -> str:
    def f(v, spec=".2f"):
        return format(v, spec) if v is not None else "-"
    head = (f"{'workload':<27} {'dir':<8} {'ours ms':>9} {'bi ms':>9} {'ours busy/quiet':>16} "
            f"{'bi busy/quiet':>14} {'ours/bi busy':>13} {'ours/bi quiet':>14}")
    lines = ["One core kept busy by another process (a spinning Python process), same "
             "workloads:", head, "-" * len(head)]
    for r in busy_rows:
        lines.append(f"{r['key']:<27} {r['direction']:<8} {f(r.get('ours_ms')):>9} "
                     f"{f(r.get('builtin_ms')):>9} {f(r.get('ours_busy_over_quiet')):>16} "
                     f"{f(r.get('builtin_busy_over_quiet')):>14} {f(r.get('ratio')):>13} "
                     f"{f(r.get('quiet_ratio')):>14}")
    return "\n".join(lines)



def format_overhead(overhead) -> str:
    lines = ["Custom-op overhead (trivial custom ops with the same input/output shapes):"]
    for o in overhead:
        lines.append(f"  {o['label']:<38} data {tuple(o['data_shape'])} -> out "
                     f"{tuple(o['out_shape'])}  {o['direction']:<8} {o['ms']:8.3f} ms")
    return "\n".join(lines)


def _flag(ok, yes="met", no="NOT met") -> str:
    """A target's verdict: ``yes`` / ``no``, '-' where it does not apply (None)."""
    return "-" if ok is None else (yes if ok else no)


def fixed_cost_legend() -> str:
    """What the fixed-cost columns are, with the targets (text and Markdown)."""
    from .small_call import NATIVE_TARGET_FAMILIES, NATIVE_TARGET_MS
    t, n = FIXED_COST_TARGET_MS, NATIVE_TARGET_MS
    return ("small call: 1 image, 64-channel 19x25 map, 16 boxes (PS ops: output_dim * P * Q "
            "<= 64 channels); whole calls in ms, medians of interleaved runs; above = the "
            "door minus its own no-op floor (median of the paired runs): the Custom door "
            f"above a no-op Custom op (target fwd <= {t['fwd']}, fwd+bwd <= {t['fwd+bwd']}), "
            f"the native door above the no-op extension op mx_roi_noop (target fwd <= "
            f"{n['fwd']}, fwd+bwd <= {n['fwd+bwd']}, for "
            + ", ".join(NATIVE_TARGET_FAMILIES) + "; '-': no target); native <= bi: the "
            "native door's whole call against the built-in's; add_safe: the native door "
            "behind mx_roi.ext.add_safe (grad_req='add' made right)")


def format_fixed_cost(rows) -> str:
    """The fixed-cost section (:func:`mx_roi.bench.small_call.bench_fixed_cost` rows)."""
    head = (f"  {'op':<32} {'dir':<8} {'noop C':>7} {'Custom':>7} {'above':>6} {'target':<8}"
            f"| {'noop N':>7} {'native':>7} {'above':>6} {'target':<8} {'add_safe':>8} "
            f"| {'built-in':>8} {'native<=bi':<10}")
    lines = ["Fixed cost of a small call, Custom door and native door against their floors "
             "(" + fixed_cost_legend() + "):", head]
    for r in rows:
        ms = r["ms"]
        lines.append(
            f"  {r['key']:<32} {r['direction']:<8} {_ms(ms['noop Custom'], '.3f'):>7} "
            f"{_ms(ms['Custom'], '.3f'):>7} {_ms(r['extra_ms'], '.3f'):>6} "
            f"{_flag(r['met']):<8}| {_ms(ms['noop native'], '.3f'):>7} "
            f"{_ms(ms['native'], '.3f'):>7} {_ms(r['native_extra_ms'], '.3f'):>6} "
            f"{_flag(r['native_met']):<8} {_ms(ms['native add_safe'], '.3f'):>8} "
            f"| {_ms(ms['built-in'], '.3f'):>8} {_flag(r['whole_met'], 'yes', 'NO'):<10}"
            + (f"  ({r['native_missing']})" if r.get("native_missing") else ""))
    return "\n".join(lines)


def format_fixed_cost_markdown(rows) -> List[str]:
    """One run's fixed-cost rows as a Markdown table: every side's whole call, the cost
    above each floor and the verdicts (``python -m mx_roi.ext.bench --markdown``)."""
    from .small_call import SIDES
    head = ["op", "dir", *SIDES, "Custom above floor", "native above floor",
            "native target", "native <= built-in"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        target = ("-" if r["native_target_ms"] is None else
                  ("<= " if r["native_met"] else "**>** ") + f"{r['native_target_ms']}")
        cells = [r["key"], r["direction"], *(_ms(r["ms"][s], ".3f") for s in SIDES),
                 _ms(r["extra_ms"], ".3f"), _ms(r["native_extra_ms"], ".3f"), target,
                 _flag(r["whole_met"], "yes", "**no**")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def format_doors(rows) -> str:
    """The detector-sized rows through both doors (``--doors``)."""
    head = (f"{'workload':<36} {'dir':<8} {'Custom ms':>10} {'native ms':>10} "
            f"{'native/C':>8} {'wins':>5} {'native<=C':<9}  {'check':<5} {'bits':<5} note")
    lines = ["Detector-sized workloads through the Custom door and the native door, "
             "interleaved: medians; wins = runs where native <= Custom (run k of each "
             "paired); native<=C: the verdict on the medians; check = np.allclose of the "
             "outputs and data gradients, bits = identical:", head, "-" * len(head)]
    for r in rows:
        check = ("-" if r["check"] is None else "ok" if r["check"]["ok"] else "FAIL")
        bits = "-" if r["bit_equal"] is None else "same" if r["bit_equal"] else "diff"
        wins = "-" if r["wins"] is None else f"{r['wins']}/{len(r['native_runs_ms'])}"
        note = r.get("error") or r.get("native_missing") or ""
        lines.append(f"{r['key']:<36} {r['direction']:<8} {_ms(r['custom_ms']):>10} "
                     f"{_ms(r['native_ms']):>10} {_ms(r['ratio']):>8} {wins:>5} "
                     f"{_flag(r['median_ok'], 'yes', 'NO'):<9}  {check:<5} {bits:<5} {note}")
    judged = [r for r in rows if r["median_ok"] is not None]
    lines.append(f"native <= Custom (medians) in {sum(r['median_ok'] for r in judged)} of "
                 f"{len(judged)} rows with both doors")
    return "\n".join(lines)


def format_doors_summary(runs) -> str:
    """``--doors --threads ...``: native / Custom per thread setting, with the verdict."""
    settings, lines, table = _per_setting(
        runs, "doors", 36, "native / Custom median per thread setting (MXNet threads / "
        "mx_roi threads); '!' marks native slower than Custom:")
    for (key, direction), by in table.items():
        cells = []
        for s in settings:
            r = by.get(s) or {}
            cells.append("-" if r.get("ratio") is None else
                         f"{r['ratio']:.2f} {r['wins']}/{len(r['native_runs_ms'])}"
                         + ("" if r["median_ok"] else " !"))
        lines.append(f"{key:<36} {direction:<8}" + "".join(f" {c:>16}" for c in cells))
    return "\n".join(lines)


def _markdown_doors(runs, settings) -> List[str]:
    """``--doors`` runs as one Markdown table: per setting, Custom ms / native ms, the wins
    and the verdict native <= Custom."""
    by_key = _rows_by_key(runs, settings, "doors")
    if not by_key:
        return []
    head = ["workload", "dir"] + [f"{_setting_label(s, runs[s]).split(' (')[0]}: Custom ms / "
                                  "native ms, wins, native <= Custom" for s in settings]
    lines = ["Detector-sized workloads, the Custom door against the native door (medians of "
             "interleaved runs; wins: runs where native <= Custom):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (key, direction), rs in by_key.items():
        cells = [key, direction]
        for s in settings:
            r = rs.get(s)
            if r is None or r["native_ms"] is None:
                cells.append("-" if r is None else f"{_ms(r['custom_ms'])} / - (no native op)")
                continue
            cells.append(f"{r['custom_ms']:.2f} / {r['native_ms']:.2f}, "
                         f"{r['wins']}/{len(r['native_runs_ms'])}, "
                         + _flag(r["median_ok"], "yes", "**no**"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def format_memory(memory) -> str:
    methods = sorted({m["method"] for m in memory if m.get("method")})
    lines = ["Peak extra RSS of one fwd+bwd: fresh process per op and side, 2-box warm-up, "
             f"then peak RSS - RSS before ({', '.join(methods) or '?'}); includes MXNet's "
             "pooled allocator. out+grad = bytes of the output + the data gradient:",
             f"  {'workload':<27} {'ours':>10} {'builtin':>10} {'out+grad':>10} "
             f"{'ours/(out+grad)':>16}"]
    for m in memory:
        need = (m.get("out_bytes") or 0) + (m.get("grad_bytes") or 0)
        rel = f"{m['ours'] / need:.2f}" if m.get("ours") is not None and need else "-"
        lines.append(f"  {m['key']:<27} {mb(m.get('ours')):>10} {mb(m.get('builtin')):>10} "
                     f"{mb(need):>10} {rel:>16}"
                     + ("  (ours failed: see JSON)" if m.get("ours_error") else "")
                     + ("  (builtin failed: see JSON)" if m.get("builtin_error") else ""))
    return "\n".join(lines)


def _per_setting(runs, section: str, width: int, title: str):
    """``(settings, [title, head, rule], {(key, direction): {setting: row}})`` of the rows
    of ``section`` ('results', 'doors') of every thread setting's run."""
    settings = list(runs)
    head = f"{'workload':<{width}} {'dir':<8}" + "".join(
        f" {s + ' ' + _threads_tag(runs[s]):>16}" for s in settings)
    return settings, [title, head, "-" * len(head)], _rows_by_key(runs, settings, section)


def _rows_by_key(runs, settings, section: str) -> dict:
    """``{(key, direction): {setting: row}}`` of ``section`` of each setting's run."""
    table = {}
    for s in settings:
        for r in (runs[s] or {}).get(section) or []:
            table.setdefault((r["key"], r["direction"]), {})[s] = r
    return table


def format_thread_summary(runs) -> str:
    settings, lines, table = _per_setting(
        runs, "results", 27, "Ratios ours / built-in per thread setting (MXNet threads / "
        "mx_roi threads):")
    table = {k: {s: r.get("ratio") for s, r in by.items()} for k, by in table.items()}
    for (key, direction), by in table.items():
        lines.append(f"{key:<27} {direction:<8}" + "".join(
            f" {'-' if by.get(s) is None else format(by[s], '.2f'):>16}"
            for s in settings))
    for direction in DIRECTIONS:
        cells = []
        for s in settings:
            vals = [r["ratio"] for r in (runs[s] or {}).get("results", [])
                    if r["direction"] == direction and r.get("ratio")]
            cells.append(f"{max(vals):.2f}/{geomean(vals):.2f}" if vals else "-")
        lines.append(f"{'worst/geomean':<27} {direction:<8}" + "".join(
            f" {c:>16}" for c in cells))
    return "\n".join(lines)


def _setting_label(setting, run) -> str:
    """'defaults (MXNet 1 / mx_roi 2 threads)' or 'both 2 threads' for a run's header."""
    t = ((run or {}).get("machine") or {}).get("threads") or {}
    mx_t, ours = t.get("mxnet", "?"), t.get("ours", "?")
    if setting == "default":
        return f"defaults (MXNet {mx_t} / mx_roi {ours} threads)"
    if mx_t == ours:
        return f"both {ours} thread{'' if ours == 1 else 's'}"
    return f"{setting} (MXNet {mx_t} / mx_roi {ours} threads)"


def format_markdown(runs) -> str:
    """The speed table of docs/benchmarks.md, in Markdown, from bench runs (``--markdown``).

    ``runs`` maps a thread setting ('default', '1', 'all', ...) to a run's ``--json``
    payload (None for a run that failed).  The first setting gives the milliseconds, every
    setting its ratio ours / built-in; where torchvision was timed, a last column gives
    ours / torchvision per setting.  Below the table: the geometric means per setting.
    """
    settings = [s for s in runs if runs[s]]
    if not settings:
        return "(no bench run to tabulate)"
    if not any(runs[s].get("results") for s in settings):  # --doors runs
        return "\n".join(_markdown_doors(runs, settings)) or "(no bench run to tabulate)"
    by_key = {}
    for s in settings:
        for r in runs[s].get("results", []):
            by_key.setdefault((r["key"], r["direction"]), {})[s] = r
    has_tv = any(r.get("tv_ratio") is not None for rs in by_key.values() for r in rs.values())
    first = settings[0]
    ratio = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    head = ["op", "workload", "dir", "kernels",
            f"{_setting_label(first, runs[first])}: ours ms / built-in ms / ratio"]
    head += [f"{_setting_label(s, runs[s])}: ratio" for s in settings[1:]]
    if has_tv:
        head.append("ours / torchvision: " + " / ".join(
            _setting_label(s, runs[s]).split(" (")[0] for s in settings))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (key, direction), rs in by_key.items():
        r0 = rs.get(first) or next(iter(rs.values()))
        builtin = r0.get("builtin_ms")
        cells = [r0["op"], r0["config"], direction, r0.get("backend") or "-",
                 f"{r0['ours_ms']:.2f} / " + ("-" if builtin is None else f"{builtin:.2f}")
                 + f" / {ratio(r0.get('ratio') if first in rs else None)}"]
        cells += [ratio((rs.get(s) or {}).get("ratio")) for s in settings[1:]]
        if has_tv:
            cells.append(" / ".join(ratio((rs.get(s) or {}).get("tv_ratio")) for s in settings))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for direction in ("fwd+bwd", "fwd"):
        parts = []
        for s in settings:
            vals = [r["ratio"] for r in runs[s].get("results", [])
                    if r["direction"] == direction and r.get("ratio")]
            if vals:
                parts.append(f"{geomean(vals):.2f} {_setting_label(s, runs[s]).split(' (')[0]}"
                             f" (worst {max(vals):.2f})")
        lines.append(f"Geometric mean of the {direction} ratios ours / built-in: "
                     + ", ".join(parts) + ".")
    lines += _markdown_fixed_cost(runs, settings)
    return "\n".join(lines)


def _markdown_fixed_cost(runs, settings) -> list:
    """The fixed-cost section's rows of every setting as two Markdown tables: the Custom
    door minus the no-op Custom call (issue 34's target), and the native door minus the
    no-op extension op (issue 42's target) with its whole call against the built-in's;
    nothing when no run has them."""
    from .small_call import NATIVE_TARGET_FAMILIES, NATIVE_TARGET_MS
    by_key = _rows_by_key(runs, settings, "fixed_cost")
    if not by_key:
        return []
    target, native = FIXED_COST_TARGET_MS, NATIVE_TARGET_MS
    head = ["op", "dir"] + [_setting_label(s, runs[s]).split(" (")[0] for s in settings]
    table_head = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines = ["", f"Fixed cost of a small call (1 image, 64-channel 19x25 map, 16 boxes): the "
                 f"Custom door minus a no-op `Custom` op with the same shapes, ms (target: fwd "
                 f"<= {target['fwd']}, fwd+bwd <= {target['fwd+bwd']}); in brackets the no-op "
                 "call itself:", ""] + table_head
    for (key, direction), rs in by_key.items():
        cells = [key, direction]
        for s in settings:
            r = rs.get(s)
            cells.append("-" if r is None else
                         f"{r['extra_ms']:.2f} ({r['ms']['noop Custom']:.2f}) "
                         + ("met" if r["met"] else "**not met**"))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"The same small call through the native door: `mx_roi_<Op>` minus the no-op "
                  f"extension op `mx_roi_noop`, ms (target: fwd <= {native['fwd']}, fwd+bwd <= "
                  f"{native['fwd+bwd']} for " + ", ".join(NATIVE_TARGET_FAMILIES) + "), in "
                  "brackets the no-op call; then the native door's whole call against the "
                  "built-in's (ms):", ""] + table_head
    for (key, direction), rs in by_key.items():
        cells = [key, direction]
        for s in settings:
            r = rs.get(s)
            if r is None or r["ms"]["native"] is None:
                cells.append("-" if r is None else "- (no native op)")
                continue
            verdict = {None: "no target", True: "met", False: "**not met**"}[r["native_met"]]
            whole = ("" if r["whole_met"] is None else
                     f"; {r['ms']['native']:.3f} vs built-in {r['ms']['built-in']:.3f} "
                     + ("ok" if r["whole_met"] else "**slower**"))
            cells.append(f"{r['native_extra_ms']:.3f} ({r['ms']['noop native']:.3f}) "
                         f"{verdict}{whole}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _threads_tag(run) -> str:
    t = ((run or {}).get("machine") or {}).get("threads") or {}
    return f"({t.get('mxnet', '?')}/{t.get('ours', '?')})"


def plot(sweep_result, path, direction, machine):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(sweep_result)
    cols = min(3, len(keys))
    rows = int(math.ceil(len(keys) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        e = sweep_result[key]
        ax.plot(e["boxes"], e["ours_ms"], "o-", label="mx_roi (Custom)")
        if e["builtin"] and all(v is not None for v in e["builtin_ms"]):
            ax.plot(e["boxes"], e["builtin_ms"], "s--", label=e["builtin"])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(e["boxes"])
        ax.set_xticklabels([str(b) for b in e["boxes"]])
        ax.set_title(f"{key} ({direction})", fontsize=10)
        ax.set_xlabel("number of boxes")
        ax.set_ylabel("median time [ms]")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.suptitle(f"mx_roi vs MXNet built-in, {machine.get('ctx')}, {machine.get('cpu')}, "
                 f"mxnet {machine.get('mxnet')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

