"""The trainer's lifecycle on one node (docs/design.md §6 phases 0, 9, 10 and 12; §9.6): where the
torchrun agents of an attempt meet, when the resident trainer is launched (early, at phase 0's GO,
or at phase 10), the orders it gets, whether it is ready, its results, that it released the
devices before the engine wakes, and its stop. The driver only says which step needs what."""
from __future__ import annotations

import logging
import os
import socket
from typing import Callable

from coordination import exhaustion, exits
from coordination.barrier import Arrival
from coordination.children import ChildFailed
from coordination.manifest import read_master
from coordination.net import free_port
from coordination.phases import PhaseId
from coordination.runner import Step
from rl.payloads import Rendezvous, SyncGo, TrainerReady
from rl.plan import RunPlan
from train.launch import torchrun_env
from train.memory_plan import gpu_visible
from train.resident import ResidentTrainer
from train.results import read_results

log = logging.getLogger("baton.driver")


def own_address(master_addr: str) -> str:
    """This node's address on the route to the master (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((master_addr, 9))
            return s.getsockname()[0]
        except OSError:
            return master_addr


class TrainerLifecycle:
    """One node's trainer across iterations. With train.resident (the default) one torchrun per
    launch serves many iterations through orders; without it phase 10 runs one torchrun per
    attempt, for which the lifecycle gives only the rendezvous, command, log and earlier results.
    `trainer` is None until a launch."""

    def __init__(self, node, plan: RunPlan, *, beside_engine: bool):
        self.node, self.plan, self.cfg = node, plan, plan.cfg
        self.layout = node.layout
        # An engine on this node shares the trainer's devices between iterations: the trainer
        # releases them after each iteration (when asked to) and loads its model only after phase 7.
        self.beside_engine = beside_engine
        self.log_file = node.job.log_file(node.rank, "trainer")
        self.trainer: ResidentTrainer | None = None
        self._early_launches: set[str] = set()  # the early rendezvous ids this process acted on
        self._release_due: int | None = None  # the iteration after which the devices must be released

    @property
    def world_size(self) -> int:
        return self.plan.args.num_nodes * self.cfg.train.nproc_per_node

    # -- launch --------------------------------------------------------------------------------
    def rendezvous(self, iteration: int, attempt: int, *, early: bool = False) -> dict:
        """Where torchrun's agents meet for one attempt (or, `early`, for the launch at phase 0): a
        fresh port and rendezvous id each time (a Rendezvous record, as a GO payload)."""
        addr = read_master(self.node.job, self.node.run_id)["addr"]
        name = "early" if early else f"a{attempt}"
        return Rendezvous(addr=addr, port=free_port(addr), attempt=attempt,
                          rdzv_id=f"{self.node.run_id}-{self.node.job.name}-i{iteration}-{name}").to_dict()

    def command(self, step: Step, rdzv: Rendezvous) -> tuple[list[str], dict[str, str]]:
        """This node's phase-10 torchrun command and environment for the rendezvous `rdzv`."""
        is_host = self.node.is_master
        cmd = self.plan.torchrun_argv(self.layout, step.iteration, step.attempt, self.node.rank,
                                      endpoint=rdzv.endpoint, rdzv_id=rdzv.rdzv_id,
                                      is_host=is_host, local_addr=rdzv.addr if is_host else own_address(rdzv.addr))
        env = torchrun_env(os.environ, omp_threads=int(os.environ.get("OMP_NUM_THREADS", "1")),
                           socket_ifname=self.cfg.coordination.socket_ifname or None)
        return cmd, env

    def launch_early(self, step: Step, inputs: Callable[[], dict]) -> None:
        """At this node's first action after phase 0's GO named an early rendezvous: launch the
        resident trainer now, so that torchrun, the imports and the rendezvous (and, where
        `may_load_early`, the model load of `inputs()`, the model inputs phase 8's plan will name)
        overlap the rollouts instead of opening phase 10 (docs/design.md §9.6). Phase 9 decides as
        always: every node reuses this launch only if all of them report it alive, else all launch
        anew. A GO decided before this process joined (it restarted mid-iteration) launches nothing."""
        asked = SyncGo.of(step).trainer
        rdzv = Rendezvous.from_dict(asked) if asked else None
        if rdzv is None or rdzv.rdzv_id in self._early_launches:
            return
        self._early_launches.add(rdzv.rdzv_id)
        mine = step.gos[PhaseId.SYNC].arrivals.get(str(self.node.rank)) or {}
        if mine.get("generation") != self.node.generation:
            return
        if self.trainer is None:
            self.trainer = ResidentTrainer(self.node, self.log_file)
        cmd, env = self.command(step, rdzv)
        try:
            self.trainer.launch(cmd, env, rdzv.rdzv_id)
        except OSError as exc:
            if exits.classify(exc) == exits.RESOURCE:
                raise  # phase 10 would fail the same way: this node stops now (exit 8)
            log.warning("could not launch the resident trainer early (%s); phase 10 launches it", exc)
            return
        if self.may_load_early():
            self.trainer.order(prepare=inputs())

    def may_load_early(self) -> bool:
        """Whether an early trainer may load its model while the engine serves: only where it takes
        no accelerator memory the engine needs (a job without an engine, or a node without a GPU).
        Else it loads at its first order, after phase 7 stopped or slept the engine."""
        return not self.beside_engine or not gpu_visible()

    # -- readiness -----------------------------------------------------------------------------
    def ready(self) -> dict:
        """Phase 0 and phase 9 arrival: the launch this node's resident trainer serves, if one is alive."""
        return TrainerReady(self.trainer.alive() if self.trainer is not None else None).to_dict()

    def common_launch(self, arrivals: dict[int, Arrival]) -> str | None:
        """The launch every node's arrival (TrainerReady) names as its live trainer, if they agree."""
        launches = {TrainerReady.from_dict(a.payload).trainer for a in arrivals.values()}
        if len(launches) == 1 and None not in launches and len(arrivals) == self.plan.args.num_nodes:
            return launches.pop()
        return None

    # -- orders and results --------------------------------------------------------------------
    def order(self, step: Step, rdzv: Rendezvous) -> None:
        """Phase 10: launch the trainer if the GO asks for a fresh rendezvous (or check that this
        node's trainer is the one the GO names), then order it to train the iteration's plan."""
        if self.trainer is None:
            self.trainer = ResidentTrainer(self.node, self.log_file)
        if rdzv.reuse is not None:
            if self.trainer.alive() != rdzv.reuse:
                raise ChildFailed(f"the resident trainer {rdzv.reuse} of this node is no longer running "
                                  f"(see {self.trainer.log_file}); the next attempt launches a fresh one")
        else:
            cmd, env = self.command(step, rdzv)
            self.node.say(f"launching the resident trainer ({rdzv.rdzv_id})", beat=True)
            self.trainer.launch(cmd, env, rdzv.rdzv_id)
        self.trainer.order(iteration=step.iteration, attempt=step.attempt,
                           plan=str(self.layout.training_plan(step.iteration)), offload=self._offload)

    @property
    def _offload(self) -> bool:
        return self.cfg.train.offload_between_iterations and self.beside_engine

    def results(self, step: Step, on_tick: Callable[[], None]) -> None:
        """Until every trainer rank wrote its result of the ordered attempt; `on_tick` runs between
        looks. A failed attempt ends this launch on every node: the retry rendezvous anew."""
        what = f"training (iteration {step.iteration}, attempt {step.attempt})"
        try:
            self.trainer.wait(lambda: read_results(self.layout, step.iteration, step.attempt, self.world_size,
                                                   run_id=self.node.run_id),
                              peers=range(self.plan.args.num_nodes), what=what, on_tick=on_tick)
        except BaseException as exc:
            self.trainer.stop()
            # A trainer's full disk rarely names a file (safetensors: "os error 28"): name where it writes.
            short = exhaustion.of(exc, self.layout.checkpoint_staging(step.iteration, step.attempt))
            if short is not None:
                raise short from exc
            raise
        self._release_due = step.iteration if self._offload else None

    def failed_before(self, step: Step) -> str | None:
        """An error a trainer rank recorded for this attempt before this process ran it. A node that
        stopped on a full disk (exit 8) did not arrive, so its restart runs the same attempt again,
        where that old result would fail every new trainer at once, however much space was freed.
        That attempt has failed: reported, the master's decision moves on to the next one."""
        errors = read_results(self.layout, step.iteration, step.attempt, self.world_size,
                              run_id=self.node.run_id)["errors"]
        if not errors:
            return None
        rank, error = sorted(errors.items())[0]
        return (f"attempt {step.attempt} failed before this process started (trainer rank {rank}: "
                f"{error.splitlines()[0] if error else 'failed'}); the next attempt trains afresh")

    # -- release and stop ----------------------------------------------------------------------
    def check_released(self, iteration: int) -> None:
        """The rule behind phase 12, called before the engine wakes or starts: an engine that shares
        the trainer's devices does so only after every local trainer process released its device
        memory. The trainer writes its result only after releasing (train_iteration), so phase 10's
        wait already orders the two; this check makes a break of that order an error instead of an
        out-of-memory wake."""
        if self._release_due != iteration or self.trainer is None:
            return  # this process ordered no offload for this iteration (not trained here, or none asked)
        held = self.trainer.unreleased(iteration, self.cfg.train.nproc_per_node)
        if held:
            raise RuntimeError(f"the engine must not start on the trainer's devices before every local trainer "
                               f"process released its memory after iteration {iteration}; still holding: "
                               f"{'; '.join(held)}")

    def close(self, finished: bool) -> None:
        """Stop this node's resident trainer: after a finished run through a stop order (its last
        optimizer state reaches the disk first), after anything else by its process group."""
        if self.trainer is None:
            return
        if finished:
            self.trainer.close(self.cfg.train.collective_timeout)
        else:
            self.trainer.stop()
