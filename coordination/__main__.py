"""`python -m coordination status|recover|stop|report --log-path L`: look at a run, clean up
after crashes, ask it to stop, draw it. Starts fast: no torch, no transformers.

The operator wrappers (scripts/status.sh, recover.sh, stop.sh, report.sh) run one command each
and set BATON_PROG to their own name, so usage lines and advice name the command the user typed."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from pathlib import Path

import click

from coordination.layout import JOBS, LinkInRunFolder, RunLayout, check_no_links
from coordination.records import RecordError, publish_record, read_or_none, restrict_umask, try_read
from coordination.recover import BadResetSpec, RecoverRefused, apply, live_nodes, parse_reset_spec, plan
from coordination.report import make_report, print_table
from coordination.status import print_status

LOG_PATH = click.option("--log-path", type=click.Path(path_type=Path, file_okay=False), required=True,
                        help="the run's shared --log-path")


class CannotWrite(click.ClickException):
    """A folder the command must write to is read-only, missing or full: a usage error (exit 2)."""

    exit_code = 2


def cannot_write(exc: OSError, what: str, fix: str) -> CannotWrite:
    return CannotWrite(f"cannot write {what} ({exc.filename or ''}: {exc.strerror}); {fix}")


@contextlib.contextmanager
def links_refused():
    """A link planted in the run folder ends a command with the one line that names it (exit 1,
    as `recover` answers it), never a traceback."""
    try:
        yield
    except LinkInRunFolder as exc:
        raise click.ClickException(str(exc)) from None


@click.group()
def main() -> None:
    """Inspect and steer a baton run through its shared log path."""
    restrict_umask()  # nothing baton or a library writes is wider than 0o750 / 0o640 (docs/design.md §5 rule 11)


@main.command()
@LOG_PATH
@click.option("--watch", is_flag=True, help="refresh in place until Ctrl-C")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--interval", default=2.0, show_default=True, help="seconds between refreshes with --watch")
@click.option("--peer-timeout", type=float, default=None,
              help="seconds a heartbeat counter must stand still, on this machine's clock, before a rank shows as "
                   "lost (default: the run's coordination.peer_timeout)")
def status(log_path: Path, watch: bool, as_json: bool, interval: float, peer_timeout: float | None) -> None:
    """Every rank's host, phase, heartbeat and message, and what the run waits for. Read-only."""
    try:
        with links_refused():
            print_status(log_path, as_json=as_json, watch=watch, interval=interval, peer_timeout=peer_timeout)
    except FileNotFoundError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        pass


@main.command()
@LOG_PATH
@click.option("--apply", "do_apply", is_flag=True, help="remove what is listed (default: only list it)")
@click.option("--reset-phase", metavar="ITER:PHASE", default=None,
              help="make that phase (and the later phases of that iteration) run again after a restart")
@click.option("--peer-timeout", type=float, default=None,
              help="seconds a heartbeat counter must stand still, watched on this machine's clock, before its rank "
                   "counts as dead (default: the run's coordination.peer_timeout)")
def recover(log_path: Path, do_apply: bool, reset_phase: str | None, peer_timeout: float | None) -> None:
    """List (and with --apply remove) what crashed nodes left behind. Never removes completed outputs.

    Ranks are judged by watching their heartbeat counters (up to peer_timeout); --apply refuses
    while any of them moves."""
    if reset_phase is not None:
        try:
            parse_reset_spec(reset_phase)  # a typo is a usage error, found before anything is read
        except BadResetSpec as exc:
            raise click.BadParameter(str(exc), param_hint="--reset-phase") from None
    try:
        items, rollback, snap = plan(log_path, reset_phase, peer_timeout, for_apply=do_apply,
                                     progress=lambda line: click.echo(line, err=True))
    except BadResetSpec as exc:
        raise click.BadParameter(str(exc), param_hint="--reset-phase") from None
    except (RecoverRefused, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from None
    if not items:
        click.echo(f"nothing to recover in {log_path}")
        return
    click.echo(("removing" if do_apply else "would remove") + f" {len(items)} item(s) in {log_path}:")
    for it in items:
        click.echo(f"  {it.path.relative_to(log_path)}  -- {it.why}")
        if it.refused and not do_apply:
            click.echo(f"      --apply would refuse it now: {it.refused}")
    for job, completed in rollback.items():
        click.echo(f"  job {job}: progress set back to iteration {completed} completed")
    if not do_apply:
        live = live_nodes(snap)
        click.echo(f"--apply would refuse all of it while these nodes look alive: {live}. Stop them (or let them "
                   f"finish), then run recover again" if live else "run again with --apply to remove them")
        return
    try:
        apply(log_path, items, rollback, snap)
    except RecoverRefused as exc:
        raise click.ClickException(str(exc)) from None
    click.echo("done; restart the nodes with their original commands")


def _finished_jobs(layout, run_id: str) -> dict[str, str] | None:
    """{job: why it stopped} when every job of the run has stopped; None while any still runs."""
    stopped = {}
    for job in JOBS:
        jl = layout.job(job)
        if not jl.job_json.exists():
            continue
        prog = read_or_none(jl.progress_json, kind="progress", run_id=run_id)
        if prog is None or not prog.data.get("stopped"):
            return None
        stopped[job] = f"stopped after iteration {prog.data['completed_iteration']}: {prog.data['stopped']}"
    return stopped or None


@main.command()
@LOG_PATH
@click.option("--cancel", is_flag=True, help="withdraw an earlier stop request")
def stop(log_path: Path, cancel: bool) -> None:
    """Ask the run to stop after the current iteration; every node then exits 0."""
    with links_refused():
        _request_stop(log_path, cancel)


def _request_stop(log_path: Path, cancel: bool) -> None:
    layout = RunLayout(log_path)
    run = try_read(layout.run_json, kind="run")
    if run is None:
        raise click.ClickException(f"no baton run in {log_path} (no readable run.json); check --log-path")
    check_no_links(layout.stop_file)  # a linked STOP is neither a request to report nor one to withdraw
    if cancel:
        if not layout.stop_file.exists():
            click.echo(f"no stop request in {log_path}: nothing to withdraw")
            return
        layout.stop_file.unlink(missing_ok=True)
        click.echo(f"stop request withdrawn in {log_path}: the run goes on")
        return
    finished = _finished_jobs(layout, run.run_id)
    if finished is not None:
        jobs = "; ".join(f"job {j} {why}" for j, why in finished.items())
        click.echo(f"the run in {log_path} is already finished ({jobs}); nothing to stop")
        return
    if layout.stop_file.exists():
        click.echo(f"a stop request is already in place in {log_path}: the run ends after its current iteration")
        return
    try:
        publish_record(layout.stop_file, "stop", {"by": f"{socket.gethostname()}:{os.getpid()}"},
                       run_id=run.run_id, generation=0)
    except OSError as exc:
        raise cannot_write(exc, f"the stop request {layout.stop_file}",
                           "run this where the log path is writable (the same user as the nodes)") from None
    click.echo(f"stop requested: the run in {log_path} ends after its current iteration "
               f"(withdraw with: scripts/stop.sh --log-path {log_path} --cancel)")


@main.command()
@LOG_PATH
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="folder for the PNGs and summary.md (default: <log-path>/report)")
@click.option("--json", "as_json", is_flag=True, help="print the per-iteration rows as JSON")
@click.option("--table", is_flag=True, help="also print the per-iteration table")
def report(log_path: Path, out: Path | None, as_json: bool, table: bool) -> None:
    """Learning curves, a per-rank phase timeline, throughput and loss as PNGs plus a Markdown summary."""
    try:
        with links_refused():
            res = make_report(log_path, out)
    except FileNotFoundError as exc:
        if exc.filename is None:  # make_report's own "no run here" message
            raise click.ClickException(str(exc)) from None
        raise cannot_write(exc, "the report", "give --out a writable folder") from None
    except OSError as exc:
        raise cannot_write(exc, "the report", "give --out a writable folder") from None
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    if table:
        print_table(res["rows"])
    click.echo(f"report written to {res['out']}: {', '.join(Path(p).name for p in res['pngs'])} and summary.md")


def entry() -> None:
    prog, argv = os.environ.get("BATON_PROG"), sys.argv[1:]
    if prog and argv and argv[0] in main.commands:
        # A wrapper runs exactly this command: its usage line and --help name the wrapper.
        main.commands[argv[0]].main(args=argv[1:], prog_name=prog)
    main.main(args=argv, prog_name="python -m coordination")


if __name__ == "__main__":
    entry()
