"""Coordination benchmark: the full 14-phase table with no-op actions, N processes, one log path.

    python -m bench --what coordination --nodes 8 --iterations 20 [--json]

Prints per-iteration coordination overhead (median, p95), per-barrier release latency and
filesystem metadata operations per second per waiting rank. With no work in the phases,
everything measured is the protocol's own cost. The same command with `--node-rank` runs one
node of such a job; the coordination tests use it (with slow or failing phases) as a real
multi-process job that knows nothing of RL.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import click

from coordination import exits, log as blog, timeline
from coordination.children import run_watched
from coordination.config import CoordinationConfig
from coordination.join import join_job
from coordination.layout import RunLayout
from coordination.phases import phases_of
from coordination.records import ensure_dir, publish_bytes, restrict_umask
from coordination.runner import Phase, PhaseRunner, Verdict, default_decide


def _parse_specs(specs: tuple[str, ...], what: str) -> dict[tuple[int, int], float]:
    out = {}
    for s in specs:
        try:
            phase, rank, value = s.split(":")
            out[(int(phase), int(rank))] = float(value)
        except ValueError:
            raise click.BadParameter(f"{what} {s!r} must be PHASE:RANK:NUMBER, e.g. 1:2:3.5") from None
    return out


_TALKER = ("import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n"
           "    print('talker at', time.monotonic(), flush=True)\n    time.sleep(0.1)\n")


def bench_node(log_path: Path, rank: int, nodes: int, iterations: int, *, slow: dict, fail: dict,
             max_attempts: int, coord: dict, slow_iterations: int = 0, talker: bool = False) -> int:
    logger = blog.setup(f"bench rank{rank}")
    layout = RunLayout(log_path)
    cfg = CoordinationConfig(**coord)
    config = {"bench": {"nodes": nodes, "iterations": iterations}, "coordination": dict(coord)}
    node = None
    code = exits.OK
    try:
        node = join_job(layout, job="both", rank=rank, num_nodes=nodes, job_facts={"rank_weights": [1] * nodes},
                        config=config, cfg=cfg, command=" ".join([sys.executable, "-m", "bench.protocol"] + sys.argv[1:]))
        work = layout.bench_work("both", rank)
        ensure_dir(work.parent)

        def make_action(spec):
            def action(step):
                timeline.append(work, {"iteration": step.iteration, "phase": spec.number, "attempt": step.attempt,
                                       "generation": step.node.generation, "pid": os.getpid()})
                delay = slow.get((spec.number, rank), 0.0)
                if slow_iterations and step.iteration > slow_iterations:
                    delay = 0.0
                if delay:
                    step.node.say(f"working {delay:.1f} s in phase {spec.number}", beat=True)
                    logger.info("working %.1f s in phase %d of iteration %d", delay, spec.number, step.iteration)
                    if talker:  # the work is a child that prints ten lines a second, as a trainer logs
                        run_watched([sys.executable, "-c", _TALKER, str(delay)], env=dict(os.environ),
                                    log_file=step.node.job.log_file(rank, "trainer"), node=step.node,
                                    peers=range(nodes), what=f"talker of phase {spec.number}")
                    else:
                        time.sleep(delay)
                if step.attempt <= fail.get((spec.number, rank), 0):
                    raise RuntimeError(f"injected failure of phase {spec.number} attempt {step.attempt}")
                return {"pid": os.getpid()}
            return action

        def decide(step, arrivals):
            v = default_decide(step, arrivals)
            return Verdict("retry", v.reason, {"attempt": step.attempt + 1}) if v.decision == "abort" else v

        phases = [Phase(s, make_action(s), decide if s.number == 10 else None,
                        max_attempts=max_attempts if s.number == 10 else 1) for s in phases_of("both")]
        runner = PhaseRunner(node, phases, max_iterations=iterations, gc_keep_iterations=cfg.gc_keep_iterations,
                             stop_requested=lambda: "STOP requested" if layout.stop_file.exists() else None)
        outcome = runner.run()
        logger.info("finished: %s", outcome.stopped)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a distinct exit code and one message
        code = exits.classify(exc)
        logger.error("%s", exits.message(exc, str(log_path)))
    finally:
        if node is not None:
            fenced = node.claim is not None and node.claim.is_fenced()
            if not fenced:
                publish_bytes(layout.bench_result("both", rank), json.dumps(
                    {"waits": node.waits}).encode())
            node.close("exited" if code == exits.OK else "failed", "finished" if code == exits.OK else "failed")
    return code


def analyse(log_path: Path, nodes: int) -> dict:
    layout = RunLayout(log_path)
    job = layout.job("both")
    waits = defaultdict(lambda: {"start": [], "end": []})
    iter_span = defaultdict(lambda: [float("inf"), 0.0])
    for r in range(nodes):
        for ev in timeline.read(job.timeline(r)):
            key = (ev["iteration"], ev["phase"], ev["attempt"])
            if ev["event"] == "wait-start":
                waits[key]["start"].append(ev["wall"])
            elif ev["event"] == "wait-end":
                waits[key]["end"].append(ev["wall"])
            span = iter_span[ev["iteration"]]
            span[0] = min(span[0], ev["wall"])
            span[1] = max(span[1], ev["wall"])
    latencies = [max(v["end"]) - max(v["start"]) for v in waits.values()
                 if len(v["start"]) == nodes and len(v["end"]) == nodes]
    # Iteration overhead: from the first event of iteration i to the first event of i+1 (the
    # last iteration ends at its last event); with no-op actions this is all coordination.
    its = sorted(iter_span)
    overhead = [iter_span[b][0] - iter_span[a][0] for a, b in zip(its, its[1:]) if a > 1]
    if len(its) > 1:
        overhead.append(iter_span[its[-1]][1] - iter_span[its[-1]][0])
    waits = [w for r in range(nodes) if layout.bench_result("both", r).exists()
             for w in json.loads(layout.bench_result("both", r).read_text())["waits"]]
    # Polling load of a rank that is kept waiting: the waits of at least a second (in this
    # benchmark, everyone waiting for the straggler of iteration 1). Short waits cost a fixed
    # few reads each (the arrivals that are there), reported per barrier instead.
    long_waits = [w["ops"] / w["seconds"] for w in waits if w["seconds"] >= 1.0]
    short = [w["ops"] for w in waits if w["seconds"] < 1.0]
    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")

    return {
        "nodes": nodes, "iterations": len(its),
        "overhead_median_s": statistics.median(overhead) if overhead else float("nan"),
        "overhead_p95_s": pct(overhead, 0.95),
        "barrier_latency_median_s": statistics.median(latencies) if latencies else float("nan"),
        "barrier_latency_p95_s": pct(latencies, 0.95),
        "barriers_measured": len(latencies),
        "meta_ops_per_s_per_rank": statistics.median(long_waits) if long_waits else float("nan"),
        "meta_ops_per_s_per_rank_max": max(long_waits) if long_waits else float("nan"),
        "meta_ops_per_wait_median": statistics.median(short) if short else float("nan"),
    }


def orchestrate(nodes: int, iterations: int, log_path: Path | None, timeout: float, straggler: float) -> dict:
    tmp = None
    if log_path is None:
        tmp = tempfile.TemporaryDirectory(prefix="baton-bench-")
        log_path = Path(tmp.name) / "run"
    try:
        log_path.mkdir(parents=True)
        created = True
    except FileExistsError:
        created = False
    if created:
        os.chmod(log_path, 0o750)  # only a folder this process created: a user's own keeps its mode
    logs = log_path.parent / f"{log_path.name}-logs"  # outside the run folder, which must start empty
    logs.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    procs = []
    try:
        for r in range(nodes):
            cmd = [sys.executable, "-m", "bench.protocol", "--node-rank", str(r), "--nodes", str(nodes),
                   "--iterations", str(iterations), "--log-path", str(log_path),
                   "--gc-keep-iterations", str(iterations + 1), "--slow", f"1:{nodes - 1}:{straggler}",
                   "--slow-iterations", "1"]
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                          stderr=open(logs / f"rank-{r}.log", "wb")))
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
        if bad:
            tails = "\n".join(f"--- rank {i} (exit {c}):\n" + "\n".join(
                (logs / f"rank-{i}.log").read_text().splitlines()[-5:]) for i, c in bad)
            raise click.ClickException(f"bench nodes failed: {bad}\n{tails}")
        return analyse(log_path, nodes)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if tmp is not None:
            tmp.cleanup()


@click.command()
@click.option("--nodes", default=8, show_default=True, help="number of node processes")
@click.option("--iterations", default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--log-path", type=click.Path(path_type=Path), default=None, help="run folder (default: a temp folder)")
@click.option("--timeout", default=900.0, show_default=True, help="seconds before the benchmark gives up")
@click.option("--straggler-seconds", default=3.0, show_default=True,
              help="in iteration 1 the last rank works this long in phase 1, so the others wait (polling load); "
                   "iteration 1 is left out of the overhead numbers")
@click.option("--slow-iterations", default=0, hidden=True, help="apply --slow only to iterations <= this (0 = all)")
@click.option("--node-rank", type=int, default=None, hidden=True, help="run one node of the job (internal)")
@click.option("--slow", multiple=True, hidden=True, help="PHASE:RANK:SECONDS of work in an action")
@click.option("--talker", is_flag=True, hidden=True,
              help="slow work runs as a child (the real launch path) that prints ten lines a second")
@click.option("--fail", multiple=True, hidden=True, help="PHASE:RANK:ATTEMPTS that raise")
@click.option("--max-attempts", default=2, hidden=True)
@click.option("--heartbeat-interval", default=5.0, hidden=True)
@click.option("--peer-timeout", default=120.0, hidden=True)
@click.option("--rejoin-timeout", default=1800.0, hidden=True)
@click.option("--gc-keep-iterations", default=3, hidden=True)
@click.option("--join-timeout", default=600.0, hidden=True)
def main(nodes, iterations, as_json, log_path, timeout, straggler_seconds, slow_iterations, node_rank, slow, talker,
         fail, max_attempts, heartbeat_interval, peer_timeout, rejoin_timeout, gc_keep_iterations, join_timeout):
    """Measure the coordination protocol's own cost on one log path."""
    restrict_umask()  # nothing baton or a library writes is wider than 0o750 / 0o640 (docs/design.md §5 rule 11)
    if node_rank is not None:
        if log_path is None:
            raise click.UsageError("--node-rank needs --log-path")
        coord = {"heartbeat_interval": heartbeat_interval, "peer_timeout": peer_timeout,
                 "rejoin_timeout": rejoin_timeout, "gc_keep_iterations": gc_keep_iterations,
                 "join_timeout": join_timeout}
        sys.exit(bench_node(log_path, node_rank, nodes, iterations, slow=_parse_specs(slow, "--slow"),
                          fail={k: int(v) for k, v in _parse_specs(fail, "--fail").items()},
                          max_attempts=max_attempts, coord=coord, slow_iterations=slow_iterations, talker=talker))
    if iterations < 2:
        raise click.UsageError("--iterations must be at least 2 (iteration 1 carries the straggler)")
    res = orchestrate(nodes, iterations, log_path, timeout, straggler_seconds)
    if as_json:
        click.echo(json.dumps(res))
        return
    click.echo(f"coordination benchmark: {res['nodes']} nodes x {res['iterations']} iterations of the 14-phase table")
    click.echo(f"  overhead per iteration   median {res['overhead_median_s']:.3f} s   p95 {res['overhead_p95_s']:.3f} s")
    click.echo(f"  barrier release latency  median {res['barrier_latency_median_s'] * 1000:.1f} ms   "
               f"p95 {res['barrier_latency_p95_s'] * 1000:.1f} ms  ({res['barriers_measured']} barriers)")
    click.echo(f"  metadata ops per second of a waiting rank  median {res['meta_ops_per_s_per_rank']:.1f}   "
               f"max {res['meta_ops_per_s_per_rank_max']:.1f}   (waits of 1 s or more)")
    click.echo(f"  metadata ops per short wait (reads of what has arrived)  median {res['meta_ops_per_wait_median']:.0f}")


if __name__ == "__main__":
    main()
