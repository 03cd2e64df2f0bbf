"""Synchronous SWARM against async SWARM (AdamW local updates) and async SWARM with NAG weight correction.

    .venv/bin/python experiments/asynchrony.py [--groups warmup,delays,table] [--samples 1280]
        [--modes sync,async,async-nag] [--settings "warmup 10,..."] [--seed 0] [--run-dir runs/asynchrony]
        [--set KEY=VALUE ...] [--plot-only]

Every run is a local swarm of 4 stages x 2 servers and 2 trainers on the default corpus
(`swarm.config.recipes.ASYNC_EXPERIMENT`), trained on `--samples` samples per stage from the same seeds;
runs of one group differ in the training mode (`swarm.config.recipes.TRAINING_MODES`) and in the
group's setting only:

- `warmup`: the recipe's warm-up (10 epochs) and half of it (5);
- `delays`: one server of every stage delays its replies by 0.5 s, and by 1.0 s (`server.reply_delay`);
- `table`: sync and async at averaging batch sizes (`optim.target_batch_size`) of 32, 64 and 128
  samples: relative improvement of async over sync in the wall-clock time to complete the same number
  of microbatches (the paper's Table 1).

Results go to `results.json` in the run directory (loss curves included), with `loss.png` (loss against
epochs and against seconds, one row per setting) and `table.md`; `--plot-only` redraws from it.
The wall-clock target: the time a run's smoothed loss first reaches the sync run's final loss, against
the time the sync run took to get there. Runs must be alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from swarm.config import load_config  # noqa: E402
from swarm.config.recipes import ASYNC_EXPERIMENT, TRAINING_MODES  # noqa: E402
from swarm.ops.report import collect  # noqa: E402
from swarm.ops.run import run_local  # noqa: E402

SMOOTH = 40  # microbatches in the moving mean that "the loss" means below
SERVERS = 8  # 4 stages x 2


def settings(group: str) -> dict[str, list[str]]:
    """Each setting of a group: its name and the overrides it adds to every mode's run."""
    warmup = ASYNC_EXPERIMENT["optim"]["warmup_steps"]
    if group == "warmup":
        return {f"warmup {warmup}": [], f"warmup {warmup // 2}": [f"optim.warmup_steps={warmup // 2}"]}
    if group == "delays":  # the first server of every stage
        return {f"delay {d}s": [f"local.reply_delays={[d if i % 2 == 0 else 0.0 for i in range(SERVERS)]}"]
                for d in (0.5, 1.0)}
    if group == "table":
        return {f"batch {b}": [f"optim.target_batch_size={b}"] for b in (32, 64, 128)}
    raise SystemExit(f"unknown group {group!r}")


def run(mode: str, extra: list[str], args: argparse.Namespace, run_dir: Path) -> dict:
    recipes = [ASYNC_EXPERIMENT, TRAINING_MODES[mode]]
    overrides = [f'run_dir="{run_dir}"', f"data.seed={args.seed}", f"model.init_seed={args.seed}", *extra, *args.set]
    batch = load_config(base=recipes, overrides=overrides).optim.target_batch_size
    cfg = load_config(base=recipes, overrides=[*overrides, f"trainer.target_steps={args.samples // batch}"])
    run_local(cfg, progress=False)
    summary = collect(run_dir)
    start = summary["_start"]
    curve = [(c[0] - start, c[3], c[2]) for c in summary["_completed"]]  # seconds, last stage's epoch, loss
    stages = summary["stages"].values()
    return {"mode": mode, "curve": curve, "wall_seconds": summary["wall_seconds"],
            "samples": summary["samples_completed"], "steady_samples_per_second": summary["steady_samples_per_second"],
            "staleness": summary["staleness"],
            "delivery_exact": all(not any(v for k, v in st["delivery"].items() if k != "steps_seen") for st in stages),
            "recomputed": sum(r["recomputed_backwards"] for st in stages for r in st["replicas"])}


def smoothed(curve: list) -> list[tuple[float, float, float]]:
    """(seconds, epoch, moving mean of the loss over the last SMOOTH microbatches)."""
    out = []
    for i in range(SMOOTH - 1, len(curve)):
        window = [c[2] for c in curve[i - SMOOTH + 1 : i + 1]]
        out.append((curve[i][0], curve[i][1], statistics.fmean(window)))
    return out


def time_to(curve: list, loss: float) -> float | None:
    return next((t for t, _, value in smoothed(curve) if value <= loss), None)


def final_loss(curve: list) -> float:
    return smoothed(curve)[-1][2]


def by_epoch(curve: list) -> dict[int, float]:
    """The smoothed loss averaged over each epoch of the last stage."""
    epochs: dict[int, list[float]] = {}
    for _, epoch, value in smoothed(curve):
        epochs.setdefault(int(epoch), []).append(value)
    return {e: statistics.fmean(v) for e, v in epochs.items()}


def against(curve: list, reference: list) -> dict[str, float]:
    """How a run's loss stays against a reference run's over the epochs both reached: the share of
    them where it is at or below the reference, and the mean and largest excess over it."""
    mine, ref = by_epoch(curve), by_epoch(reference)
    excess = [mine[e] - ref[e] for e in sorted(mine.keys() & ref.keys())]
    return {"share_at_or_below": sum(x <= 0 for x in excess) / len(excess),
            "mean_excess": statistics.fmean(excess), "max_excess": max(excess)}


def compare(rows: dict[str, dict]) -> dict[str, dict]:
    """Per mode: final loss, the time to reach sync's final loss relative to sync's own time, and
    (modes other than async) how its loss stays against plain async's, epoch by epoch."""
    sync = rows.get("sync")
    target = final_loss(sync["curve"]) if sync else None
    sync_time = time_to(sync["curve"], target) if sync else None
    out = {}
    for mode, r in rows.items():
        reach = time_to(r["curve"], target) if target is not None else None
        out[mode] = {"final_loss": final_loss(r["curve"]), "wall_seconds": r["wall_seconds"],
                     "time_to_sync_final": reach,
                     "saving": 1 - reach / sync_time if reach is not None and sync_time else None,
                     "staleness_mean": r["staleness"]["all"].get("mean"),
                     "staleness_p90": r["staleness"]["all"].get("p90")}
        if mode not in ("sync", "async") and "async" in rows:
            out[mode]["vs_async"] = against(r["curve"], rows["async"]["curve"])
    return out


def draw(results: dict, path: Path) -> None:
    names = [k for k in results if not k.startswith("batch ") or k == "batch 32"]
    fig, axes = plt.subplots(len(names), 2, figsize=(12, 3.2 * len(names)), squeeze=False)
    for row, name in zip(axes, names, strict=True):
        for mode, r in results[name].items():
            s = smoothed(r["curve"])
            row[0].plot([x[1] for x in s], [x[2] for x in s], label=mode)
            row[1].plot([x[0] for x in s], [x[2] for x in s], label=mode)
        row[0].set(xlabel="epoch (averaging rounds / steps of the last stage)", ylabel="loss", title=name)
        row[1].set(xlabel="seconds", ylabel="loss", title=name)
        for ax in row:
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(results: dict) -> str:
    """Wall-clock time to complete the same number of microbatches (as many as the shorter run of the
    two completed), sync against async, per averaging batch size."""
    lines = ["| averaging batch | microbatches | sync seconds | async seconds | relative wall-clock improvement |",
             "|---|---|---|---|---|"]
    for name, rows in results.items():
        if name.startswith("batch ") and {"sync", "async"} <= rows.keys():
            n = min(len(rows["sync"]["curve"]), len(rows["async"]["curve"]))
            s, a = rows["sync"]["curve"][n - 1][0], rows["async"]["curve"][n - 1][0]
            lines.append(f"| {name.split()[1]} | {n} | {s:.1f} | {a:.1f} | {1 - a / s:.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", default="warmup,delays,table")
    parser.add_argument("--modes", default=",".join(TRAINING_MODES))
    parser.add_argument("--settings", default="", help="run only these settings of the groups, e.g. 'warmup 10'")
    parser.add_argument("--samples", type=int, default=1280, help="samples per stage in every run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", default="runs/asynchrony")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run (e.g. to calibrate optim.nag_lr)")
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args()
    out = Path(args.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    results: dict[str, dict] = json.loads(path.read_text()) if path.exists() else {}
    if not args.plot_only:
        for group in args.groups.split(","):
            for name, extra in settings(group).items():
                if args.settings and name not in args.settings.split(","):
                    continue
                # the table's batch 32 is the warm-up group's default setting: run once
                modes = ["sync", "async"] if group == "table" else args.modes.split(",")
                for mode in modes:
                    if group == "table" and name == "batch 32" and mode in results.get("warmup 10", {}):
                        results.setdefault(name, {})[mode] = results["warmup 10"][mode]
                        continue
                    tag = f"{name.replace(' ', '-')}-{mode}"
                    results.setdefault(name, {})[mode] = run(mode, extra, args, out / tag)
                    path.write_text(json.dumps(results))
                    print(f"{name:12s} {mode:10s}", json.dumps(compare(results[name])[mode]), flush=True)
    summary = {name: compare(rows) for name, rows in results.items()}
    (out / "comparison.json").write_text(json.dumps(summary, indent=1))
    (out / "table.md").write_text(table(results) + "\n")
    draw(results, out / "loss.png")
    for name, rows in summary.items():
        for mode, r in rows.items():
            saving = f"{r['saving']:.1%}" if r["saving"] is not None else "never"
            vs = r.get("vs_async")
            stays = f"  at or below async in {vs['share_at_or_below']:.0%} of epochs" if vs else ""
            print(f"{name:12s} {mode:10s} final loss {r['final_loss']:.3f}  wall {r['wall_seconds']:.0f}s  "
                  f"reaches sync's final loss: {saving} sooner  staleness mean {r['staleness_mean']:.2f}{stays}")
    print(table(results))


if __name__ == "__main__":
    main()
