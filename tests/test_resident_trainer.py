"""The resident trainer (train.resident, docs/design.md §2 and §9.6) with real processes: one
torchrun per node across iterations, results equal to torchrun per iteration, kill -9 of a whole
node (in phase 1, mid-step, while the trainer idles) and of the trainer alone, the offload round
trip, and no trainer process left behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordination.layout import RunLayout
from coordination.records import try_read
from tests.e2e import check_complete_run, fresh_log, node_cmd
from tests.procs import ROOT, env
from tests.tolerance import float32_tolerance

FLAGS = ("--rl-phase", "both", "--eval-interval", "0", "--num-nodes", "2", "--rank-weights", "1,1")


def _results(lay: RunLayout, iterations: int, world: int = 2) -> dict[int, dict]:
    """Per iteration: the attempt whose results are all ok, and those results by trainer rank."""
    from train.results import KIND

    out = {}
    for it in range(1, iterations + 1):
        for attempt in range(1, 5):
            recs = [try_read(lay.training_result(it, attempt, r), kind=KIND) for r in range(world)]
            if all(r is not None and r.data["ok"] for r in recs):
                out[it] = {"attempt": attempt, "ranks": [r.data for r in recs]}
                break
    return out


def _trainer_states(lay: RunLayout, rank: int) -> list[dict]:
    from train.resident import STATE_KIND

    states = []
    for local in range(4):
        rec = try_read(lay.job("both").trainer_state(rank, local), kind=STATE_KIND)
        if rec is not None:
            states.append(rec.data)
    return states


def _alive(pid: int) -> bool:
    from coordination.claims import process_start

    return process_start(pid) is not None


def _kill_trainers_left(pids: set[int]) -> list[int]:
    """Kill (by pid) every trainer process still alive; returns those that were."""
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def _all_trainer_pids(lay: RunLayout, iterations: int) -> set[int]:
    pids = {s["pid"] for r in (0, 1) for s in _trainer_states(lay, r)}
    for res in _results(lay, iterations).values():
        pids |= {d["pid"] for d in res["ranks"]}
    return pids


def _wait(pred, what: str, procs, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what} never happened:\n{procs.log('n0')[-2000:]}"
        time.sleep(0.05)


def _close(a, b, length: int) -> None:
    """Equal up to float32 reductions of `length` terms summed in another order (tests/tolerance.py):
    the runs compute the same arithmetic; only where it happens (resident memory or a reload from
    the checkpoint's float32 files) differs."""
    import torch

    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    tol = float32_tolerance(float(max(a.abs().max(), b.abs().max(), 1e-30)), length)
    assert float((a - b).abs().max()) <= tol, f"differ by {float((a - b).abs().max())} > {tol}"


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_offload_round_trip_is_bit_identical_and_frees_the_storages():
    """Parameters, gradients and AdamW state leave their storages (0 bytes) and come back bit for bit."""
    import torch

    from train.offload import ResidentOffload

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 16)).pow(2).sum().backward()
        opt.step()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    state = {(id(p), k): v.clone() for p, s in opt.state.items() for k, v in s.items()}
    off = ResidentOffload([model], opt, torch.device("cpu"))
    off.to_host()
    # 4 parameters, 4 gradients, 8 AdamW moments; the step counters are 0-d and stay
    assert off.storages == 16
    assert off.moved_bytes == 4 * 4 * sum(p.numel() for p in model.parameters())  # 4 float32 copies of each
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    off.to_device()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    assert all(torch.equal(v, state[(id(p), k)]) for p, s in opt.state.items() for k, v in s.items())
    opt.step()  # and the optimizer still steps on the restored state
    assert not all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.slow
def test_two_nodes_resident_keep_their_trainers_and_equal_torchrun_per_iteration(procs, tmp_path, assets):
    data, model = assets
    over = ("run.max_iterations=3", "inference.between_iterations=reload")  # the same engine mode in both runs
    runs = {}
    try:
        for mode in ("true", "false"):
            log = fresh_log(tmp_path, f"resident-{mode}")
            o = (*over, f"train.resident={mode}")
            # The resident trainers hold iteration 2's offload back 3 s: the engine's swap must wait.
            hold = {"env": env(BATON_TEST_HOLD_OFFLOAD=f"2:{HELD_OFFLOAD_S}")} if mode == "true" else {}
            procs.start(f"n0-{mode}", node_cmd(data, model, log, *FLAGS, "--master", overrides=o), **hold)
            procs.start(f"n1-{mode}", node_cmd(data, model, log, *FLAGS, "--worker", "1", overrides=o), **hold)
            codes = procs.wait_all(900)
            assert set(codes.values()) == {0}, procs.log(f"n0-{mode}")[-3000:]
            runs[mode] = RunLayout(log)
        res, ref = _results(runs["true"], 3), _results(runs["false"], 3)
        # resident: the same two trainer processes served all three iterations
        assert {tuple(d["pid"] for d in res[it]["ranks"]) for it in (1, 2, 3)} == {tuple(d["pid"] for d in res[1]["ranks"])}
        assert len({tuple(d["pid"] for d in ref[it]["ranks"]) for it in (1, 2, 3)}) == 3
        for it in (1, 2, 3):
            a, b = res[it]["ranks"][0], ref[it]["ranks"][0]
            assert a["optimizer_step"] == b["optimizer_step"] == 2 * it
            _close([s["loss"] for s in a["steps"]], [s["loss"] for s in b["steps"]], 4096)
        wa, wb = _weights(runs["true"].checkpoint(3)), _weights(runs["false"].checkpoint(3))
        assert set(wa) == set(wb)
        for k in wa:
            _close(wa[k], wb[k], 4096)
        job = runs["true"].job("both")
        for r in (0, 1):
            driver_log = job.log_file(r, "driver").read_text()
            # launched once, at phase 0 of iteration 1, and loaded during the rollouts: its first order
            # names the plan's model inputs, and phase 10 launched nothing
            assert driver_log.count("launched the resident trainer") == 1, driver_log
            launch = next(p.name for p in job.trainer_dir(r).iterdir() if p.is_dir())
            assert launch.endswith("-i1-early"), launch
            first = try_read(job.trainer_order(r, launch, 1), kind="trainer-order").data
            assert first["prepare"]["input_iteration"] == 0 and first["prepare"]["world_size"] == 2
            assert try_read(job.trainer_order(r, launch, 2), kind="trainer-order").data["iteration"] == 1
            assert "iteration 1 continues the model it holds (input iteration 0)" in job.log_file(r, "trainer").read_text()
            assert [s["state"] for s in _trainer_states(runs["true"], r)] == ["stopped"]
        # the report's trainer lanes: each node's trainer loaded once and trained each iteration
        from coordination.report import load_trainer_spans
        lanes = load_trainer_spans(runs["true"], end=float("inf"))
        for r in (0, 1):
            mine = [(s["state"], s["iteration"]) for s in lanes if s["rank"] == r and s["state"] != "offloaded"]
            assert mine == [("loading", 1), ("training", 1), ("training", 2), ("training", 3)], mine
        _check_release_before_swap(runs["true"], iterations=2)
        assert _kill_trainers_left(_all_trainer_pids(runs["true"], 3)) == []
    finally:
        for lay in runs.values():
            _kill_trainers_left(_all_trainer_pids(lay, 3))


HELD_OFFLOAD_S = 3.0


def _check_release_before_swap(lay: RunLayout, iterations: int, nodes: int = 2) -> None:
    """On each node and in each iteration that swaps the engine's weights (the last does not): the
    trainer said "offloaded" before phase 12 began, every rank's result says it released its
    memory, and iteration 2's held offload made phase 10 wait instead of overlapping phase 12."""
    from coordination import timeline

    job = lay.job("both")
    for r in range(nodes):
        offloaded = {ev["iteration"]: ev["wall"] for ev in timeline.read(job.trainer_timeline(r))
                     if ev["event"] == "offloaded"}
        phases = {(ev["iteration"], ev["phase"], ev["event"]): ev["wall"] for ev in timeline.read(job.timeline(r))}
        for it in range(1, iterations + 1):
            assert offloaded[it] < phases[(it, 12, "start")], (r, it, offloaded, phases)
        phase10 = phases[(2, 10, "end")] - phases[(2, 10, "start")]
        assert phase10 >= HELD_OFFLOAD_S, f"rank {r}: phase 10 of iteration 2 took {phase10:.2f} s"
    results = _results(lay, iterations, world=nodes)
    assert sorted(results) == list(range(1, iterations + 1)), results
    for it, res in results.items():
        assert all(d["released"] for d in res["ranks"]), (it, res["ranks"])


# The kill tests' run: 3 iterations of 64 tasks, small engine calls and chunks (so a kill lands
# mid-rollout), up to 3 training attempts.
KILL_RUN = ("run.max_iterations=3", "tasks.tasks_per_iteration=64", "rollout.prompts_per_call=4",
            "rollout.chunk_groups=2", "train.max_attempts=3")


def _start_both(procs, data: Path, model: Path, log: Path, *, env: dict | None = None,
                names: tuple[str, str] = ("n0", "n1")) -> list[str]:
    """Start the master and worker 1 of a KILL_RUN; returns the worker's command (to restart it)."""
    extra = {} if env is None else {"env": env}
    w_cmd = node_cmd(data, model, log, *FLAGS, "--worker", "1", overrides=KILL_RUN)
    procs.start(names[0], node_cmd(data, model, log, *FLAGS, "--master", overrides=KILL_RUN), **extra)
    procs.start(names[1], w_cmd, **extra)
    return w_cmd


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["early", "rollout", "mid-step", "idle", "trainer-only"])
def test_kill_9_and_restart_with_the_same_command(procs, tmp_path, assets, moment):
    """kill -9 of the worker node (driver and its trainer) at a moment, or of its trainer alone;
    the same command restarts the node; the run ends with exact counts, continuous optimizer
    steps, loadable checkpoints and no trainer process of either node left."""
    data, model = assets
    log = fresh_log(tmp_path)
    lay = RunLayout(log)
    w_cmd = _start_both(procs, data, model, log)
    seen: set[int] = set()
    try:
        if moment == "early":  # iteration 1, once the trainer launched at phase 0 runs, before it trained
            _wait(lambda: any(s["launch"].endswith("-i1-early") for s in _trainer_states(lay, 1)),
                  "the early trainer", procs)
            assert try_read(lay.training_result(1, 1, 0)) is None, "too late: iteration 1 already trained"
        elif moment == "rollout":  # phase 1 of iteration 2: the trainers idle (offloaded) since iteration 1
            chunks = lay.rollout_rank_dir("train", 2, 1)
            _wait(lambda: chunks.exists() and any(p.suffix == ".parquet" for p in chunks.iterdir()), "a chunk", procs)
        elif moment == "idle":  # after iteration 1's training, before iteration 2 rolls out
            _wait(lambda: any(s["state"] == "offloaded" for s in _trainer_states(lay, 1)), "an idle trainer", procs)
        else:  # mid-step of iteration 2: the trainers have met and train
            _wait(lambda: any(s["state"] == "training" and s.get("iteration") == 2 for s in _trainer_states(lay, 1)),
                  "training in iteration 2", procs)
        victims = [s["pid"] for s in _trainer_states(lay, 1)]
        seen |= set(victims)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        if moment != "trainer-only":
            procs.signal("n1", signal.SIGKILL)
            procs.wait("n1", 30)
            procs.start("n1-again", w_cmd)
        codes = procs.wait_all(900)
        if moment != "trainer-only":
            assert codes.pop("n1") == -signal.SIGKILL
        assert set(codes.values()) == {0}, procs.log("n0")[-3000:] + procs.log(
            "n1-again" if "n1-again" in codes else "n1")[-3000:]
        check_complete_run(lay, 3, 64, 4, model)
        res = _results(lay, 3)
        assert [res[it]["ranks"][0]["optimizer_step"] for it in (1, 2, 3)] == [2, 4, 6]
        if moment in ("mid-step", "trainer-only"):
            assert res[2]["attempt"] == 2, "the interrupted training attempt was not retried"
        seen |= _all_trainer_pids(lay, 3)
        time.sleep(1.5)  # the watch threads of trainers whose driver died check once a second
        assert _kill_trainers_left(seen) == [], "a trainer process outlived its run"
    finally:
        _kill_trainers_left(seen | _all_trainer_pids(lay, 3))


@pytest.mark.slow
def test_a_node_killed_while_the_optimizer_state_is_written_replays_that_iteration(procs, tmp_path, assets):
    """A resident trainer writes the optimizer state after the weights, while the run goes on
    (docs/design.md §9.6). kill -9 of the worker node once checkpoint 1 is published but its
    optimizer state is not (trainer rank 0 holds that write back 40 s through a test hook): the
    restart relaunches both nodes' trainers, so the state in memory is lost; the new trainers find
    checkpoint 1 without it, replay iteration 1 from the base model, and the run ends with exact
    counts, optimizer steps 2, 4, 6, and every checkpoint's optimizer state complete with AdamW's
    step count at 2 x its iteration."""
    import torch

    from coordination.checkpoints import is_complete
    from tests.train_support import optimizer_steps, optimizer_tensors

    data, model = assets
    log = fresh_log(tmp_path)
    lay = RunLayout(log)
    hold = env(BATON_TEST_HOLD_OPTIMIZER_WRITE="1:40")  # on every node: either may host trainer rank 0
    w_cmd = _start_both(procs, data, model, log, env=hold)
    seen: set[int] = set()
    state = lay.checkpoint(1) / "optimizer"
    try:
        _wait(lambda: is_complete(lay.checkpoint(1)) and not state.exists(),
              "checkpoint 1 published while its optimizer state is still being written", procs)
        seen |= _all_trainer_pids(lay, 1)
        procs.signal("n1", signal.SIGKILL)
        procs.wait("n1", 30)
        assert not state.exists(), "too late: the optimizer state of iteration 1 was written"
        procs.start("n1-again", w_cmd, env=hold)
        codes = procs.wait_all(900)
        assert codes.pop("n1") == -signal.SIGKILL
        assert set(codes.values()) == {0}, procs.log("n0")[-3000:] + procs.log("n1-again")[-3000:]
        check_complete_run(lay, 3, 64, 4, model)
        res = _results(lay, 3)
        assert [res[it]["ranks"][0]["optimizer_step"] for it in (1, 2, 3)] == [2, 4, 6]
        for it in (1, 2, 3):
            assert is_complete(lay.checkpoint(it) / "optimizer"), f"iteration {it}: optimizer state incomplete"
            assert optimizer_steps(lay.checkpoint(it)) == {2.0 * it}
        trainer_logs = "".join(lay.job("both").log_file(r, "trainer").read_text() for r in (0, 1))
        assert "replaying iteration 1 from" in trainer_logs and "replayed iteration 1 (optimizer step 2)" in trainer_logs
        assert not [p for p in lay.checkpoint_staging_dir.iterdir() if p.name.endswith(".optimizer")]
        seen |= _all_trainer_pids(lay, 3)
        time.sleep(1.5)  # the watch threads of trainers whose driver died check once a second
        assert _kill_trainers_left(seen) == [], "a trainer process outlived its run"
        # The same run without the kill: the replayed state led to the same weights and state.
        ref = RunLayout(fresh_log(tmp_path, "uninterrupted"))
        _start_both(procs, data, model, ref.root, names=("r0", "r1"))
        assert procs.wait("r0", 900) == 0 and procs.wait("r1", 60) == 0, procs.log("r0")[-3000:]
        wa, wb = _weights(lay.checkpoint(3)), _weights(ref.checkpoint(3))
        assert set(wa) == set(wb)
        for k in wa:
            _close(wa[k], wb[k], 4096)
        sa, sb = optimizer_tensors(lay.checkpoint(3)), optimizer_tensors(ref.checkpoint(3))
        assert set(sa) == set(sb)
        for k in sa:
            _close(torch.cat([t.flatten() for t in sa[k]]), torch.cat([t.flatten() for t in sb[k]]), 4096)
        seen |= _all_trainer_pids(ref, 3)
    finally:
        _kill_trainers_left(seen | _all_trainer_pids(lay, 3))


_ONE_COPY_AT_A_TIME = """
import json, sys, torch
from train.memory import peak_rss_mb
from train.offload import ResidentOffload
# Eight 40 MB parameters (above glibc's largest mmap threshold, so each is its own mapping that a
# free returns to the system at once), filled in place: no temporaries raise the peak beforehand.
params = [torch.nn.Parameter(torch.empty(10_000_000).fill_(float(i))) for i in range(8)]
opt = torch.optim.SGD(params, lr=0.1)
before = peak_rss_mb()
off = ResidentOffload([torch.nn.ParameterList(params)], opt, torch.device("cpu"))
off.to_host()
json.dump({"before": before, "after": peak_rss_mb(), "moved_mb": off.moved_bytes / 2**20}, sys.stdout)
"""


def test_offload_on_cpu_never_holds_the_whole_state_twice():
    """On CPU host and device are one memory: each storage is freed as soon as its copy is made,
    so to_host raises the process's peak by about one storage (40 MB), not by the whole state
    (320 MB) as copying everything before freeing anything would."""
    out = subprocess.run([sys.executable, "-c", _ONE_COPY_AT_A_TIME], cwd=ROOT, env=env(OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout)
    assert 300 < m["moved_mb"] < 320
    assert m["after"] - m["before"] < 0.5 * m["moved_mb"], m
