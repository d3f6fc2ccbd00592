"""`python -m coordination report --log-path L [--out DIR]`: draw the run.

Writes four PNGs and a short Markdown summary from the metrics records and the timelines:
  learning.png   train reward and eval accuracy per iteration
  timeline.png   a Gantt chart of phases per rank (work solid, waiting hatched): stragglers and
                 coordination gaps are visible at a glance
  throughput.png rollout tokens/s per rank per iteration
  loss.png       training loss (and entropy) per iteration
Reads only; writes only into --out (default <log-path>/report).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from coordination import timeline
from coordination.layout import JOBS, RunLayout, iteration_number
from coordination.phases import BY_NUMBER
from coordination.records import RecordError, atomic_output, ensure_dir, publish_bytes, try_read


def load_metrics(layout: RunLayout) -> list[dict[str, Any]]:
    out = []
    if not layout.metrics_dir.exists():
        return out
    for p in layout.metrics_dir.iterdir():
        n = iteration_number(p.stem)
        if n is None:
            continue
        try:
            rec = try_read(p, kind="metrics")
        except RecordError:
            rec = None
        if rec is not None:
            out.append(dict(rec.data, iteration=n))
    return sorted(out, key=lambda m: m["iteration"])


def load_spans(layout: RunLayout) -> list[dict[str, Any]]:
    """(job, rank, iteration, phase, kind, start, end) spans from every timeline file."""
    spans = []
    if not layout.timeline_dir.exists():
        return spans
    for path in sorted(layout.timeline_dir.glob("*-rank-*.jsonl")):
        open_: dict[tuple, dict] = {}
        for ev in timeline.read(path):
            kind = "wait" if ev["event"].startswith("wait") else "work"
            key = (ev["iteration"], ev["phase"], ev.get("attempt", 1), kind, ev.get("generation"))
            if ev["event"] in ("start", "wait-start"):
                open_[key] = ev
            elif key in open_:
                start = open_.pop(key)
                spans.append({"job": ev["job"], "rank": ev["rank"], "iteration": ev["iteration"],
                              "phase": ev["phase"], "kind": kind, "start": start["wall"], "end": ev["wall"]})
    return spans


def _series(metrics: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(m["iteration"], m[key]) for m in metrics if isinstance(m.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _fig(title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    with atomic_output(path) as tmp:  # replaces, never writes through, a link planted at `path`
        fig.savefig(tmp, format="png")
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def plot_learning(metrics: list[dict], out: Path) -> Path:
    fig, ax = _fig("Learning: train reward and eval accuracy")
    x, y = _series(metrics, "train_reward_mean")
    ax.plot(x, y, "o-", label="train reward (mean over samples)")
    # eval at iteration N measures the policy of iteration N-1: plot it at its policy's position
    x, y = _series(metrics, "eval_accuracy")
    ax.plot([i - 1 for i in x], y, "s-", label="eval accuracy (of the checkpoint of that iteration)")
    ax.set_xlabel("iteration (checkpoint)")
    ax.set_ylabel("reward / accuracy (0-1)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="best")
    return _save(fig, out / "learning.png")


def plot_timeline(spans: list[dict], out: Path) -> Path:
    import matplotlib
    from matplotlib.patches import Patch

    fig, ax = _fig("Phases per rank over time (solid: working, hatched: waiting at a barrier)")
    if spans:
        t0 = min(s["start"] for s in spans)
        lanes = sorted({(s["job"], s["rank"]) for s in spans}, key=lambda k: (JOBS.index(k[0]), k[1]))
        cmap = matplotlib.colormaps["tab20"].resampled(14)
        for lane, (job, rank) in enumerate(lanes):
            for s in spans:
                if (s["job"], s["rank"]) != (job, rank):
                    continue
                ax.barh(lane, max(s["end"] - s["start"], 1e-3), left=s["start"] - t0, height=0.7,
                        color=cmap(s["phase"]), hatch="//" if s["kind"] == "wait" else None,
                        alpha=0.45 if s["kind"] == "wait" else 0.95, edgecolor="none")
        starts: dict[int, float] = {}
        for s in spans:
            starts[s["iteration"]] = min(starts.get(s["iteration"], s["start"]), s["start"])
        for it, t in sorted(starts.items()):
            ax.axvline(t - t0, color="black", lw=0.6, ls="--", alpha=0.5)
            ax.text(t - t0, -0.6, f" it {it}", fontsize=7, va="bottom")
        ax.set_yticks(range(len(lanes)), [f"{j} rank {r}" for j, r in lanes])
        ax.invert_yaxis()
        used = sorted({s["phase"] for s in spans})
        ax.legend(handles=[Patch(color=cmap(p), label=f"{p} {BY_NUMBER[p].name}") for p in used],
                  loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_xlabel("seconds since the first phase started")
    fig.set_size_inches(11, 1.2 + 0.45 * max(1, len({(s['job'], s['rank']) for s in spans})) + 2)
    return _save(fig, out / "timeline.png")


def plot_throughput(metrics: list[dict], out: Path) -> Path:
    fig, ax = _fig("Rollout throughput per rank")
    ranks = sorted({r for m in metrics for r in (m.get("rollout_tokens_per_s") or {})}, key=int)
    for r in ranks:
        pts = [(m["iteration"], m["rollout_tokens_per_s"][r]) for m in metrics
               if isinstance((m.get("rollout_tokens_per_s") or {}).get(r), (int, float))]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"rank {r}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("generated tokens / s")
    if ranks:
        ax.legend(loc="best")
    return _save(fig, out / "throughput.png")


def plot_loss(metrics: list[dict], out: Path) -> Path:
    fig, ax = _fig("Training loss and entropy")
    x, y = _series(metrics, "loss")
    ax.plot(x, y, "o-", label="loss (mean over optimizer steps)")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    x2, y2 = _series(metrics, "entropy")
    if x2:
        ax2 = ax.twinx()
        ax2.plot(x2, y2, "^--", color="tab:orange", label="entropy (nats/token)")
        ax2.set_ylabel("entropy (nats per token)")
        ax2.legend(loc="upper right")
    ax.legend(loc="upper left")
    return _save(fig, out / "loss.png")


def _fmt(v: Any, digits: int = 3) -> str:
    return f"{v:.{digits}f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def summary_rows(metrics: list[dict]) -> list[dict[str, Any]]:
    """One row per iteration: the numbers the demo table and summary.md show."""
    rows = []
    for m in metrics:
        phases = m.get("phase_seconds") or {}
        work = {name: max((r.get(name, {}).get("work", 0.0) for r in phases.values()), default=0.0)
                for name in {n for r in phases.values() for n in r}}
        rows.append({"iteration": m["iteration"], "train_reward": m.get("train_reward_mean"),
                     "eval_accuracy": m.get("eval_accuracy"), "eval_of_checkpoint":
                     m["iteration"] - 1 if m.get("eval_accuracy") is not None else None,
                     "loss": m.get("loss"),
                     "rollout_s": work.get("01-train-rollout"), "eval_s": work.get("05-eval"),
                     "train_s": work.get("10-train")})
    return rows


def write_summary(layout: RunLayout, metrics: list[dict], pngs: list[Path], out: Path) -> Path:
    rows = summary_rows(metrics)
    lines = [f"# baton run report: {layout.root}", ""]
    evals = [r for r in rows if r["eval_accuracy"] is not None]
    if evals:
        first, last = evals[0], evals[-1]
        lines += [f"Eval accuracy: {_fmt(first['eval_accuracy'])} (checkpoint {first['eval_of_checkpoint']}) -> "
                  f"{_fmt(last['eval_accuracy'])} (checkpoint {last['eval_of_checkpoint']}), "
                  f"{(last['eval_accuracy'] - first['eval_accuracy']) * 100:+.1f} points.", ""]
    lines += ["| iteration | train reward | eval accuracy (checkpoint) | loss | rollout s | eval s | train s |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ev = f"{_fmt(r['eval_accuracy'])} ({r['eval_of_checkpoint']})" if r["eval_accuracy"] is not None else "-"
        lines.append(f"| {r['iteration']} | {_fmt(r['train_reward'])} | {ev} | {_fmt(r['loss'], 4)} | "
                     f"{_fmt(r['rollout_s'], 1)} | {_fmt(r['eval_s'], 1)} | {_fmt(r['train_s'], 1)} |")
    lines += ["", "Phase seconds are the slowest rank's working time in that phase.", ""]
    lines += [f"![{p.stem}]({p.name})" for p in pngs]
    path = out / "summary.md"
    publish_bytes(path, ("\n".join(lines) + "\n").encode())
    return path


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="per iteration (eval at iteration N measures the checkpoint of iteration N-1)")
    for col in ("iteration", "train reward", "eval accuracy", "of checkpoint", "loss", "rollout s", "eval s",
                "train s"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["iteration"]), _fmt(r["train_reward"]), _fmt(r["eval_accuracy"]),
                  "-" if r["eval_of_checkpoint"] is None else str(r["eval_of_checkpoint"]), _fmt(r["loss"], 4),
                  _fmt(r["rollout_s"], 1), _fmt(r["eval_s"], 1), _fmt(r["train_s"], 1))
    console = Console()
    if not console.is_terminal:  # a pipe or a log file: rich's 80 columns would cut the headers
        console = Console(width=120)
    console.print(t)
    evals = [r for r in rows if r["eval_accuracy"] is not None]
    if len(evals) >= 2:
        a, b = evals[0], evals[-1]
        print(f"eval accuracy {a['eval_accuracy']:.3f} (checkpoint {a['eval_of_checkpoint']}) -> "
              f"{b['eval_accuracy']:.3f} (checkpoint {b['eval_of_checkpoint']}): "
              f"{(b['eval_accuracy'] - a['eval_accuracy']) * 100:+.1f} points")


def make_report(log_path: Path, out: Path | None = None) -> dict[str, Any]:
    layout = RunLayout(log_path)
    if try_read(layout.run_json, kind="run") is None:
        raise FileNotFoundError(f"no baton run in {log_path} (no readable run.json); check --log-path")
    out = Path(out) if out else layout.report_dir
    ensure_dir(out)
    metrics = load_metrics(layout)
    pngs = [plot_learning(metrics, out), plot_timeline(load_spans(layout), out), plot_throughput(metrics, out),
            plot_loss(metrics, out)]
    md = write_summary(layout, metrics, pngs, out)
    return {"out": str(out), "summary": str(md), "pngs": [str(p) for p in pngs], "rows": summary_rows(metrics)}
