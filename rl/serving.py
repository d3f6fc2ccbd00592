"""The inference engine's lifecycle on one node (docs/design.md §6 phases 7 and 12): which policy it
serves, when it is built, started, paused for training, swapped to a new checkpoint, and stopped
at the end."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from coordination.checkpoints import serving_weights
from coordination.procgroup import START_TIMEOUT
from rollout import engines
from rollout.engine import Engine
from rollout.inference import InferenceConfig

log = logging.getLogger("baton.driver")


class EngineLifecycle:
    """One node's inference engine across iterations. Built on first use; `served` is the policy
    iteration it serves, so asking for the same policy again does nothing."""

    def __init__(self, cfg: InferenceConfig, *, rank: int, temperature: float, log_file: Path, debug_mode: bool,
                 say: Callable[..., None], start_timeout: float = START_TIMEOUT):
        self.cfg, self.rank, self.temperature = cfg, rank, temperature
        self.start_timeout = start_timeout  # coordination.child_start_timeout, for a server's launch
        self.log_file, self.debug_mode, self.say = log_file, debug_mode, say
        self.engine: Engine | None = None
        self.starts = 0  # engine starts on this node: each gets its own server seed
        self.served: int | None = None

    def ensure(self, policy_iteration: int, path: Path) -> None:
        """Serve checkpoint (or base model) `path` as policy `policy_iteration`: start the engine, or
        swap its weights the way inference.between_iterations says."""
        if self.engine is None:
            # Looked up on the module at call time, so a test can hand in its own engine.
            self.engine = engines.make_engine(self.cfg, rank=self.rank, restart_count=self.starts,
                                              temperature=self.temperature, log_file=self.log_file,
                                              debug_mode=self.debug_mode, start_timeout=self.start_timeout)
        if self.engine.running and self.served == policy_iteration:
            return
        weights, adapter = serving_weights(path)  # an adapters-only checkpoint: its base + adapter/
        self.say(f"starting the inference engine on policy {policy_iteration}", beat=True)
        if not self.engine.running:
            self.engine.start(weights)
            self.starts += 1
        elif self.cfg.between_iterations == "restart":
            self.engine.stop()
            self.engine.start(weights)
            self.starts += 1
        elif Path(self.engine.model_dir).resolve() != Path(weights).resolve():
            self.engine.reload(weights)  # with adapters the base stays: set_adapter swaps them in place
        self.engine.set_adapter(adapter)
        self.served = policy_iteration
        log.info("engine %s serves policy %d (%s%s)", self.engine.name, policy_iteration, weights,
                 f" + LoRA adapter {adapter}" if adapter else "")

    def pause(self, *, new_weights: bool) -> None:
        """Phase 7: free the devices for training the way inference.between_iterations says: stop the
        engine (restart) or put it to sleep (sleep); reload keeps it serving. `new_weights`: the
        next policy has other base weights, so a sleep need not keep the current ones."""
        if self.engine is None or not self.engine.running:
            return
        if self.cfg.between_iterations == "restart":
            self.engine.stop()
        elif self.cfg.between_iterations == "sleep":
            self.engine.sleep(new_weights=new_weights)

    def resume(self, policy_iteration: int, path: Path) -> None:
        """Phase 12: serve the new checkpoint: wake the engine phase 7 put to sleep, else `ensure`."""
        if self.cfg.between_iterations == "sleep" and self.engine is not None and self.engine.running:
            weights, adapter = serving_weights(path)
            self.engine.wake(weights)
            self.engine.set_adapter(adapter)
            self.served = policy_iteration
        else:
            self.ensure(policy_iteration, path)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop()
