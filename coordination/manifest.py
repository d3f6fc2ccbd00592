"""Run identity and joining (docs/design.md §4, §5 rule 10).

- `run.json` (created once, O_EXCL, by the first master): run_id and the config hash it began with.
- `config.yaml`: the resolved config now in force. Only the master that won the exclusive create
  of run.json publishes it, right after (so two masters racing with different configs cannot
  leave a config.yaml that disagrees with run.json's hash; a creator that died in between is
  repaired by a master whose config has that hash). A change accepted with `--resume` is
  recorded under `config-changes/` and then replaces config.yaml, both only after the master has
  claimed rank 0 (`accept_resume`): a refused `--resume` changes nothing (docs/design.md §4).
- `jobs/<job>/job.json` (O_EXCL, by the job's master): num_nodes and rank weights.
- `jobs/<job>/master.json`: where the job's master is (address for torchrun, host, pid, generation).

Every node checks what it finds against what it was started with and refuses a mismatch with a
message that shows both values.
"""
from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from coordination.clock import Backoff, Clock
from coordination.config import dict_hash, differences, redact
from coordination.layout import JobLayout, RunLayout
from coordination.records import (RecordError, create_record, ensure_dir, is_temp_name, open_own, publish_bytes,
                                  publish_record, read_or_none)
from coordination.settle import DEFAULT_SETTLE, KEY as SETTLE_KEY, DamagedRecord, NotVisibleYet, read_settled

log = logging.getLogger("baton.manifest")

# Config keys that may differ between nodes without changing what the run computes.
# The API key is one too: each rank's server and its client are on one node, and a literal key
# is stored as *** in config.yaml, so it could not be compared anyway.
NODE_LOCAL_KEYS = ("logging", "coordination.master_addr", "coordination.socket_ifname", "inference.vllm.python",
                   "inference.vllm.env", "inference.vllm.api_key")


class JoinRefused(RuntimeError):
    """This node may not join the run in the log path; the message says why and what to do."""


class UnusableLogPath(JoinRefused):
    """--log-path cannot be created or written (a usage error: exit 2, no traceback)."""


def _unusable(root: Path, exc: OSError) -> UnusableLogPath:
    where = exc.filename or root
    why = {
        errno.EROFS: "is on a read-only filesystem; give a folder on a writable shared filesystem",
        errno.EACCES: f"is not writable by this user (uid {os.getuid()}); fix its permissions (for example "
                      f"`chmod u+rwx` on it, or g+rwx for your team's group) or give another --log-path",
        errno.EPERM: f"is not writable by this user (uid {os.getuid()}); fix its permissions or give another "
                     f"--log-path",
        errno.ENOTDIR: "has a part that is a file, not a folder; give a folder path",
        errno.ENOSPC: "is on a full filesystem (no space left); free space or give another --log-path",
        errno.EDQUOT: "is over its disk quota; free space or give another --log-path",
    }.get(exc.errno, f"cannot be written ({exc.strerror}); give a writable folder on the shared filesystem")
    return UnusableLogPath(f"--log-path {root}: {where} {why}")


@dataclass(frozen=True)
class ConfigChange:
    """A config change a `--resume` master asked for; applied by `accept_resume` once the master
    holds rank 0, never before."""

    config: dict
    from_hash: str
    to_hash: str
    changes: list[str]


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    config_hash: str
    created_by: str
    pending: ConfigChange | None = None  # --resume with another config: not yet published


def check_log_path_safe(root: Path) -> None:
    """The checks of `--log-path` that write nothing (the dry run makes them too; protocol rule 11)."""
    root = Path(os.path.abspath(root))
    if root.exists() and not root.is_dir():
        raise UnusableLogPath(f"--log-path {root} exists and is not a directory; give a folder on the shared "
                              f"filesystem")
    refuse_world_writable(root)
    refuse_open_parents(root)


def refuse_world_writable(root: Path) -> None:
    """Anyone on the cluster could forge coordination files in a world-writable run folder."""
    if not root.is_dir():
        return
    mode = root.stat().st_mode
    if mode & stat.S_IWOTH:
        raise JoinRefused(
            f"--log-path {root} is world-writable (mode {stat.filemode(mode)}); anyone on the cluster could "
            f"forge coordination files. Run `chmod o-w {root}` (and keep it group-writable for your team) and "
            f"retry.")


def refuse_open_parents(root: Path) -> None:
    """In a world-writable folder without the sticky bit anyone may rename what another user made,
    so they could move the run folder away and put their own in its place (/tmp's 1777 is fine)."""
    for parent in root.parents:
        try:
            mode = parent.stat().st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue  # created by this process with DIR_MODE; an unusable part is found by the write probe
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            raise JoinRefused(
                f"--log-path {root}: the folder {parent} above it is world-writable without the sticky bit (mode "
                f"{stat.filemode(mode)}); anyone on the cluster could rename the run folder away and put their own "
                f"in its place. Run `chmod o-w {parent}` (or `chmod +t {parent}`, as /tmp has) or give another "
                f"--log-path.")


def check_log_path(root: Path) -> None:
    """`check_log_path_safe`, then create the run directory if needed and prove it takes a real
    write. A refusal leaves nothing behind: folders this call created are removed again."""
    root = Path(root)
    check_log_path_safe(root)
    absolute = Path(os.path.abspath(root))
    created = [p for p in [absolute, *absolute.parents] if not os.path.lexists(p)]
    try:
        ensure_dir(root)
        # A real write, not os.access: access() answers for the real uid and misses ACLs, root
        # squashing on NFS and quotas. The probe has a temp name, so `recover` knows it too.
        probe = RunLayout(root).write_probe(socket.gethostname(), os.getpid(), uuid.uuid4().hex[:8])
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        for folder in created:  # deepest first; only empty ones, and only those this call made
            try:
                os.rmdir(folder)
            except OSError:
                break
        raise _unusable(root, exc) from None


def _hash_of(config: dict) -> str:
    return dict_hash(config, NODE_LOCAL_KEYS)


def read_config_yaml(layout: RunLayout) -> dict | None:
    try:
        with open_own(layout.config_yaml, "rb") as fh:  # a linked config.yaml is not this run's
            text = fh.read().decode("utf-8")
    except FileNotFoundError:
        return None
    data = yaml.safe_load(text)
    return data if isinstance(data, dict) else None


def _settled_run(layout: RunLayout, *, settle: float, exists: bool, clock: Clock | None) -> RunInfo | None:
    """run.json as soon as this mount shows it (coordination.settle): None when there is none;
    JoinRefused (exit 3) when it stays invisible past `settle` or cannot be a run record."""
    try:
        rec = read_settled(layout.run_json, kind="run", settle=settle, exists=exists, clock=clock)
    except NotVisibleYet as exc:
        raise JoinRefused(str(exc)) from None
    except DamagedRecord as exc:
        raise JoinRefused(f"{exc}; it is not a baton run: inspect it, or use an empty --log-path") from None
    if rec is None:
        return None
    return RunInfo(rec.run_id, rec.data["config_hash"], rec.data.get("created_by", "?"))


def _foreign_entries(layout: RunLayout) -> list[str]:
    # config.yaml alone is what earlier versions left when a master died between writing it and
    # run.json; it is replaced by the new run's own.
    return sorted(n for n in os.listdir(layout.root)
                  if not is_temp_name(n) and n != layout.config_yaml.name)


def open_run_as_master(layout: RunLayout, config: dict, *, resume: bool, settle: float = DEFAULT_SETTLE,
                       clock: Clock | None = None) -> RunInfo:
    """Create the run, or join/resume the one already in the log path. `settle` bounds the wait
    for a run.json (and config.yaml) another master has just created to show on this mount."""
    check_log_path(layout.root)
    new_hash = _hash_of(config)
    info = _settled_run(layout, settle=settle, exists=False, clock=clock)
    if info is None:
        stray = _foreign_entries(layout)
        # run.json listed although this mount's lookup found none: another master created it a
        # moment ago (or this mount's entry cache still hides it). Not foreign files: the
        # exclusive create below loses and reads that run, or finds it is no baton run.
        if stray and layout.run_json.name not in stray:
            raise JoinRefused(
                f"--log-path {layout.root} is not empty ({', '.join(stray[:5])}{' ...' if len(stray) > 5 else ''}) "
                f"and holds no baton run; choose an empty folder for a new run")
        run_id = uuid.uuid4().hex[:12]
        me = f"{socket.gethostname()}:{os.getpid()}"
        if create_record(layout.run_json, "run", {"config_hash": new_hash, "created_by": me},
                         run_id=run_id, generation=0):
            # Only the winner of the exclusive create publishes config.yaml: a loser with another
            # config must not overwrite what run.json's hash describes.
            _publish_config(layout, config)
            log.info("created run %s in %s", run_id, layout.root)
            return RunInfo(run_id, new_hash, me)
        # Another master created it a moment ago: this mount may not show it (or its content) yet.
        info = _settled_run(layout, settle=settle, exists=True, clock=clock)
    pending = _check_or_resume_config(layout, info, config, resume=resume, role="master", settle=settle, clock=clock)
    return RunInfo(info.run_id, info.config_hash, info.created_by, pending)


def accept_resume(layout: RunLayout, info: RunInfo) -> None:
    """Record and publish the config change of a `--resume` master. Called once the master holds
    rank 0: a resume refused earlier (a live master, other job facts) leaves config.yaml and
    config-changes/ as they were."""
    change = info.pending
    if change is None:
        return
    n = layout.config_change_count() + 1
    publish_record(layout.config_change(n), "config-change",
                   {"from_hash": change.from_hash, "to_hash": change.to_hash, "changes": change.changes,
                    "by": f"{socket.gethostname()}:{os.getpid()}"}, run_id=info.run_id, generation=0)
    _publish_config(layout, change.config)
    log.warning("--resume: continuing run %s with a changed config (recorded in %s):\n  %s",
                info.run_id, layout.config_change(n), "\n  ".join(change.changes[:20]))


def _run_config(layout: RunLayout, info: RunInfo) -> dict | None:
    """config.yaml for the join checks: None while this mount shows no file (or an empty one);
    JoinRefused at once for content that is not a YAML mapping, which no cache expiry repairs
    (it is published by rename, so it is never seen half-written)."""
    try:
        raw = layout.config_yaml.read_bytes()
    except FileNotFoundError:
        return None
    if not raw.replace(b"\0", b"").strip():
        return None
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        data, problem = None, f"not valid YAML ({str(exc).splitlines()[0]})"
    else:
        problem = f"a YAML {type(data).__name__}, not a mapping of config keys"
    if not isinstance(data, dict):
        raise JoinRefused(f"{layout.config_yaml} is damaged: {problem}. Inspect it; to restore it, remove it and "
                          f"start the run's master with the config of hash {info.config_hash}, which writes it again")
    return data


def _wait_config_yaml(layout: RunLayout, info: RunInfo, settle: float, clock: Clock | None) -> dict | None:
    """config.yaml of a run whose creator has just made run.json (it publishes config.yaml next);
    a mount may hide the new name for as long as its entry cache lasts, hence `settle`."""
    clock, backoff = clock or Clock(), Backoff(0.02, 0.5)
    deadline = clock.monotonic() + settle
    while True:
        current = _run_config(layout, info)
        if current is not None or clock.monotonic() > deadline:
            return current
        clock.sleep(backoff.next())


def join_run_as_worker(layout: RunLayout, config: dict, *, join_timeout: float, clock: Clock | None = None,
                       poll_max: float = 1.0, settle: float = DEFAULT_SETTLE) -> RunInfo:
    """Wait (bounded) for the master's run manifest, then check this node's config against it.
    `join_timeout` bounds the wait for the master to create it; `settle` the wait for a run.json
    that exists to show its content on this mount."""
    clock = clock or Clock()
    check_log_path(layout.root)
    deadline = clock.monotonic() + join_timeout
    backoff = Backoff(0.05, poll_max)
    next_note = clock.monotonic() + 30
    said_config = False
    while True:
        info = _settled_run(layout, settle=settle, exists=False, clock=clock)
        if info is not None and layout.config_yaml.exists():
            break
        if info is not None and not said_config:
            # The master publishes config.yaml right after run.json; a wait here is this mount's
            # entry cache or a master that stopped in between: say so now, not after 30 s.
            said_config = True
            log.info("found run %s; %s is not visible on this mount yet, waiting for it (up to %.0f s, "
                     "coordination.join_timeout)", info.run_id, layout.config_yaml, deadline - clock.monotonic())
        now = clock.monotonic()
        if now > deadline:
            raise JoinRefused(
                f"no run manifest appeared at {layout.run_json} within {join_timeout:.0f} s (coordination.join_timeout). "
                f"Is the master running with --log-path {layout.root}, and is that folder the same shared "
                f"filesystem on both nodes (the same NFS/Lustre mount, not a local folder of the same name)?")
        if now >= next_note:
            log.info("waiting for the master to create %s (%.0f s left)",
                     layout.config_yaml if info is not None else layout.run_json, deadline - now)
            next_note = now + 30
        clock.sleep(backoff.next())
    _check_or_resume_config(layout, info, config, resume=False, role="worker", settle=settle, clock=clock)
    return info


def _check_or_resume_config(layout: RunLayout, info: RunInfo, config: dict, *, resume: bool, role: str,
                            settle: float, clock: Clock | None) -> ConfigChange | None:
    """None when `config` matches the run's; the change to make when a master resumes with
    another config (published later, by `accept_resume`); JoinRefused otherwise."""
    current = _run_config(layout, info)
    if current is None and _hash_of(config) == info.config_hash and role == "master" and \
            not layout.config_changes_dir.exists():
        # The creator died between run.json and config.yaml: this config is the one run.json names.
        _publish_config(layout, config)
        return None
    if current is None:
        current = _wait_config_yaml(layout, info, settle, clock)
    if current is None:
        raise JoinRefused(
            f"{layout.config_yaml} is not yet visible on this mount (attribute cache) after {settle:.0f} s "
            f"({SETTLE_KEY}): retry in a minute. If it stays missing, the run's creator stopped between run.json "
            f"and config.yaml: start its master with the config of hash {info.config_hash} (this node's is "
            f"{_hash_of(config)}) to restore it")
    if _hash_of(current) == _hash_of(config):
        return None
    diff = differences(current, config, NODE_LOCAL_KEYS)
    shown = "\n  ".join(diff[:20])
    if not resume or role != "master":
        how = ("start the master with --resume to continue this run with the new config, or use a new --log-path"
               if role == "master" else
               "start this node with exactly the master's config and key=value overrides")
        raise JoinRefused(
            f"this node's config differs from the run in {layout.root} (run {info.run_id}, config hash "
            f"{_hash_of(current)} there, {_hash_of(config)} here):\n  {shown}\n{how}")
    return ConfigChange(config, _hash_of(current), _hash_of(config), diff)


def _publish_config(layout: RunLayout, config: dict) -> None:
    publish_bytes(layout.config_yaml, yaml.safe_dump(redact(config), sort_keys=False).encode())


# -- jobs ------------------------------------------------------------------------------------

def ensure_job(job: JobLayout, run_id: str, facts: dict[str, Any], *, master: bool, settle: float = DEFAULT_SETTLE,
               clock: Clock | None = None) -> dict[str, Any]:
    """The job's master creates job.json once; everyone else (and a restarted master) must agree.

    A mount that looked the name up while the exclusive create's content was on its way can show
    the file empty until its attribute cache expires: job.json is read again for up to `settle`
    seconds (coordination.settle). (A second master racing the first lands here and is then
    refused by the rank claim, which names the live holder.)"""
    if master:
        create_record(job.job_json, "job", facts, run_id=run_id, generation=0)
    try:
        # The master created it or lost that create to another master: either way it exists.
        rec = read_settled(job.job_json, kind="job", run_id=run_id, settle=settle, exists=master, clock=clock)
    except NotVisibleYet as exc:
        raise JoinRefused(str(exc)) from None
    except DamagedRecord as exc:
        raise JoinRefused(f"{exc}; the run's job {job.name} cannot be read: use a new --log-path") from None
    except RecordError as exc:  # a valid job.json of another run
        raise JoinRefused(f"cannot read {job.job_json}: {exc}. Is the master of job {job.name} running?") from None
    if rec is None:
        raise JoinRefused(f"cannot read {job.job_json}: it does not exist. Is the master of job {job.name} running?")
    theirs = rec.data
    bad = [f"{k}: {theirs.get(k)!r} in the run, {v!r} here" for k, v in facts.items() if theirs.get(k) != v]
    if bad:
        raise JoinRefused(f"job {job.name} in {job.run.root} was started with other settings:\n  " + "\n  ".join(bad) +
                          "\nstart this node with the same --num-nodes and --rank-weights as the master, "
                          "or use a new --log-path")
    return theirs


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr in ("localhost",)


def master_address(configured: str) -> str:
    """The address workers use to reach this master: the configured one, else the address of the
    interface that carries the default route (a UDP connect sends nothing), else what the host
    name resolves to. Many clusters map the host name to 127.0.1.1 in /etc/hosts, hence the
    route first; a loopback result is refused by workers on other hosts (check_master_reachable)."""
    if configured:
        return configured
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            addr = s.getsockname()[0]
            if addr and addr != "0.0.0.0":
                return addr
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def publish_master(job: JobLayout, run_id: str, generation: int, addr: str) -> None:
    publish_record(job.master_json, "master",
                   {"host": socket.gethostname(), "addr": addr, "pid": os.getpid()},
                   run_id=run_id, generation=generation)


def read_master(job: JobLayout, run_id: str) -> dict | None:
    rec = read_or_none(job.master_json, kind="master", run_id=run_id)
    return None if rec is None else dict(rec.data, generation=rec.generation)


def check_master_reachable(master: dict) -> None:
    """Refuse a loopback master address seen from another host (protocol rule 10)."""
    if _is_loopback(master["addr"]) and master["host"] != socket.gethostname():
        raise JoinRefused(
            f"the master (host {master['host']}) advertises the loopback address {master['addr']}, which this "
            f"host ({socket.gethostname()}) cannot reach. Set coordination.master_addr=<the master's address on "
            f"the cluster network> on the master (for example its InfiniBand or Ethernet IP) and restart it.")
