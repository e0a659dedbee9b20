"""Turning per-completion runs into the bench report: JSON object, text table, PNG plot.

Ratios are ``speedup_vs[peer] = peer median ms / method median ms``: above 1 the method is
faster than that peer. ``paired_speedup_vs`` is the geometric mean over completions of
``peer ms / method ms`` for the same completion, which cancels slow stretches of a busy machine
that hit every method of one completion alike.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable

from specd.bench.peers import HF_PEERS, REFERENCE, Run

SPECULATIVE_PEERS = ("hf_assisted", "hf_lookup")
# Speed goals of issue 3 (engine), on the CPU where the bench runs.
GOAL_WORKLOAD = "edit_replay"
GOAL_TOKENS_PER_FORWARD = 2.5
GOAL_VS_GREEDY = 2.0
GOAL_VS_BEST_SPECULATIVE_PEER = 1.3


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    pos = (len(ordered) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _round(value: float, digits: int = 3) -> float:
    return round(float(value), digits)


def summarize_method(runs: list[Run], reference: list[list[int]]) -> dict[str, Any]:
    times = [r.ms for r in runs]
    tokens = sum(len(r.tokens) for r in runs)
    forwards = sum(r.target_forwards for r in runs)
    computed = sum(r.prefill_computed for r in runs)
    reused = sum(r.prefill_reused for r in runs)
    mismatches = [i for i, (r, ref) in enumerate(zip(runs, reference)) if r.tokens != ref]
    acceptance: dict[str, dict[str, Any]] = {}
    for run in runs:
        for source, stats in run.sources.items():
            entry = acceptance.setdefault(source, {"proposed": 0, "accepted": 0, "steps": 0})
            entry["proposed"] += stats.proposed
            entry["accepted"] += stats.accepted
            entry["steps"] += stats.steps
    for entry in acceptance.values():
        entry["rate"] = _round(entry["accepted"] / entry["proposed"] if entry["proposed"] else 0.0, 4)
    return {
        "median_ms": _round(statistics.median(times)) if times else 0.0,
        "p95_ms": _round(percentile(times, 95)),
        "mean_ms": _round(statistics.fmean(times)) if times else 0.0,
        # Tokens over target forwards, summed over the workload (a token-weighted mean).
        "mean_tokens_per_forward": _round(tokens / forwards if forwards else 0.0),
        "identical": not mismatches,
        "mismatches": len(mismatches),
        "mismatched_at": mismatches,  # indices into the workload's "labels"
        "tokens": tokens,
        "target_forwards": forwards,
        "first_token_median_ms": _round(statistics.median(r.first_token_ms for r in runs)) if runs else 0.0,
        "first_token_p95_ms": _round(percentile([r.first_token_ms for r in runs], 95)),
        "prefill_tokens": {"computed": computed, "reused": reused},
        "prefill_reused_fraction": _round(reused / (computed + reused) if computed + reused else 0.0, 4),
        "acceptance": acceptance,
        "ms": [_round(t, 2) for t in times],
    }


def _geomean(values: Iterable[float]) -> float:
    logs = [math.log(v) for v in values if v > 0]
    return math.exp(sum(logs) / len(logs)) if logs else 0.0


def summarize_workload(runs: dict[str, list[Run]], prompt_lengths: list[int],
                       labels: list[str]) -> dict[str, Any]:
    """``runs[method][i]`` answers completion i; every method ran every completion."""
    reference = [r.tokens for r in runs[REFERENCE]]
    methods = {name: summarize_method(method_runs, reference) for name, method_runs in runs.items()}
    peers = [p for p in HF_PEERS if p in runs]
    for name, summary in methods.items():
        summary["speedup_vs"] = {
            peer: _round(methods[peer]["median_ms"] / summary["median_ms"]) if summary["median_ms"] else 0.0
            for peer in peers if peer != name
        }
        summary["paired_speedup_vs"] = {
            peer: _round(_geomean(p.ms / m.ms for p, m in zip(runs[peer], runs[name]) if m.ms > 0))
            for peer in peers if peer != name
        }
    return {
        "completions": len(prompt_lengths),
        "prompt_tokens_median": int(statistics.median(prompt_lengths)) if prompt_lengths else 0,
        "labels": labels,  # document:line of each completion, in run order
        "methods": methods,
    }


def goals(workloads: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 3's speed goals for ``specd``, checked where issue 3 sets them: the edit-replay
    workload (completing lines of a file that already holds similar code), against HF peers that
    start from a cold prompt each time. Other workloads' ratios are in the table, not judged."""
    workload = workloads.get(GOAL_WORKLOAD)
    if workload is None or "specd" not in workload["methods"]:
        return []
    methods = workload["methods"]
    specd = methods["specd"]

    def goal(text: str, measured: float, target: float) -> dict[str, Any]:
        return {"workload": GOAL_WORKLOAD, "goal": text, "measured": measured, "target": target,
                "met": measured >= target}

    out = [goal("specd tokens per target forward", specd["mean_tokens_per_forward"], GOAL_TOKENS_PER_FORWARD)]
    if REFERENCE in specd["speedup_vs"]:
        out.append(goal("specd speedup vs hf_greedy", specd["speedup_vs"][REFERENCE], GOAL_VS_GREEDY))
    speculative = [p for p in SPECULATIVE_PEERS if p in specd["speedup_vs"]]
    if speculative:
        best = min(speculative, key=lambda p: methods[p]["median_ms"])
        out.append(goal(f"specd speedup vs the faster HF speculative peer ({best})", specd["speedup_vs"][best],
                        GOAL_VS_BEST_SPECULATIVE_PEER))
    return out


# -- text ----------------------------------------------------------------------------------

def _pct(fraction: float) -> str:
    return f"{fraction * 100:.0f}%"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_table(report: dict[str, Any]) -> str:
    models = report["models"]
    settings = report["settings"]
    lines = [
        f"specd bench: target {models['target']} ({models['target_params'] / 1e6:.1f}M params), "
        f"draft {models['draft']} ({models['draft_params'] / 1e6:.1f}M), {report['device']} {report['dtype']}, "
        f"torch {report['torch']}, transformers {report['transformers']}, {report['threads']} threads",
        f"up to {settings['max_tokens']} tokens per completion, seed {settings['seed']}, corpus "
        f"{settings['corpus']}; ratios are peer median / method median (>1 = faster than that peer)",
    ]
    for name, workload in report["workloads"].items():
        methods = workload["methods"]
        peers = [p for p in HF_PEERS if p in methods]
        lines += ["", f"{name}: {workload['completions']} completions, "
                      f"prompts ~{workload['prompt_tokens_median']} tokens"]
        header = (f"  {'method':<20}{'median ms':>10}{'p95 ms':>9}{'1st tok ms':>11}{'tok/fwd':>8}"
                  f"{'reused':>8}{'identical':>10}" + "".join(f"{'vs ' + p:>16}" for p in peers))
        lines.append(header)
        for method, s in methods.items():
            ratios = "".join(f"{_ratio(s['speedup_vs'].get(p)):>16}" for p in peers)
            identical = "ref" if method == REFERENCE else ("yes" if s["identical"] else f"NO ({s['mismatches']})")
            lines.append(f"  {method:<20}{s['median_ms']:>10.1f}{s['p95_ms']:>9.1f}{s['first_token_median_ms']:>11.1f}"
                         f"{s['mean_tokens_per_forward']:>8.2f}{_pct(s['prefill_reused_fraction']):>8}"
                         f"{identical:>10}{ratios}")
        if REFERENCE in methods and methods[REFERENCE]["median_ms"]:
            ref = methods[REFERENCE]
            lines.append(f"  ({REFERENCE} spends {_pct(ref['first_token_median_ms'] / ref['median_ms'])} of its median "
                         "time before the first token: prompt prefill, which drafting cannot shorten)")
        accepted = []
        for method, s in methods.items():
            if s["acceptance"]:
                parts = ", ".join(f"{src} {a['accepted']}/{a['proposed']} ({_pct(a['rate'])})"
                                  for src, a in sorted(s["acceptance"].items()))
                accepted.append(f"    {method}: {parts}")
        if accepted:
            lines += ["  drafts accepted/proposed:", *accepted]
    if report["goals"]:
        lines += ["", "issue 3 goals (specd, this machine):"]
        for g in report["goals"]:
            mark = "met " if g["met"] else "MISS"
            lines.append(f"  [{mark}] {g['workload']}: {g['goal']} {g['measured']:.2f} (goal >= {g['target']})")
    if not report["identical"]:
        lines += ["", "WARNING: some outputs differ from hf_greedy (see 'identical' above)"]
    lines += ["", f"command: {report['command']}  ({report['wall_s']:.0f} s)"]
    return "\n".join(lines)


# -- plot ----------------------------------------------------------------------------------

def write_plot(report: dict[str, Any], path: str) -> None:
    """Per workload: latency CDF per method (left), speedup vs hf_greedy per method (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = report["workloads"]
    fig, axes = plt.subplots(len(workloads), 2, figsize=(12, 3.6 * len(workloads)), squeeze=False)
    for row, (name, workload) in enumerate(workloads.items()):
        cdf, bars = axes[row]
        methods = workload["methods"]
        for method, s in methods.items():
            times = sorted(s["ms"])
            fractions = [(i + 1) / len(times) for i in range(len(times))]
            cdf.step(times, fractions, where="post", label=method,
                     linestyle="--" if method in HF_PEERS else "-")
        cdf.set_xscale("log")
        cdf.set_xlabel("latency per completion (ms, log scale)")
        cdf.set_ylabel("fraction of completions")
        cdf.set_title(f"{name}: latency CDF")
        cdf.grid(True, which="both", alpha=0.3)
        cdf.legend(fontsize=7, loc="lower right")
        names = [m for m in methods if m != REFERENCE]
        ratios = [methods[m]["speedup_vs"].get(REFERENCE, 0.0) for m in names]
        colors = ["tab:gray" if m in HF_PEERS else "tab:blue" for m in names]
        bars.barh(names, ratios, color=colors)
        for y, value in enumerate(ratios):
            bars.text(value, y, f" {value:.2f}x", va="center", fontsize=8)
        bars.axvline(1.0, color="black", linewidth=0.8)
        bars.invert_yaxis()
        bars.set_xlabel("speedup vs hf_greedy (median ms ratio)")
        bars.set_title(f"{name}: speedup")
    fig.suptitle(f"specd bench: {report['models']['target']} on {report['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
