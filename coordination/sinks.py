"""Metric sinks fed from the per-iteration metrics record, by the master: TensorBoard event files
(`logging.tensorboard: true`) and Weights & Biases (`logging.wandb.mode: offline` by default,
`online`, or `disabled`)."""
from __future__ import annotations

import logging
import os
import queue
import stat
import threading
import time
from pathlib import Path
from typing import Any

from coordination.layout import RunLayout, check_no_links, check_tree_has_no_links
from coordination.records import ensure_dir, fence_check

log = logging.getLogger("baton.sinks")

_writers: dict[str, Any] = {}


def scalars(rec: dict[str, Any]) -> dict[str, float]:
    """Flat name -> number view of a metrics record: top-level numbers, per-rank throughput
    and phase times (so TensorBoard shows stragglers)."""
    out: dict[str, float] = {}
    for k, v in rec.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("iteration", "policy_iteration"):
            out[f"run/{k}"] = float(v)
    for group in ("rollout_tokens_per_s", "trainer_tokens_per_s", "trainer_peak_memory_mb"):
        for rank, v in (rec.get(group) or {}).items():
            if isinstance(v, (int, float)):
                out[f"{group}/rank{rank}"] = float(v)
    for rank, phases in (rec.get("phase_seconds") or {}).items():
        for name, times in phases.items():
            for kind, secs in times.items():
                out[f"phase_{kind}_s/rank{rank}/{name}"] = float(secs)
    return out


class _Background:
    """One daemon thread that opens the sinks and writes to them, so that no phase waits for them
    (starting W&B took 6.7 s of the first phase 13 on the demo machine). Order is kept: tasks run
    one after another in the order they were given."""

    def __init__(self) -> None:
        self.tasks: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="metric-sinks", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            task = self.tasks.get()
            try:
                if task is None:
                    return
                task()
            except Exception as exc:  # noqa: BLE001 - a sink must not end the run; its files are extra copies
                log.warning("metric sink: %s: %s (metrics/iter-N.json has every value)", type(exc).__name__, exc)
            finally:
                self.tasks.task_done()

    def put(self, task) -> None:
        self.tasks.put(task)

    def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the queued tasks; True if all ran."""
        deadline = time.monotonic() + timeout
        while self.tasks.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self.tasks.unfinished_tasks


_background: _Background | None = None


def _worker() -> _Background:
    global _background
    if _background is None:
        _background = _Background()
    return _background


_prepared: set[Path] = set()  # run folders whose sink folders were checked by this process


def prepare_folders(cfg, layout: RunLayout) -> None:
    """Before a sink starts: refuse any link in the folders it writes into by names of its own
    (`layout.check_tree_has_no_links`, docs/design.md §5 rule 11), and point every folder W&B uses
    (its runs, cache, config, data and artifacts) into the run's `wandb/`, so that it writes
    nothing in the user's home. Called on the main thread by `start`, before the sinks' thread
    opens anything (environment changes are not safe beside a thread that reads them)."""
    if cfg.tensorboard:
        check_tree_has_no_links(layout.tensorboard_dir)
    if cfg.wandb.mode != "disabled":
        fold_core_log_links(layout)
        check_tree_has_no_links(layout.wandb_dir)
        os.environ.update({name: str(folder.absolute()) for name, folder in layout.wandb_folders().items()})
    _prepared.add(layout.root)


def _prepare_once(cfg, layout: RunLayout) -> None:
    if layout.root not in _prepared:
        prepare_folders(cfg, layout)


def fold_core_log_links(layout: RunLayout) -> None:
    """W&B's service links every W&B run's `logs/debug-core.log` to its own log in its cache folder
    (here `wandb/cache/wandb/logs/`), whatever the settings say. A run folder holds no links, so
    each such log is moved over its link: when the sinks close, and at the next start after a
    crash. A link that points anywhere else is not W&B's doing and stays for
    `check_tree_has_no_links` to refuse."""
    logs = os.path.abspath(layout.wandb_core_logs_dir)
    check_no_links(layout.wandb_runs_dir)
    check_no_links(Path(logs))
    if not layout.wandb_runs_dir.is_dir():
        return
    for entry in os.scandir(layout.wandb_runs_dir):
        link = os.path.join(entry.path, "logs", "debug-core.log")
        if not entry.is_dir(follow_symlinks=False) or os.path.islink(os.path.dirname(link)) \
                or not os.path.islink(link):
            continue
        target = os.path.normpath(os.path.join(os.path.dirname(link), os.readlink(link)))
        if os.path.dirname(target) != logs:
            continue
        fence_check()
        try:
            if stat.S_ISREG(os.lstat(target).st_mode):
                os.replace(target, link)  # the same file, now under the run's own W&B folder
        except FileNotFoundError:
            os.unlink(link)  # its log is gone: the link leads nowhere


def _open(cfg, layout: RunLayout) -> None:
    fence_check()  # event files live under the log path too (docs/design.md §5 rule 7)
    if cfg.tensorboard and "tb" not in _writers:
        from torch.utils.tensorboard import SummaryWriter

        # ensure_dir refuses a linked tensorboard/ (docs/design.md §5 rule 11)
        _writers["tb"] = SummaryWriter(log_dir=str(ensure_dir(layout.tensorboard_dir)))
    if cfg.wandb.mode != "disabled" and "wandb" not in _writers:
        import wandb

        ensure_dir(layout.wandb_dir)
        # No system metadata and no code capture: the metadata holds the command line, whose
        # key=value overrides may carry a literal secret (docs/design.md §5 rule 11). No links of
        # W&B's own (`latest-run`, `debug.log`), and never a `.wandb` folder in place of `wandb`.
        run = wandb.init(project=cfg.wandb.project, dir=str(layout.wandb_dir), mode=cfg.wandb.mode,
                         name=layout.root.name,
                         settings=wandb.Settings(x_disable_meta=True, disable_code=True, save_code=False,
                                                 symlink=False, use_dot_wandb=False))
        _writers["wandb"] = (run, layout)


def _write(cfg, layout: RunLayout, rec: dict[str, Any]) -> None:
    _open(cfg, layout)
    fence_check()
    values = scalars(rec)
    step = int(rec["iteration"])
    if "tb" in _writers:
        w = _writers["tb"]
        for k, v in values.items():
            w.add_scalar(k, v, step)
        w.flush()
    if "wandb" in _writers:
        _writers["wandb"][0].log(values, step=step)


def start(cfg, layout: RunLayout) -> None:
    """Check the sinks' folders now (a planted link refuses the node: LinkInRunFolder), then open
    the configured sinks in the background (the master calls it when it joins), so the first
    iteration's metrics find them ready."""
    if cfg.tensorboard or cfg.wandb.mode != "disabled":
        _prepare_once(cfg, layout)
        _worker().put(lambda: _open(cfg, layout))


def emit(cfg, layout: RunLayout, rec: dict[str, Any]) -> None:
    """Queue one iteration's metrics for the sinks; returns at once."""
    fence_check()
    if cfg.tensorboard or cfg.wandb.mode != "disabled":
        _prepare_once(cfg, layout)  # here, on the caller's thread, when start() was not called
        _worker().put(lambda: _write(cfg, layout, dict(rec)))


def close(timeout: float = 60.0) -> None:
    """Write what is queued, then flush and close the sinks (at the end of a run), all on the sinks'
    thread and within `timeout` seconds in total: W&B's `finish()` waits for its service process,
    and an end of run that waits on it without a bound could keep the master from exiting."""
    global _background
    if _background is None:
        return
    worker, _background = _background, None
    worker.put(_close_writers)
    if not worker.drain(timeout):
        log.warning("metric sinks did not finish within %.0f s; their last values may be missing "
                    "(metrics/iter-N.json has them)", timeout)
    worker.put(None)


def _close_writers() -> None:
    tb = _writers.pop("tb", None)
    if tb is not None:
        tb.close()
    opened = _writers.pop("wandb", None)
    if opened is not None:
        run, layout = opened
        run.finish()
        fold_core_log_links(layout)  # no link of W&B's stays in the run folder
