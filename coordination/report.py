"""`python -m coordination report --log-path L [--out DIR]`: draw the run.

Writes four PNGs and a short Markdown summary from the metrics records and the timelines:
  learning.png   train reward and eval accuracy per policy checkpoint (two panels, one x axis)
  timeline.png   a Gantt chart per rank in three colours groups -- work (rollout, eval, train),
                 coordination (the other phases' actions) and waiting at barriers -- over a bar
                 per iteration of how its rank-seconds split, so a straggler (waiting grows) or
                 slow coordination is visible at a glance
  throughput.png rollout tokens/s per rank per iteration
  loss.png       training loss (and entropy) per iteration
and, for a run with an environment, a table of its train episodes (success rate, turns per
episode, and the rollout's seconds in generation, blocked on the environment, in environment calls).
Reads only; writes only into --out (default <log-path>/report).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from coordination import timeline
from coordination.layout import JOBS, RunLayout
from coordination.metrics import iteration_metrics
from coordination.records import atomic_output, ensure_dir, publish_bytes, try_read


def load_spans(layout: RunLayout) -> list[dict[str, Any]]:
    """(job, rank, iteration, phase, kind, start, end) spans from every timeline file."""
    spans = []
    for path in layout.timeline_files():
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


# The states of a resident trainer drawn in its lane (idle and stopped leave the lane empty).
TRAINER_STYLE = {"loading": dict(facecolor="tab:pink"), "training": dict(facecolor="tab:purple"),
                 "offloaded": dict(facecolor="0.85", hatch="///", edgecolor="0.5")}


def load_trainer_spans(layout: RunLayout, end: float | None = None) -> list[dict[str, Any]]:
    """(job, rank, state, iteration, start, end) of each node's resident trainer, from the state
    changes its local rank 0 appended to `timeline/trainer/` (docs/design.md §9.6). A state lasts
    until the next one; the last lasts until `end` (the end of the run's phases), else it is dropped."""
    spans = []
    for path in layout.trainer_timeline_files():
        events = sorted((e for e in timeline.read(path) if isinstance(e.get("wall"), (int, float))),
                        key=lambda e: e["wall"])
        for ev, nxt in zip(events, [*events[1:], None]):
            stop = nxt["wall"] if nxt is not None else end
            if ev.get("event") in TRAINER_STYLE and stop is not None and stop > ev["wall"]:
                spans.append({"job": ev.get("job"), "rank": ev.get("rank"), "state": ev["event"],
                              "iteration": ev.get("iteration"), "start": ev["wall"], "end": stop})
    return spans


def _series(metrics: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(m["iteration"], m[key]) for m in metrics if isinstance(m.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


# The work an iteration exists for; every other phase's action is coordination, and time spent
# at a barrier waiting for the others is waiting.
WORK_PHASES = {1: "rollout", 5: "eval", 10: "train"}
GROUPS = ("work", "coordination", "waiting")


def span_group(span: dict[str, Any]) -> str:
    if span["kind"] == "wait":
        return "waiting"
    return "work" if span["phase"] in WORK_PHASES else "coordination"


def iteration_split(spans: list[dict]) -> dict[int, dict[str, float]]:
    """Rank-seconds of each iteration (all lanes added up) per group, and the coordination share."""
    out: dict[int, dict[str, float]] = {}
    for s in spans:
        row = out.setdefault(s["iteration"], dict.fromkeys(GROUPS, 0.0))
        row[span_group(s)] += max(s["end"] - s["start"], 0.0)
    for row in out.values():
        total = sum(row[g] for g in GROUPS)
        row["coordination_share"] = row["coordination"] / total if total > 0 else 0.0
    return dict(sorted(out.items()))


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _fig(title: str):
    fig, ax = _plt().subplots(figsize=(9, 4.8), dpi=110)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig, path: Path) -> Path:
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:   # iterations and checkpoints are whole numbers
        if ax.get_xlabel().startswith(("iteration", "policy checkpoint")):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    with atomic_output(path) as tmp:  # replaces, never writes through, a link planted at `path`
        fig.savefig(tmp, format="png")
    _plt().close(fig)
    return path


def _by_checkpoint(metrics: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Iteration N samples and evaluates the policy checkpoint it starts from (N-1 unless the
    metrics name another): plot each number at that checkpoint."""
    pts = [(m.get("policy_iteration", m["iteration"] - 1), m[key]) for m in metrics
           if isinstance(m.get(key), (int, float)) and isinstance(m.get("policy_iteration", 0), int)]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_learning(metrics: list[dict], out: Path) -> Path:
    fig, (top, bottom) = _plt().subplots(2, 1, sharex=True, figsize=(9, 6.4), dpi=110)
    top.set_title("Learning per policy checkpoint (0 = the starting model)")
    x, y = _by_checkpoint(metrics, "train_reward_mean")
    top.plot(x, y, "o-", color="tab:blue")
    top.set_ylabel("train reward\n(mean of its samples)")
    x, y = _by_checkpoint(metrics, "eval_accuracy")
    bottom.plot(x, y, "s-", color="tab:green")
    bottom.set_ylabel("eval accuracy")
    bottom.set_xlabel("policy checkpoint (the iteration that trained it)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.set_ylim(-0.02, 1.02)
    return _save(fig, out / "learning.png")


GROUP_STYLE = {"coordination": dict(color="tab:orange", alpha=0.95),
               "waiting": dict(color="0.75", hatch="//", alpha=0.8)}
WORK_COLORS = {1: "tab:blue", 5: "tab:green", 10: "tab:purple"}


def plot_timeline(spans: list[dict], out: Path, trainer_spans: list[dict] | None = None) -> Path:
    """Phases per rank over time, each node's resident trainer in a lane under it, and each
    iteration's split into work, coordination and waiting."""
    from matplotlib.patches import Patch

    plt = _plt()
    trainer_spans = trainer_spans or []
    lanes = sorted({(s["job"], s["rank"], "") for s in spans}
                   | {(s["job"], s["rank"], "trainer") for s in trainer_spans if s["job"] in JOBS},
                   key=lambda k: (JOBS.index(k[0]), k[1], k[2]))
    fig, (ax, share_ax) = plt.subplots(2, 1, figsize=(11, 3.6 + 0.45 * max(1, len(lanes))), dpi=110,
                                       gridspec_kw={"height_ratios": [max(2, len(lanes)), 2]})
    ax.set_title("Phases per rank over time")
    ax.grid(alpha=0.3)
    if spans:
        t0 = min(s["start"] for s in spans)
        for lane, key in enumerate(lanes):
            for s in spans:
                if (s["job"], s["rank"], "") != key:
                    continue
                group = span_group(s)
                style = dict(GROUP_STYLE[group]) if group != "work" else dict(color=WORK_COLORS[s["phase"]])
                ax.barh(lane, max(s["end"] - s["start"], 1e-3), left=s["start"] - t0, height=0.7,
                        edgecolor="none", **style)
            for s in trainer_spans:
                if (s["job"], s["rank"], "trainer") == key:
                    ax.barh(lane, max(s["end"] - s["start"], 1e-3), left=s["start"] - t0, height=0.5,
                            **{"edgecolor": "none", **TRAINER_STYLE[s["state"]]})
        starts: dict[int, float] = {}
        for s in spans:
            starts[s["iteration"]] = min(starts.get(s["iteration"], s["start"]), s["start"])
        label_at = ax.get_xaxis_transform()   # x in seconds, y as a fraction of the axes' height
        for it, t in sorted(starts.items()):
            ax.axvline(t - t0, color="black", lw=0.6, ls="--", alpha=0.5)
            ax.text(t - t0, 0.98, f" it {it}", fontsize=7, va="top", transform=label_at)
        ax.set_yticks(range(len(lanes)), [f"{j} rank {r}" + (f" {t}" if t else "") for j, r, t in lanes])
        ax.set_ylim(len(lanes) - 0.4, -0.9)   # room under the top edge for the iteration labels
    handles = [Patch(color=WORK_COLORS[p], label=f"work: {name}") for p, name in WORK_PHASES.items()]
    handles += [Patch(label="coordination: the other phases",
                      **GROUP_STYLE["coordination"]),
                Patch(label="waiting at a barrier for the other ranks", **GROUP_STYLE["waiting"])]
    if trainer_spans:
        handles += [Patch(label=f"resident trainer: {state}", **style) for state, style in TRAINER_STYLE.items()]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_xlabel("seconds since the first phase started")

    split = iteration_split(spans)
    its = list(split)
    bottom = [0.0] * len(its)
    for group, color in (("work", "tab:blue"), ("coordination", "tab:orange"), ("waiting", "0.75")):
        totals = [sum(split[i][g] for g in GROUPS) or 1.0 for i in its]
        frac = [split[i][group] / t for i, t in zip(its, totals)]
        share_ax.bar(its, frac, bottom=bottom, color=color, label=group)
        bottom = [b + f for b, f in zip(bottom, frac)]
    for i in its:
        share_ax.text(i, 1.02, f"{split[i]['coordination_share'] * 100:.0f}%", ha="center", fontsize=7)
    share_ax.set_ylim(0, 1.15)
    share_ax.set_ylabel("share of rank-seconds")
    share_ax.set_xlabel("iteration (label: coordination share)")
    share_ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    if its:
        share_ax.set_xticks(its)
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
    handles = ax.get_lines()
    x2, y2 = _series(metrics, "entropy")
    if x2:
        ax2 = ax.twinx()
        handles += ax2.plot(x2, y2, "^--", color="tab:orange", label="entropy (nats/token)")
        ax2.set_ylabel("entropy (nats per token)")
    # One legend for both axes, under the plot, where no marker can cover it.
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)
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
                     "train_s": work.get("10-train"), "success_rate": m.get("train_success_rate"),
                     "turns_per_episode": m.get("train_turns_mean"), "env_calls": m.get("train_env_calls"),
                     "generation_s": m.get("train_generation_seconds"),
                     "env_wait_s": m.get("train_env_wait_seconds"), "env_s": m.get("train_env_seconds")})
    return rows


# An environment's run also gets a table of its episodes: how many turns they took and where the
# rollout's time went (engine calls, blocked on the environment, and the environment's own calls,
# which overlap generation: their sum can exceed the rollout's wall time).
EPISODE_COLUMNS = (("success rate", "success_rate", 3), ("turns / episode", "turns_per_episode", 2),
                   ("generation s", "generation_s", 1), ("env wait s", "env_wait_s", 1),
                   ("env calls s", "env_s", 1))


def _has_env(rows: list[dict[str, Any]]) -> bool:
    return any(r.get("env_calls") for r in rows)


def episode_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The Markdown table of the episodes of an environment's run (none for single-turn tasks)."""
    if not _has_env(rows):
        return []
    lines = ["| iteration | " + " | ".join(name for name, _, _ in EPISODE_COLUMNS) + " |",
             "|---:" * (len(EPISODE_COLUMNS) + 1) + "|"]
    lines += [f"| {r['iteration']} | " + " | ".join(_fmt(r[key], d) for _, key, d in EPISODE_COLUMNS) + " |"
              for r in rows if r["turns_per_episode"] is not None]
    return ["Train episodes (seconds summed over ranks; environment calls overlap generation):", "", *lines, ""]


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
    lines += episode_lines(rows)
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
    if _has_env(rows):
        e = Table(title="train episodes (seconds summed over ranks; environment calls overlap generation)")
        for name, _, _ in (("iteration", None, 0), *EPISODE_COLUMNS):
            e.add_column(name, justify="right")
        for r in rows:
            if r["turns_per_episode"] is not None:
                e.add_row(str(r["iteration"]), *(_fmt(r[key], d) for _, key, d in EPISODE_COLUMNS))
        console.print(e)
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
    metrics = list(iteration_metrics(layout))
    spans = load_spans(layout)
    trainer_spans = load_trainer_spans(layout, end=max((s["end"] for s in spans), default=None))
    pngs = [plot_learning(metrics, out), plot_timeline(spans, out, trainer_spans), plot_throughput(metrics, out),
            plot_loss(metrics, out)]
    md = write_summary(layout, metrics, pngs, out)
    return {"out": str(out), "summary": str(md), "pngs": [str(p) for p in pngs], "rows": summary_rows(metrics),
            "iterations": iteration_split(spans)}
