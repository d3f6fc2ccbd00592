"""Waits between the jobs of a pipelined run (docs/design.md §6): a rollout job and an update job on one
log path meet only in rollouts/ and checkpoints/. Each wait watches the other job's master,
so a dead update job is reported instead of waited for forever."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from coordination.checkpoints import read_latest
from coordination.heartbeat import LivenessTracker
from coordination.node import PeerLost
from coordination.records import read_or_none
from rl.jobs import PRODUCER, JobKind

if TYPE_CHECKING:
    from rl.driver import RLJob

log = logging.getLogger("baton.pipeline")


class OtherJobWatch:
    """Judges the master of another job of the same run on this node's clock."""

    def __init__(self, rl: "RLJob", other: JobKind):
        self.rl, self.other_kind = rl, other
        self.other = rl.layout.job(other.name)
        node = rl.node
        self.tracker = LivenessTracker(node.cfg.peer_timeout, node.clock)
        self.lost_since: float | None = None

    def __call__(self) -> None:
        node = self.rl.node
        view = self.tracker.read(self.other.heartbeat(0), 0, run_id=node.run_id)
        now = node.clock.monotonic()
        if not (view.lost or view.exited):
            if self.lost_since is not None:
                log.warning("the %s job's master is back", self.other.name)
            self.lost_since = None
            return
        if self.lost_since is None:
            self.lost_since = now
            state = "not started" if view.record is None else ("gone" if view.exited else "lost")
            log.error("the master of the %s job is %s (%s); this job waits for its output. Start or restart it "
                      "with %s and the same --log-path. Waiting up to %.0f s.", self.other.name, state,
                      view.describe(), self.other_kind.flags,
                      node.cfg.rejoin_timeout)
        elif now - self.lost_since > node.cfg.rejoin_timeout:
            raise PeerLost(f"the master of the {self.other.name} job did not come back within "
                           f"{node.cfg.rejoin_timeout:.0f} s ({view.describe()})")


def wait_for_checkpoint(rl: "RLJob", need: int) -> None:
    """Rollout/eval job master: wait until LATEST is at least iteration `need`."""
    if need <= 0:
        return
    def probe():
        latest = read_latest(rl.layout, run_id=rl.node.run_id)
        return True if latest is not None and latest[0] >= need else None

    rl.node.say(f"waiting for checkpoint iteration >= {need} from the update job", beat=True)
    rl.node.wait_for(probe, what=f"checkpoint iteration {need} or newer (max_staleness "
                                 f"{rl.cfg.run.max_staleness})", peers=lambda: [],
                     dirs=[rl.layout.checkpoints_dir], watch=OtherJobWatch(rl, PRODUCER["checkpoint"]))


def wait_for_rollouts(rl: "RLJob", iteration: int) -> None:
    """Update job master: wait until the train rollouts of `iteration` are aggregated."""
    path = rl.layout.rollout_stats("train", iteration)

    def probe():
        return True if read_or_none(path, run_id=rl.node.run_id) is not None else None

    rl.node.say(f"waiting for the train rollouts of iteration {iteration}", beat=True)
    rl.node.wait_for(probe, what=f"the rollout job's train rollouts of iteration {iteration} ({path})",
                     peers=lambda: [], dirs=[path.parent], watch=OtherJobWatch(rl, PRODUCER["rollouts"]))
