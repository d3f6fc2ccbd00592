"""`python -m coordination status|recover|stop --log-path L`: look at a run, clean up after
crashes, ask it to stop. Starts fast: no torch, no transformers."""
from __future__ import annotations

import sys
from pathlib import Path

import click

LOG_PATH = click.option("--log-path", type=click.Path(path_type=Path, file_okay=False), required=True,
                        help="the run's shared --log-path")


@click.group()
def main() -> None:
    """Inspect and steer a baton run through its shared log path."""
    from coordination.records import restrict_umask

    restrict_umask()  # nothing baton or a library writes is wider than 0o750 / 0o640 (docs/design.md §5 rule 11)


@main.command()
@LOG_PATH
@click.option("--watch", is_flag=True, help="refresh in place until Ctrl-C")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--interval", default=2.0, show_default=True, help="seconds between refreshes with --watch")
@click.option("--peer-timeout", default=120.0, show_default=True, help="heartbeat age after which a rank shows as lost")
def status(log_path: Path, watch: bool, as_json: bool, interval: float, peer_timeout: float) -> None:
    """Every rank's host, phase, heartbeat and message, and what the run waits for. Read-only."""
    from coordination.status import print_status

    try:
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
@click.option("--peer-timeout", default=120.0, show_default=True, help="heartbeat age after which a rank counts as dead")
def recover(log_path: Path, do_apply: bool, reset_phase: str | None, peer_timeout: float) -> None:
    """List (and with --apply remove) what crashed nodes left behind. Never removes completed outputs."""
    from coordination.recover import RecoverRefused, apply, plan

    try:
        items, rollback, snap = plan(log_path, reset_phase, peer_timeout)
    except (RecoverRefused, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from None
    if not items:
        click.echo(f"nothing to recover in {log_path}")
        return
    click.echo(("removing" if do_apply else "would remove") + f" {len(items)} item(s) in {log_path}:")
    for it in items:
        click.echo(f"  {it.path.relative_to(log_path)}  -- {it.why}")
    for job, completed in rollback.items():
        click.echo(f"  job {job}: progress set back to iteration {completed} completed")
    if not do_apply:
        click.echo("run again with --apply to remove them")
        return
    try:
        apply(log_path, items, rollback, snap)
    except RecoverRefused as exc:
        raise click.ClickException(str(exc)) from None
    click.echo("done; restart the nodes with their original commands")


@main.command()
@LOG_PATH
@click.option("--cancel", is_flag=True, help="withdraw an earlier stop request")
def stop(log_path: Path, cancel: bool) -> None:
    """Ask the run to stop after the current iteration; every node then exits 0."""
    import os
    import socket

    from coordination.layout import RunLayout
    from coordination.records import publish_record, try_read

    layout = RunLayout(log_path)
    run = try_read(layout.run_json, kind="run")
    if run is None:
        raise click.ClickException(f"no baton run in {log_path} (no readable run.json); check --log-path")
    if cancel:
        layout.stop_file.unlink(missing_ok=True)
        click.echo(f"stop request withdrawn in {log_path}")
        return
    publish_record(layout.stop_file, "stop", {"by": f"{socket.gethostname()}:{os.getpid()}"},
                   run_id=run.run_id, generation=0)
    click.echo(f"stop requested: the run in {log_path} ends after its current iteration "
               f"(withdraw with: python -m coordination stop --log-path {log_path} --cancel)")


@main.command()
@LOG_PATH
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="folder for the PNGs and summary.md (default: <log-path>/report)")
@click.option("--json", "as_json", is_flag=True, help="print the per-iteration rows as JSON")
@click.option("--table", is_flag=True, help="also print the per-iteration table")
def report(log_path: Path, out: Path | None, as_json: bool, table: bool) -> None:
    """Learning curves, a per-rank phase timeline, throughput and loss as PNGs plus a Markdown summary."""
    import json

    from coordination.report import make_report, print_table

    try:
        res = make_report(log_path, out)
    except FileNotFoundError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    if table:
        print_table(res["rows"])
    click.echo(f"report written to {res['out']}: {', '.join(Path(p).name for p in res['pngs'])} and summary.md")


if __name__ == "__main__":
    sys.exit(main())
