"""The fenced-zombie scenario, shared by the local-disk and the sshfs tiers: a paused and replaced
node, once woken, changes nothing under the log path, neither itself nor through its children."""
from __future__ import annotations

import signal
import time
from pathlib import Path

from coordination import exits
from coordination.layout import RunLayout
from tests.procs import bench_node, wait_for_text

HB = ["--heartbeat-interval", "0.5", "--peer-timeout", "3", "--rejoin-timeout", "60"]


def listing(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every file and folder under `root` with its size, mtime (ns) and inode."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def zombie_changes_nothing(procs, local: Path, via: tuple[Path, Path, Path]) -> None:
    """Ranks 0, 1 and the replacement of 1 use the log paths `via` (one folder, maybe through
    different mounts); `local` is that folder as the test reads it.

    The worker is paused inside phase 1 while its work runs as a child that keeps printing (as a
    trainer or an inference server does; the pause stops the node, not its child); a new
    generation takes its rank; once that generation's claim exists, every other process of the
    run is paused too, so any change to the folder from then on is the zombie's or its child's."""
    slow = ["--slow", "1:1:8", "--slow-iterations", "1"]
    procs.start("r0", bench_node(via[0], 0, 2, 2, *HB, *slow))
    procs.start("r1", bench_node(via[1], 1, 2, 2, *HB, *slow, "--talker"))
    wait_for_text(procs, "r1", "working 8.0 s in phase 1", 60)
    job = RunLayout(local).job("both")
    trainer_log = job.log_file(1, "trainer")
    deadline = time.monotonic() + 30
    while b"talker at" not in (trainer_log.read_bytes() if trainer_log.exists() else b""):
        assert time.monotonic() < deadline, "the talker child never wrote to its log"
        time.sleep(0.05)
    procs.signal("r1", signal.SIGSTOP)
    wait_for_text(procs, "r0", "rank 1 lost", 30)
    procs.start("r1-new", bench_node(via[2], 1, 2, 2, *HB, *slow))
    wait_for_text(procs, "r1-new", "took over rank 1", 60)
    assert job.claim(1, 2).exists()
    procs.signal("r1-new", signal.SIGSTOP)
    procs.signal("r0", signal.SIGSTOP)
    time.sleep(0.2)  # let writes already issued land before the picture is taken
    before = listing(local)
    time.sleep(1.0)  # the zombie's child goes on printing meanwhile
    procs.signal("r1", signal.SIGCONT)
    assert procs.wait("r1", 30) == exits.FENCED, procs.log("r1")[-2000:]
    after = listing(local)
    changed = {k: (before.get(k), after.get(k)) for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    pids = {name: procs.procs[name].pid for name in ("r0", "r1", "r1-new")}
    assert changed == {}, (f"the fenced process or its child changed files under the log path: {changed} ({pids}); "
                           f"its log:\n{procs.log('r1')[-3000:]}")
    assert "taken over" in procs.log("r1")
    for name in ("r0", "r1-new"):
        procs.signal(name, signal.SIGCONT)
    codes = procs.wait_all(timeout=120)
    assert codes["r0"] == 0 and codes["r1-new"] == 0, procs.log("r1-new")[-2000:]
