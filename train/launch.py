"""The torchrun command line and environment every node runs for phase 10 (docs/design.md §10.2).

Rendezvous is c10d on the master's address: the master's agent hosts the store (`is_host=1`),
the others join it (`is_host=0`). With c10d, ranks are assigned in arrival order, so
`--node-rank` is informative only. `--local-addr` and GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
make a node advertise and bind the right interface on multi-homed hosts; without them gloo may
bind to 127.0.0.1 and peers time out. The driver runs the command in its own process group and
uses its exit code: non-zero on every node when any rank fails. `exit_now` is how its workers
(the trainer, SFT) leave once their outputs are written; `run_worker` does the same for the
workers of the tests and the load-publish benchmark.
"""
from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Mapping


def torchrun_command(*, python: str, nnodes: int, node_rank: int, nproc_per_node: int, rdzv_endpoint: str,
                     rdzv_id: str, is_host: bool, local_addr: str | None, module: str, args: list[str],
                     join_timeout: int | None = None) -> list[str]:
    """argv of `python -m torch.distributed.run ... -m MODULE ARGS` (the interpreter's own torchrun)."""
    if nnodes < 1 or nproc_per_node < 1:
        raise ValueError(f"nnodes and nproc_per_node must be at least 1 (got {nnodes}, {nproc_per_node})")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be in [0, {nnodes}) (got {node_rank})")
    host, _, port = rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"rdzv_endpoint must be HOST:PORT (got {rdzv_endpoint!r})")
    conf = f"is_host={1 if is_host else 0}"
    if join_timeout is not None:
        conf += f",join_timeout={int(join_timeout)}"
    cmd = [python, "-m", "torch.distributed.run",
           "--nnodes", str(nnodes), "--node-rank", str(node_rank), "--nproc-per-node", str(nproc_per_node),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id,
           "--rdzv-conf", conf, "--max-restarts", "0"]
    if local_addr:
        cmd += ["--local-addr", local_addr]
    return cmd + ["-m", module, *args]


def torchrun_env(base_env: Mapping[str, str], *, omp_threads: int, socket_ifname: str | None) -> dict[str, str]:
    """`base_env` plus OMP_NUM_THREADS (oversubscribed threads triple step time on small nodes)
    and the socket interface for gloo and NCCL when one is given."""
    if omp_threads < 1:
        raise ValueError(f"omp_threads must be at least 1 (got {omp_threads})")
    env = dict(base_env)
    env["OMP_NUM_THREADS"] = str(omp_threads)
    if socket_ifname:
        env["GLOO_SOCKET_IFNAME"] = socket_ifname
        env["NCCL_SOCKET_IFNAME"] = socket_ifname
    return env


def exit_now(code: int) -> None:
    """Leave a torchrun worker without the interpreter's finalization. By then its outputs are
    published (fsync, then rename) and the process group is destroyed, but torch's gloo threads
    can still abort finalization ("terminate called without an active exception", SIGABRT; seen
    on 2-process CPU runs of the trainer and of SFT right after their checkpoints were written),
    which turned a finished run into a failed one. Logs and standard streams are flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_worker(fn, *args) -> None:
    """A torchrun worker's `__main__`: run `fn(*args)`, print any traceback, and leave through
    `exit_now` (0 on success, 1 on an exception, a SystemExit's own code), so that the gloo
    finalization abort cannot turn a finished worker into a failed one."""
    try:
        fn(*args)
    except SystemExit as stop:
        exit_now(stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1))
    except BaseException:
        traceback.print_exc()
        exit_now(1)
    exit_now(0)
