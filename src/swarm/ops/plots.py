"""The run's two plots, loss and throughput over time, drawn from the report's summary.

Kept apart from the report so that matplotlib stays an optional extra: the report's JSON needs none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from swarm.ops.report import rate_between, read_moves  # noqa: E402
from swarm.results import read_jsonl  # noqa: E402


def plot(summary: dict[str, Any], run_dir: Path) -> None:
    completed, start = summary["_completed"], summary["_start"]
    if not completed or start is None:
        return
    t = [c[0] - start for c in completed]
    loss = [c[2] for c in completed]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].plot(t, loss, ".", alpha=0.25, label="microbatch")
    ax[0].plot(t, _smooth(loss, 20), label="moving mean (20)")
    ax[0].set(xlabel="seconds", ylabel="loss (nats/byte)", title="training loss")
    ax[0].legend()
    steps = [c[3] for c in completed]
    ax[1].plot(steps, loss, ".", alpha=0.25)
    ax[1].set(xlabel="optimizer step of the last stage", ylabel="loss", title="loss by step")
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png", dpi=110)
    plt.close(fig)

    window = 10.0
    edges = [i * window for i in range(int(t[-1] // window) + 2)]
    rates = [rate_between(completed, start + lo, start + lo + window) for lo in edges]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.step(edges, rates, where="post")
    marks = [(e["time"], e["kind"], "tab:red", "fault") for e in _faults(run_dir)]  # injected faults
    marks += [(m["time"], f"{m['source']}->{m['target']}", "tab:green", "server moved") for m in read_moves(run_dir)]
    labelled = set()
    for when, text, colour, label in marks:
        ax.axvline(when - start, color=colour, alpha=0.4, lw=1, label=None if label in labelled else label)
        labelled.add(label)
        ax.annotate(text, (when - start, max(rates, default=0)), rotation=90, fontsize=7, color=colour, va="top")
    if marks:
        ax.legend()
    ax.set(xlabel="seconds", ylabel="samples/s", title=f"throughput (completed samples, {window:.0f}s windows)")
    fig.tight_layout()
    fig.savefig(run_dir / "throughput.png", dpi=110)
    plt.close(fig)


def _faults(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(run_dir / "faults.jsonl")


def _smooth(xs: list[float], n: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= n:
            acc -= xs[i - n]
        out.append(acc / min(i + 1, n))
    return out
