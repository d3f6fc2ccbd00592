"""Joining a job: the sequence every rank goes through before its first phase.

master: create or join the run (run.json, config.yaml), create job.json, claim rank 0, then
        publish a --resume config change and master.json.
worker: wait (bounded) for the run manifest and job.json, check its config and job facts
        against them, claim its rank, wait for master.json and check it can reach the master.
"""
from __future__ import annotations

import logging
from typing import Any

from coordination.clock import Backoff, Clock
from coordination.config import CoordinationConfig
from coordination.layout import RunLayout
from coordination.manifest import (JoinRefused, accept_resume, check_master_reachable, ensure_job,
                                   join_run_as_worker, master_address, open_run_as_master, publish_master,
                                   read_master)
from coordination.node import Node

log = logging.getLogger("baton.join")


def _wait(clock: Clock, timeout: float, what: str, probe, poll_max: float):
    deadline = clock.monotonic() + timeout
    backoff = Backoff(0.05, poll_max)
    while True:
        value = probe()
        if value is not None:
            return value
        if clock.monotonic() > deadline:
            raise JoinRefused(what)
        clock.sleep(backoff.next())


def join_job(layout: RunLayout, *, job: str, rank: int, num_nodes: int, job_facts: dict[str, Any],
             config: dict, cfg: CoordinationConfig, resume: bool = False, command: str = "",
             clock: Clock | None = None) -> Node:
    clock = clock or Clock()
    if not 0 <= rank < num_nodes:
        raise JoinRefused(f"rank {rank} is outside 0..{num_nodes - 1} for {num_nodes} nodes")
    master = rank == 0
    # Records another node has just created may show stale on this mount for as long as its
    # attribute cache lasts: the config's bound for unreadable records bounds those waits.
    settle = cfg.broken_record_timeout
    if master:
        info = open_run_as_master(layout, config, resume=resume, settle=settle, clock=clock)
    else:
        info = join_run_as_worker(layout, config, join_timeout=cfg.join_timeout, clock=clock, poll_max=cfg.poll_max,
                                  settle=settle)
    jl = layout.job(job)
    facts = dict(job_facts, num_nodes=num_nodes)
    if not master:
        _wait(clock, cfg.join_timeout,
              f"the master of job {job} did not create {jl.job_json} within {cfg.join_timeout:.0f} s; is it running "
              f"with --rl-phase {job} and --log-path {layout.root}?",
              lambda: True if jl.job_json.exists() else None, cfg.poll_max)
    ensure_job(jl, info.run_id, facts, master=master, settle=settle, clock=clock)
    node = Node.join(layout, job, rank, num_nodes, run_id=info.run_id, cfg=cfg, command=command, clock=clock)
    try:
        if master:
            # Only now, with rank 0 held: a --resume refused above has changed nothing.
            accept_resume(layout, info)
            publish_master(jl, info.run_id, node.generation, master_address(cfg.master_addr))
        else:
            m = _wait(clock, cfg.join_timeout,
                      f"no master.json from the master of job {job} within {cfg.join_timeout:.0f} s "
                      f"({jl.master_json}); is the master running with the same --log-path?",
                      lambda: read_master(jl, info.run_id), cfg.poll_max)
            check_master_reachable(m)
    except BaseException:
        node.close("failed", "could not join")
        raise
    log.info("joined run %s job %s as %s (generation %d) in %s", info.run_id, job, node.role, node.generation,
             layout.root)
    return node
