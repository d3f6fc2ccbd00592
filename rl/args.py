"""What one `scripts/run.sh` invocation asked for, once its flags are parsed and checked
(rl/run_cli.py builds it). Its own module so that the plan, the dry run and the driver read the
arguments without importing the CLI, and the CLI stays the one module that imports the driver."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rl.jobs import JobKind


@dataclass
class RunArgs:
    data_path: Path
    log_path: Path
    kind: JobKind  # the job the flags select (rl/jobs.py): its name names the job everywhere
    eval_interval: int | None
    num_nodes: int
    rank_weights: list[float]
    rank: int
    debug_mode: bool = False
    resume: bool = False
    dry_run: bool = False
    configs: list[Path] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)
    command: str = ""
    bench: dict | None = None  # --bench: the trainer's --bench-* options (kind is BENCH)

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def config_flags(self) -> dict:
        """The flags that are config keys (so every node must agree on them), as typed; the user's
        key=value overrides come after them."""
        flags: dict = {"run.data_path": str(self.data_path)}
        if self.eval_interval is not None:
            flags["run.eval_interval"] = self.eval_interval
        return flags
