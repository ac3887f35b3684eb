"""The staleness study's outputs from its runs: a summary per cell (JSON lines and one JSON object), a markdown
table, and PNG figures (final reward against staleness per correction with 95 % bands; reward curves per
staleness)."""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict

from hfllamarl.study.grid import default_correction, sync_correction
from hfllamarl.study.stats import area, final_reward, mean_ci, mean_curve, ratio_ci, smooth

#: Diagnostics averaged over a run's steps, then over its seeds (name in the summary -> logged metric).
DIAGNOSTICS = {"is_ratio_max": "is_ratio/max", "is_ratio_min": "is_ratio/min", "behavior_kl": "behavior_kl",
               "bounded_frac": "clipped_frac", "step_scale": "correction/step_scale"}


def _mean(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def summarize(runs: dict) -> list[dict]:
    """One summary per cell: seeds, final reward and area (mean and 95 % half-width), the share of the same loss's
    synchronous run (with its bootstrap interval), and the diagnostics."""
    by_cell: dict[str, list[dict]] = defaultdict(list)
    for record in runs.values():
        if "error" not in record:
            by_cell[record["cell"]].append(record)
    finals = {cell: [final_reward(r["series"]["reward"]) for r in recs] for cell, recs in by_cell.items()}
    out = []
    for cell, records in sorted(by_cell.items()):
        first = records[0]
        values = finals[cell]
        mean, half = mean_ci(values)
        auc_mean, auc_half = mean_ci([area(r["series"]["reward"]) for r in records])
        sync_key = f"{first['task']}/{first['loss']}/{sync_correction(first['loss'])}/s0"
        ratio, low, high = ratio_ci(values, finals.get(sync_key, []))
        row = {"cell": cell, "task": first["task"], "loss": first["loss"], "correction": first["correction"],
               "staleness": first["staleness"], "steps": first["steps"], "seeds": sorted(r["seed"] for r in records),
               "final": mean, "final_ci": half, "per_seed": dict(sorted((r["seed"], v) for r, v in zip(records, values))),
               "auc": auc_mean, "auc_ci": auc_half, "of_sync": ratio, "of_sync_low": low, "of_sync_high": high,
               "seconds": _mean([r.get("seconds") for r in records]),
               "is_default": first["correction"] == default_correction(first["loss"], first["staleness"])}
        for name, metric in DIAGNOSTICS.items():
            row[name] = _mean([_mean(r["series"].get(metric, [])) for r in records])
        row["masked_frac"] = _mean([_mean(r["series"].get("correction/masked_frac", [])) for r in records])
        out.append(row)
    return out


def _fmt(value, digits=3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}"


def markdown(rows: list[dict]) -> str:
    """The summary as a markdown table, by task, loss, correction and staleness."""
    lines = ["Bold: the loss's default at that staleness.", "",
             "| task | loss | correction | staleness | seeds | final reward (95 % CI) | % of sync (95 % CI) | "
             "area | max pi/mu | bounded | behaviour KL |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    order = sorted(rows, key=lambda r: (r["task"], r["loss"], not r["is_default"], r["correction"], r["staleness"]))
    for r in order:
        share = "-" if r["of_sync"] is None or not math.isfinite(r["of_sync"]) else (
            f"{100 * r['of_sync']:.0f} % ({100 * r['of_sync_low']:.0f}-{100 * r['of_sync_high']:.0f})")
        name = f"**{r['correction']}**" if r["is_default"] else r["correction"]
        lines.append(f"| {r['task']} | {r['loss']} | {name} | {r['staleness']} | {len(r['seeds'])} | "
                     f"{_fmt(r['final'])} ± {_fmt(r['final_ci'])} | {share} | {_fmt(r['auc'])} | "
                     f"{_fmt(r['is_ratio_max'], 2)} | {_fmt(r['bounded_frac'], 3)} | {_fmt(r['behavior_kl'], 4)} |")
    return "\n".join(lines) + "\n"


def _share(r: dict | None) -> str:
    if r is None or r["of_sync"] is None or not math.isfinite(r["of_sync"]):
        return "-"
    return f"{100 * r['of_sync']:.0f} % ({100 * r['of_sync_low']:.0f}-{100 * r['of_sync_high']:.0f})"


def pivots(rows: list[dict]) -> str:
    """The two views the study answers with: per task and loss, the synchronous final reward and the default
    correction's share of it at each staleness; per (task, loss) with several corrections, each correction's share
    at each staleness."""
    out = []
    by = {(r["task"], r["loss"], r["correction"], r["staleness"]): r for r in rows}
    levels = sorted({r["staleness"] for r in rows if r["staleness"]})
    for task in sorted({r["task"] for r in rows}):
        losses = sorted({r["loss"] for r in rows if r["task"] == task})
        out += [f"**{task}**: each loss with its default correction (% of its synchronous final reward, 95 % CI; "
                "seeds in brackets)", "",
                "| loss | synchronous final reward | " + " | ".join(f"staleness {s}" for s in levels) + " |",
                "|---|---|" + "---|" * len(levels)]
        for loss in losses:
            sync = next((r for r in rows if r["task"] == task and r["loss"] == loss and r["staleness"] == 0), None)
            cells = []
            for s in levels:
                r = by.get((task, loss, default_correction(loss, s), s))
                cells.append("-" if r is None else f"{_share(r)} [{len(r['seeds'])}] {r['correction']}")
            head = "-" if sync is None else f"{_fmt(sync['final'])} ± {_fmt(sync['final_ci'])} [{len(sync['seeds'])}]"
            out.append(f"| {loss} | {head} | " + " | ".join(cells) + " |")
        out.append("")
    for (task, loss) in sorted({(r["task"], r["loss"]) for r in rows}):
        corrections = sorted({r["correction"] for r in rows if r["task"] == task and r["loss"] == loss
                              and r["staleness"]})
        if len(corrections) < 3:
            continue
        stale = sorted({r["staleness"] for r in rows if r["task"] == task and r["loss"] == loss and r["staleness"]})
        out += [f"**{task}, {loss}**: every correction (% of the synchronous final reward, 95 % CI)", "",
                "| correction | " + " | ".join(f"staleness {s}" for s in stale) + " |", "|---|" + "---|" * len(stale)]
        for c in corrections:
            out.append(f"| {c} | " + " | ".join(_share(by.get((task, loss, c, s))) for s in stale) + " |")
        out.append("")
    return "\n".join(out)


def write(runs: dict, output_dir: str, machine: str = "") -> dict:
    """Write cells.jsonl, summary.json, table.md and the figures into `output_dir`; return the summary."""
    rows = summarize(runs)
    with open(os.path.join(output_dir, "cells.jsonl"), "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    with open(os.path.join(output_dir, "table.md"), "w") as fh:
        fh.write(pivots(rows) + "\n" + markdown(rows))
    figures = plot(runs, rows, os.path.join(output_dir, "figures"))
    summary = {"cells": len(rows), "runs": sum(len(r["seeds"]) for r in rows), "machine": machine,
               "figures": figures, "table": os.path.join(output_dir, "table.md"),
               "final": {r["cell"]: round(r["final"], 4) for r in rows},
               "of_sync": {r["cell"]: round(r["of_sync"], 4) for r in rows
                           if r["of_sync"] is not None and math.isfinite(r["of_sync"])}}
    with open(os.path.join(output_dir, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    return summary


def plot(runs: dict, rows: list[dict], directory: str) -> list[str]:
    """PNG figures: per (task, loss) with several corrections, final reward against staleness per correction (95 %
    bands); per task, each loss's share of its synchronous run at each staleness; per (task, loss), the reward
    curves of its default correction at each staleness. Returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["task"], r["loss"])].append(r)
    for (task, loss), cells in sorted(groups.items()):
        sync = [r for r in cells if r["is_default"] and r["staleness"] == 0]
        by_correction: dict[str, list[dict]] = defaultdict(list)
        for r in cells:
            if r["staleness"] > 0:
                by_correction[r["correction"]].append(r)
        if len(by_correction) < 3:
            continue
        names = sorted(by_correction)
        cols = 4
        rows_ = -(-len(names) // cols)
        fig, axes = plt.subplots(rows_, cols, figsize=(3.2 * cols, 2.6 * rows_), sharex=True, sharey=True,
                                 squeeze=False)
        levels = sorted({r["staleness"] for r in cells} | {0})
        for k, ax in enumerate(axes.flat):
            if k >= len(names):
                ax.axis("off")
                continue
            if sync:
                ax.axhline(sync[0]["final"], color="k", lw=0.8, ls="--")
                ax.axhspan(sync[0]["final"] - sync[0]["final_ci"], sync[0]["final"] + sync[0]["final_ci"],
                           color="k", alpha=0.08)
            points = sync + sorted(by_correction[names[k]], key=lambda r: r["staleness"])
            xs = [r["staleness"] for r in points]
            ys = [r["final"] for r in points]
            half = [r["final_ci"] if math.isfinite(r["final_ci"]) else 0.0 for r in points]
            ax.plot(xs, ys, marker="o", color="C0")
            ax.fill_between(xs, [y - h for y, h in zip(ys, half)], [y + h for y, h in zip(ys, half)], color="C0",
                            alpha=0.2)
            default = any(r["is_default"] for r in points if r["staleness"])
            ax.set_title(names[k] + (" (default)" if default else ""), fontsize=9)
            ax.set_xscale("symlog", linthresh=1)
            ax.set_xticks(levels)
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.set_ylim(-0.05, 1.05)
            ax.grid(alpha=0.3)
        fig.supxlabel("staleness (policy versions)")
        fig.supylabel("final reward (mean, 95 % CI)")
        fig.suptitle(f"{task}: {loss} with each correction (dashed: synchronous, its 95 % CI shaded)")
        fig.tight_layout()
        path = os.path.join(directory, f"{task}-{loss}-corrections.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    for task in sorted({r["task"] for r in rows}):
        defaults = [r for r in rows if r["task"] == task and r["is_default"] and r["staleness"] > 0
                    and r["of_sync"] is not None and math.isfinite(r["of_sync"])]
        if not defaults:
            continue
        losses = sorted({r["loss"] for r in defaults})
        levels = sorted({r["staleness"] for r in defaults})
        fig, ax = plt.subplots(figsize=(9, 4.5))
        width = 0.8 / len(levels)
        for j, s in enumerate(levels):
            for i, loss in enumerate(losses):
                r = next((r for r in defaults if r["loss"] == loss and r["staleness"] == s), None)
                if r is None:
                    continue
                x = i + (j - (len(levels) - 1) / 2) * width
                ax.bar(x, 100 * r["of_sync"], width, color=f"C{j}", label=f"staleness {s}" if i == 0 else None)
                ax.errorbar(x, 100 * r["of_sync"], yerr=[[100 * (r["of_sync"] - r["of_sync_low"])],
                                                        [100 * (r["of_sync_high"] - r["of_sync"])]], color="k",
                            capsize=2, lw=0.8)
        ax.axhline(100, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(losses)), losses)
        ax.set_ylabel("% of the synchronous final reward (95 % CI)")
        ax.set_title(f"{task}: each loss with its default correction")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(directory, f"{task}-losses.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    paths += _curves(runs, rows, directory, plt)
    return paths


def _curves(runs: dict, rows: list[dict], directory: str, plt) -> list[str]:
    """Seed-averaged reward curves of each (task, loss)'s default correction, one line per staleness."""
    paths = []
    by_key: dict[tuple[str, str], dict[int, list[list[float]]]] = defaultdict(lambda: defaultdict(list))
    for record in runs.values():
        loss, s = record["loss"], record["staleness"]
        if "error" not in record and record["correction"] == default_correction(loss, s):
            by_key[(record["task"], record["loss"])][record["staleness"]].append(record["series"]["reward"])
    for (task, loss), levels in sorted(by_key.items()):
        if len(levels) < 2 or loss not in ("aipo", "grpo"):
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for s, curves in sorted(levels.items()):
            curve = smooth(mean_curve(curves), 10)
            ax.plot(range(1, len(curve) + 1), curve, label=f"staleness {s} ({len(curves)} seeds)")
        ax.set_xlabel("optimizer step (64 completions each)")
        ax.set_ylabel("mean reward (10-step moving average)")
        ax.set_title(f"{task}: {loss}, default correction")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(directory, f"{task}-{loss}-curves.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
