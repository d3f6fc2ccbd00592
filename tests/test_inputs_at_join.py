"""Bad input is found at join, before the run folder is written, and does not stick (issue 13
defects 8 and 9): task files, the reward, the log path, a phase aborted by an input, and the
cause of a failed child in one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coordination.layout import RunLayout
from rollout.tasks import arithmetic_tasks, write_tasks
from tests.e2e import RUN_SH, weightless_model
from tests.procs import ROOT, bench_node, env


def _data(root: Path) -> Path:
    data = root / "data"
    train, ev = arithmetic_tasks(64, 8, digits=2, seed=1)   # 64: the default tasks.tasks_per_iteration
    data.mkdir(parents=True)
    write_tasks(data / "train.jsonl", train)
    write_tasks(data / "eval.jsonl", ev)
    return data


def _run_sh(data: Path, log: Path, model: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [RUN_SH, "--data-path", str(data), "--log-path", str(log), "--rl-phase", "both", "--eval-interval", "1",
           f"model.path={model}", "tasks.reward=tests.e2e_rewards:starts_with_digit", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)


def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _bad_utf8(data: Path) -> str:
    with open(data / "eval.jsonl", "ab") as fh:
        fh.write(b'{"id": "x", "prompt": "caf\xe9", "answer": "1"}\n')
    n = len((data / "eval.jsonl").read_bytes().splitlines())
    return f"eval.jsonl:{n}: not UTF-8 text"


@pytest.mark.parametrize("case", ["non-utf8 task", "missing module", "raises", "returns text", "returns nan",
                                  "hangs", "too few train tasks", "too few eval tasks"])
def test_bad_input_exits_2_at_join_and_writes_nothing(tmp_path, case):
    data = _data(tmp_path)
    log = tmp_path / "run"
    log.mkdir(mode=0o750)
    model = tmp_path / "model"
    model.mkdir()
    reward = {"missing module": "no_such_module_xyz:fn", "raises": "tests.e2e_rewards:raises",
              "returns text": "tests.e2e_rewards:returns_text", "returns nan": "tests.e2e_rewards:returns_nan",
              "hangs": "tests.e2e_rewards:hangs"}
    expected = {"missing module": "cannot import module 'no_such_module_xyz'", "raises": "raised KeyError",
                "returns text": "returned '1.0'", "returns nan": "returned nan",
                "hangs": "reward 'tests.e2e_rewards:hangs' did not return within 1 s (tasks.reward_timeout)"}
    overrides = ()
    if case == "non-utf8 task":
        expected[case] = _bad_utf8(data)
    elif case == "too few train tasks":   # 64 in the file (_data)
        overrides = ("tasks.tasks_per_iteration=65",)
        expected[case] = f"tasks.tasks_per_iteration=65 exceeds the 64 tasks of the train file; lower " \
                         f"tasks_per_iteration or add tasks ({data / 'train.jsonl'})"
    elif case == "too few eval tasks":    # 8 in the file
        overrides = ("tasks.eval_tasks=9",)
        expected[case] = f"tasks.eval_tasks=9 exceeds the 8 tasks of the eval file; lower eval_tasks or use " \
                         f"0 for the whole file ({data / 'eval.jsonl'})"
    else:
        overrides = (f"tasks.reward={reward[case]}", "tasks.reward_timeout=1")
    res = _run_sh(data, log, model, *overrides)
    assert res.returncode == 2, res.stderr[-3000:]
    assert expected[case] in res.stderr
    assert "Traceback" not in res.stderr
    assert list(log.iterdir()) == [], "the run folder was written before the input was checked"


def _ro_tmpfs(tmp_path: Path) -> Path:
    mnt = tmp_path / "ro"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here ({res.stderr.decode().strip()}); needs root")
    return mnt


@pytest.mark.parametrize("where", ["read-only filesystem", "under a regular file"])
def test_unusable_log_path_is_one_line_with_the_path_and_what_to_do(tmp_path, where):
    """Root ignores chmod 0o500, so a read-only mount and ENOTDIR (a path under a file) stand in
    for a folder this user may not write."""
    data = _data(tmp_path)
    model = weightless_model(tmp_path / "model")
    mnt = None
    if where == "read-only filesystem":
        mnt = _ro_tmpfs(tmp_path)
        log, says = mnt / "run", "is on a read-only filesystem"
    else:
        (tmp_path / "afile").write_text("x")
        log, says = tmp_path / "afile" / "run", "is a file, not a folder"
    try:
        res = _run_sh(data, log, model)
    finally:
        if mnt is not None:
            subprocess.run(["umount", str(mnt)], check=True)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    errors = [line for line in res.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and str(log) in errors[0] and says in errors[0], res.stderr[-2000:]


def test_phase_aborted_by_an_input_is_retried_when_the_nodes_are_restarted(procs, run_dir):
    """Restarting with the input fixed replayed the recorded abort (exit 6) until someone found
    `recover --reset-phase`."""
    hb = ["--heartbeat-interval", "0.3", "--peer-timeout", "3"]
    for r in range(2):  # phase 3 (the master's aggregation) fails: the GO of barrier 4 says abort
        procs.start(f"a{r}", bench_node(run_dir, r, 2, 1, *hb, *(["--fail", "3:0:1"] if r == 0 else [])))
    assert procs.wait_all(60) == {"a0": 6, "a1": 6}
    for r in range(2):  # the input fixed: the same nodes, without the failure
        procs.start(f"b{r}", bench_node(run_dir, r, 2, 1, *hb))
    codes = procs.wait_all(60)
    assert (codes["b0"], codes["b1"]) == (0, 0), procs.log("b0")[-2000:]
    for r in range(2):
        assert "the previous attempt aborted (iteration 1 failed at phase 4" in procs.log(f"b{r}")
    from coordination import timeline

    lay = RunLayout(run_dir)
    runs = [(e["phase"], e["generation"]) for e in timeline.read(lay.bench_work("both", 0))]
    assert runs.count((3, 1)) == 1 and runs.count((3, 2)) == 1  # aggregation ran again in the new process
    go = json.loads((lay.job("both").go(1, 4, "train-files-ready", 2)).read_text())
    assert go["data"]["decision"] == "continue"


def test_failed_child_names_the_cause_and_its_log_in_one_line_disk_full(tmp_path, run_dir):
    from coordination.children import ChildFailed, run_watched
    from coordination.config import CoordinationConfig
    from coordination.join import join_job

    full = tmp_path / "full"
    full.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({res.stderr.decode().strip()}); needs root")
    node = None
    try:
        node = join_job(RunLayout(run_dir), job="both", rank=0, num_nodes=1, job_facts={}, config={"t": 1},
                        cfg=CoordinationConfig(heartbeat_interval=0.5, peer_timeout=3))
        log_file = tmp_path / "trainer.log"
        writer = f"open({str(full / 'ckpt.bin')!r}, 'wb').write(b'x' * 1_000_000)"
        with pytest.raises(ChildFailed) as err:
            run_watched([sys.executable, "-c", writer], env=env(), log_file=log_file, node=node, peers=[0],
                        what="trainer")
    finally:
        if node is not None:
            node.close()
        subprocess.run(["umount", str(full)], check=True)
    first = str(err.value).splitlines()[0]
    assert "No space left on device" in first and str(log_file) in first


def test_report_into_a_read_only_folder_is_one_line_with_exit_2(tmp_path, run_dir):
    from coordination.records import create_record

    create_record(RunLayout(run_dir).run_json, "run", {"config_hash": "x", "created_by": "t"}, run_id="r1",
                  generation=0)
    mnt = _ro_tmpfs(tmp_path)
    try:
        res = subprocess.run([sys.executable, "-m", "coordination", "report", "--log-path", str(run_dir),
                              "--out", str(mnt / "report")], cwd=ROOT, env=env(), capture_output=True, text=True,
                             timeout=120)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "cannot write the report" in res.stderr and "Read-only file system" in res.stderr
