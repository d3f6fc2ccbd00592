"""The rollout worker: chunks, DONE, resumption after a crash, fencing."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from coordination.layout import RunLayout
from coordination.records import read_record
from rollout import store
from rollout.aggregate import aggregate
from rollout.chunks import RolloutError, list_chunks, read_chunk, write_chunk
from rollout.config import RolloutConfig
from rollout.engines.transformers_engine import TransformersEngine
from rollout.rewards import arithmetic_reward, load_reward
from rollout.tasks import arithmetic_tasks, write_tasks
from rollout.worker import RolloutTarget, Sampler, rollout_rank, sampling_for
from train.tiny import write_tiny_model

REPO = Path(__file__).resolve().parents[1]
RUN_ID = "run-test"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = TransformersEngine()
    eng.start(model_dir)
    yield eng
    eng.stop()


class CountingEngine:
    """Delegates to a real engine and records which prompts it was asked to sample."""

    name = "counting"
    rolling = False

    def __init__(self, inner, fail: bool = False):
        self.inner, self.fail, self.prompts = inner, fail, []

    def generate(self, prompts, n, sampling):
        if self.fail:
            raise AssertionError("the engine must not be asked to generate")
        self.prompts.extend(prompts)
        return self.inner.generate(prompts, n, sampling)


def run(engine, layout, tasks, *, generation=1, rank=0, split="train", fence=None, on_progress=None, **cfg_kw):
    cfg = RolloutConfig(**{"group_size": 3, "max_new_tokens": 6, "chunk_groups": 2, "prompts_per_call": 2, **cfg_kw})
    sampling, group_size = sampling_for(cfg, split)
    tokenizer = engine.inner.tokenizer if isinstance(engine, CountingEngine) else engine.tokenizer
    return rollout_rank(RolloutTarget(layout, split, 1, rank, run_id=RUN_ID, generation=generation, policy_iteration=0),
                        Sampler(engine, tokenizer, cfg, load_reward("arithmetic"), sampling, group_size), tasks,
                        on_progress=on_progress, fence=fence)


def listed_rows(layout, rank=0, split="train"):
    """(task_id, sample_index) of every row DONE accepts, in order, plus the DONE record."""
    done = read_record(layout.rollout_done(split, 1, rank), kind="rollout-done", run_id=RUN_ID)
    pairs = []
    for entry in done.data["chunks"]:
        table = read_chunk(layout.rollout_rank_dir(split, 1, rank) / entry["name"], run_id=RUN_ID)
        table = table.filter(pc.is_in(table["task_id"], value_set=pa.array(entry["task_ids"], pa.string())))
        pairs += list(zip(table["task_id"].to_pylist(), table["sample_index"].to_pylist()))
    return pairs, done


def test_worker_writes_chunks_and_a_done_listing_every_group(engine, tmp_path):
    layout = RunLayout(tmp_path)
    tasks, _ = arithmetic_tasks(10, 0, digits=2, seed=1)
    progress, fences = [], []
    summary = run(engine, layout, tasks, on_progress=lambda d, t, m: progress.append((d, t, m)),
                  fence=lambda: fences.append(1))
    assert (summary.tasks, summary.samples, summary.chunks, summary.resumed_tasks) == (10, 30, 5, 0)
    pairs, done = listed_rows(layout)
    assert sorted(pairs) == sorted((t.id, j) for t in tasks for j in range(3))
    assert done.generation == 1 and done.data["tasks"] == 10 and done.data["group_size"] == 3
    assert len(fences) == 5 + 1                       # before every chunk and before DONE
    assert progress[0][:2] == (0, 10) and progress[-1][:2] == (10, 10)
    # What `status` shows of the rank while it rolls out: its rates (one turn per single-turn episode).
    episodes_s, turns_s = re.fullmatch(r"rolling out 10/10 train tasks, ([0-9.]+) episodes/s, ([0-9.]+) turns/s",
                                       progress[-1][2]).groups()
    assert float(episodes_s) == float(turns_s) > 0
    by_id = {t.id: t for t in tasks}
    for chunk in list_chunks(layout.rollout_rank_dir("train", 1, 0)):
        table = store.read_table(chunk.path)
        assert table.schema.remove_metadata() == store.SCHEMA
        for row in table.to_pylist():
            assert (row["rank"], row["generation"], row["iteration"], row["split"]) == (0, 1, 1, "train")
            assert len(row["completion_ids"]) == len(row["logprobs"]) <= 6
            assert row["prompt"] == by_id[row["task_id"]].prompt
            assert row["reward"] == arithmetic_reward(by_id[row["task_id"]], row["text"], row["finish_reason"])
    assert summary.completion_tokens == done.data["completion_tokens"] > 0


def test_restarted_worker_rolls_out_only_missing_tasks(engine, tmp_path):
    layout = RunLayout(tmp_path)
    tasks, _ = arithmetic_tasks(10, 0, digits=2, seed=2)
    run(engine, layout, tasks[:4], generation=1)      # the first attempt finished 4 tasks, then died:
    os.unlink(layout.rollout_done("train", 1, 0))     # ... before publishing DONE
    # ... and had flushed a group cut short (2 of 3 samples of task 5): it must be redone.
    partial = store.read_table(list_chunks(layout.rollout_rank_dir("train", 1, 0))[0].path).to_pylist()[:2]
    for row in partial:
        row["task_id"] = tasks[5].id
    write_chunk(layout.rollout_chunk("train", 1, 0, 7, 1), partial, run_id=RUN_ID, generation=1)

    counting = CountingEngine(engine)
    summary = run(counting, layout, tasks, generation=2)
    asked = [engine.tokenizer.decode(p, skip_special_tokens=True) for p in counting.prompts]
    assert asked == [t.prompt for t in tasks[4:]]
    assert summary.resumed_tasks == 4 and summary.tasks == 10 and summary.generated_samples == 18
    pairs, done = listed_rows(layout)
    assert len(pairs) == len(set(pairs)) == 30
    assert set(pairs) == {(t.id, j) for t in tasks for j in range(3)}
    assert done.generation == 2 and done.data["resumed_tasks"] == 4
    assert all(c["name"] != "chunk-00007-g1.parquet" for c in done.data["chunks"])
    assert [c["name"] for c in done.data["chunks"]][-1].endswith("-g2.parquet")


def test_finished_rollout_is_republished_for_a_new_generation_without_generating(engine, tmp_path):
    layout = RunLayout(tmp_path)
    tasks, _ = arithmetic_tasks(5, 0, digits=2, seed=3)
    first = run(engine, layout, tasks, generation=1)
    before = read_record(layout.rollout_done("train", 1, 0)).data
    again = run(CountingEngine(engine, fail=True), layout, tasks, generation=3)
    after = read_record(layout.rollout_done("train", 1, 0))
    assert after.generation == 3 and after.data["chunks"] == before["chunks"]
    assert (again.tasks, again.samples, again.chunks) == (first.tasks, first.samples, first.chunks)
    assert again.resumed_tasks == 5
    with pytest.raises(RolloutError, match="written by generation 3, newer than this process's generation 2"):
        run(CountingEngine(engine, fail=True), layout, tasks, generation=2)


def test_fenced_worker_raises_the_fence_error_and_writes_nothing(engine, tmp_path):
    class Fenced(Exception):
        pass

    def fence():
        raise Fenced("claim superseded")

    layout = RunLayout(tmp_path)
    tasks, _ = arithmetic_tasks(4, 0, digits=2, seed=4)
    with pytest.raises(Fenced):
        run(engine, layout, tasks, fence=fence)
    assert list_chunks(layout.rollout_rank_dir("train", 1, 0)) == []
    assert not layout.rollout_done("train", 1, 0).exists()


def test_worker_stops_when_a_newer_generation_has_written_chunks(engine, tmp_path):
    layout = RunLayout(tmp_path)
    tasks, _ = arithmetic_tasks(4, 0, digits=2, seed=5)
    run(engine, layout, tasks[:2], generation=3)
    os.unlink(layout.rollout_done("train", 1, 0))
    with pytest.raises(RolloutError, match=r"rank 0: .*chunk-00000-g3.parquet of generation 3.*superseded"):
        run(engine, layout, tasks, generation=2)


def test_damaged_chunk_is_ignored_and_its_tasks_redone(engine, tmp_path):
    layout = RunLayout(tmp_path)
    tasks, _ = arithmetic_tasks(4, 0, digits=2, seed=6)
    run(engine, layout, tasks, generation=1)
    os.unlink(layout.rollout_done("train", 1, 0))
    first = list_chunks(layout.rollout_rank_dir("train", 1, 0))[0].path
    first.write_bytes(b"PAR1 not really parquet")
    counting = CountingEngine(engine)
    summary = run(counting, layout, tasks, generation=2)
    assert summary.resumed_tasks == 2 and len(counting.prompts) == 2
    pairs, done = listed_rows(layout)
    assert set(pairs) == {(t.id, j) for t in tasks for j in range(3)} and len(pairs) == 12
    assert first.name not in [c["name"] for c in done.data["chunks"]]


def test_rank_without_tasks_publishes_an_empty_done(engine, tmp_path):
    layout = RunLayout(tmp_path)
    summary = run(CountingEngine(engine, fail=True), layout, [])
    pairs, done = listed_rows(layout)
    assert (summary.tasks, summary.samples, summary.chunks, pairs) == (0, 0, 0, [])
    assert done.data["tasks"] == 0 and done.data["chunks"] == []


def test_eval_split_uses_eval_sampling_and_group_size(engine, tmp_path):
    layout = RunLayout(tmp_path)
    _, evals = arithmetic_tasks(0, 6, digits=2, seed=7)
    summary = run(engine, layout, evals, split="eval", eval_group_size=1)
    pairs, done = listed_rows(layout, split="eval")
    assert summary.samples == 6 and sorted(pairs) == sorted((t.id, 0) for t in evals)
    # Greedy: a second rollout of the same tasks produces the same completions.
    again = run(engine, RunLayout(tmp_path / "again"), evals, split="eval", eval_group_size=1)
    texts = lambda lay: sorted(store.read_table(c.path)["text"].to_pylist()  # noqa: E731
                               for c in list_chunks(lay.rollout_rank_dir("eval", 1, 0)))
    assert again.samples == 6 and texts(layout) == texts(RunLayout(tmp_path / "again"))


def _wait_for(predicate, proc, timeout, what, log):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"worker exited ({proc.returncode}) before {what}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()}")
        time.sleep(0.005)


def test_sigkilled_worker_restarted_yields_every_sample_exactly_once(model_dir, tmp_path):
    tasks, _ = arithmetic_tasks(80, 0, digits=3, seed=8)
    write_tasks(tmp_path / "train.jsonl", tasks)
    layout = RunLayout(tmp_path / "run")
    rank_dir = layout.rollout_rank_dir("train", 1, 0)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

    def start(generation: int, log: Path) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "rollout.worker", "--log-path", str(layout.root), "--model-dir", str(model_dir),
               "--tasks", str(tmp_path / "train.jsonl"), "--run-id", RUN_ID, "--generation", str(generation),
               "group_size=4", "chunk_groups=1", "prompts_per_call=4", "max_new_tokens=8"]
        with open(log, "wb") as out:
            return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    procs = []
    try:
        log1 = tmp_path / "worker-g1.log"
        first = start(1, log1)
        procs.append(first)
        _wait_for(lambda: len(list_chunks(rank_dir)) >= 2, first, 120, "the first chunks", log1)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        assert first.returncode == -signal.SIGKILL
        assert not layout.rollout_done("train", 1, 0).exists(), "killed too late: the worker had finished"
        killed_chunks = list_chunks(rank_dir)

        log2 = tmp_path / "worker-g2.log"
        second = start(2, log2)
        procs.append(second)
        assert second.wait(timeout=300) == 0, log2.read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    pairs, done = listed_rows(layout)
    expected = {(t.id, j) for t in tasks for j in range(4)}
    assert len(pairs) == len(set(pairs)) == len(expected) and set(pairs) == expected
    assert done.generation == 2 and 0 < done.data["resumed_tasks"] < 80
    # Only the missing tasks were rolled out again: generation 2 never re-sampled a resumed task.
    resumed = {t for c in done.data["chunks"] if c["name"].endswith("-g1.parquet") for t in c["task_ids"]}
    assert len(resumed) == done.data["resumed_tasks"]
    resampled = {t for c in list_chunks(rank_dir) if c.generation == 2
                 for t in store.read_table(c.path, ["task_id"])["task_id"].to_pylist()}
    assert not resampled & resumed and resampled | resumed == {t.id for t in tasks}
    assert {c.name for c in killed_chunks} <= {c.name for c in list_chunks(rank_dir)}   # nothing overwritten
    stats = aggregate(layout, "train", 1, ranks={0: 2}, run_id=RUN_ID, expected={0: [t.id for t in tasks]},
                      group_size=4)
    merged = store.read_table(layout.rollout_all("train", 1), ["task_id", "sample_index"])
    merged_pairs = list(zip(merged["task_id"].to_pylist(), merged["sample_index"].to_pylist()))
    assert len(merged_pairs) == 320 and set(merged_pairs) == expected and stats["samples"] == 320
