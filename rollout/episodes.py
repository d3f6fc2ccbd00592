"""Episodes: the rollout unit, token-exact (docs/design.md §7).

An episode is one conversation between the policy and an environment, kept as token ids from
the start: the chat template's ids of the first messages (`prompt_ids`), then for each turn the
ids the engine sampled, exactly as it returned them (loss mask 1, with their sampling logprobs),
then the template ids of the environment's answer (loss mask 0, logprob 0). The next turn is
sampled from those ids; the conversation's text is never tokenized again, so the trainer sees
the very tokens the policy chose.

A task without `tasks.env` is the one-turn case: its prompt is `encode_prompt` of the task and
the first completion ends the episode. The reward is the sum of the parts rollout/scoring.py
describes (the environment's step rewards, `tasks.reward`, the LLM judge).

Scheduling: every episode waiting for the policy is sampled in one engine call per round (the
G episodes of a task share their first prompt, so that call asks for G samples of it); the
environment calls of the turns just sampled run on worker threads (rollout/envs/calls.py) while
the next round samples the episodes whose environment has already answered. Episodes the judge
scores wait for the end of the round and are judged together, in one batch.
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from coordination import log
from rollout.chunks import RolloutError
from rollout.engine import Engine, Sample, Sampling
from rollout.envs import EnvError, EnvFactory, check_messages, check_step
from rollout.envs.calls import EnvCalls
from rollout.prompts import ObservationTokens, chat_ids, encode_prompt
from rollout.rewards import TIMED_OUT, CheckedReward, RewardFn, RewardTimeout
from rollout.scoring import Scoring, env_part
from rollout.tasks import Task

_log = log.get("episodes")

# An episode ends done, max_turns, max_tokens, env_error, timeout or judge_error. The last three
# are its environment's or its judge's fault: no reward, and its group is not trained on.
FAILED = ("env_error", "timeout", "judge_error")
_CALLS = {"reset": "the factory or reset()", "step": "step()"}  # what an error names


@dataclass(frozen=True)
class Bounds:
    """Limits of an environment episode: policy turns, tokens (prompt + all turns and observations,
    checked before each generation so that a turn never runs past it) and seconds per
    environment call."""

    max_turns: int
    max_tokens: int
    step_timeout: float


@dataclass
class Episode:
    task: Task
    index: int
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)          # everything after the prompt
    loss_mask: list[int] = field(default_factory=list)    # 1 on the policy's tokens
    logprobs: list[float] = field(default_factory=list)   # sampling logprob; 0 on context tokens
    turn_starts: list[int] = field(default_factory=list)  # offset in `ids` of each policy turn
    pieces: list[str] = field(default_factory=list)       # text of each turn and observation
    messages: list[dict[str, str]] = field(default_factory=list)  # the conversation, for rewards and judges
    step_rewards: list[float] = field(default_factory=list)  # the rewards the environment's steps gave
    reward_parts: dict[str, float] = field(default_factory=dict)  # rollout/scoring.py
    finish_reason: str = "length"
    termination: str = ""
    error: str = ""
    reward: float = 0.0
    env: Any = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    @property
    def turns(self) -> int:
        return len(self.turn_starts)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


@dataclass
class EpisodeTimes:
    """Where one `run_episodes` call spent its time (docs/design.md §7): `generation_s` is wall
    time inside engine calls, `env_wait_s` wall time blocked on environment answers with nothing
    to sample, `env_s` the summed duration of environment calls (they overlap each other and
    generation, so it can exceed the wall time); `turns` counts the policy turns sampled."""

    generation_s: float = 0.0
    env_wait_s: float = 0.0
    env_s: float = 0.0
    env_calls: int = 0
    turns: int = 0


@dataclass
class EpisodeGroup:
    """The G episodes of one task (the GRPO group), in sample-index order."""

    task: Task
    episodes: list[Episode]


def run_episodes(engine: Engine, tokenizer: Any, tasks: Sequence[Task], group_size: int, sampling: Sampling, *,
                 reward_fn: RewardFn, env_factory: EnvFactory | None, bounds: Bounds,
                 on_group: Callable[[EpisodeGroup], None], seed_of: Callable[[list[str]], int] | None = None,
                 scoring: Scoring | None = None) -> EpisodeTimes:
    """Run `group_size` episodes of each task to their end; hand each task's group to `on_group`
    as soon as its last episode ends (and is judged). `seed_of(keys)` seeds each engine call from
    its content; `scoring` chooses the reward's parts (default: env steps summed, no judge).
    Returns where the time went."""
    run = _Run(engine, tokenizer, group_size, sampling, reward_fn, env_factory, bounds, on_group, seed_of,
               scoring or Scoring())
    run.run(tasks)
    return run.times


class _Run:
    def __init__(self, engine: Engine, tokenizer: Any, group_size: int, sampling: Sampling, reward_fn: RewardFn,
                 env_factory: EnvFactory | None, bounds: Bounds, on_group: Callable[[EpisodeGroup], None],
                 seed_of: Callable[[list[str]], int] | None, scoring: Scoring):
        self.engine, self.tokenizer, self.group_size, self.sampling = engine, tokenizer, group_size, sampling
        self.scoring, self.judging = scoring, []
        self.reward_fn, self.factory, self.bounds, self.on_group = reward_fn, env_factory, bounds, on_group
        self.seed_of = seed_of or (lambda keys: sampling.seed)
        # A single-turn episode is one turn of max_new_tokens, its prompt checked against the
        # model's positions at the start (rl/model_inputs.py); the episode bound is for environments.
        self.max_tokens = bounds.max_tokens if env_factory is not None else None
        self.calls = EnvCalls(bounds.step_timeout) if env_factory is not None else None
        self.observation = ObservationTokens(tokenizer) if env_factory is not None else None
        self.ready: list[Episode] = []
        self.pending: dict[Future, tuple[Episode, str, float]] = {}
        self.groups: dict[str, list[Episode]] = {}
        self.open: dict[str, int] = {}
        self.closing: list[Future] = []
        self.times = EpisodeTimes()
        self.call_seconds: list[float] = []  # appended by the environment's threads (list.append is atomic)

    def run(self, tasks: Sequence[Task]) -> None:
        try:
            for task in tasks:
                episodes = [Episode(task, i) for i in range(self.group_size)]
                self.groups[task.id], self.open[task.id] = episodes, self.group_size
                if self.factory is None:
                    prompt = encode_prompt(self.tokenizer, task)
                    first = [dict(m) for m in task.messages] if task.messages else [
                        {"role": "user", "content": task.prompt}]
                    for ep in episodes:
                        ep.prompt_ids, ep.messages = list(prompt), [dict(m) for m in first]
                    self.ready.extend(episodes)
                else:
                    for ep in episodes:
                        self._submit(ep, "reset", self._open_env, ep)
            while self.ready or self.pending or self.judging:
                if self.ready:
                    ready, self.ready = self.ready, []
                    self._generate(ready)
                if self.pending:
                    self._collect(block=not self.ready)
                if self.judging:
                    self._judge()
        finally:
            self._close_all()
            self.times.env_s, self.times.env_calls = float(sum(self.call_seconds)), len(self.call_seconds)

    # -- environment calls ---------------------------------------------------------------------
    def _open_env(self, ep: Episode) -> Any:
        ep.env = self.factory(ep.task)
        return ep.env.reset()

    def _submit(self, ep: Episode, what: str, fn: Callable[..., Any], *args: Any) -> None:
        def timed(*a: Any) -> Any:
            t0 = time.monotonic()
            try:
                return fn(*a)
            finally:
                self.call_seconds.append(time.monotonic() - t0)

        self.pending[self.calls.submit(timed, *args)] = (ep, what, time.monotonic() + self.bounds.step_timeout)

    def _collect(self, *, block: bool) -> None:
        if block:
            earliest = min(deadline for _, _, deadline in self.pending.values())
            t0 = time.monotonic()
            wait(list(self.pending), timeout=max(0.0, earliest - time.monotonic()), return_when=FIRST_COMPLETED)
            self.times.env_wait_s += time.monotonic() - t0
        now = time.monotonic()
        for fut, (ep, what, deadline) in list(self.pending.items()):
            if fut.done():
                del self.pending[fut]
                exc = fut.exception()
                if exc is not None:
                    self._end(ep, "env_error", f"{_CALLS[what]} raised {type(exc).__name__}: {exc}")
                elif what == "reset":
                    self._started(ep, fut.result())
                else:
                    self._answered(ep, fut.result())
            elif now >= deadline:
                del self.pending[fut]
                self.calls.abandon(fut)
                self._end(ep, "timeout", f"{_CALLS[what]} did not return within rollout.env_step_timeout="
                                         f"{self.bounds.step_timeout:g} s")

    def _started(self, ep: Episode, value: Any) -> None:
        try:
            messages = check_messages(value, "reset()")
        except EnvError as exc:
            return self._end(ep, "env_error", str(exc))
        if not messages:
            return self._end(ep, "env_error", "reset() returned no messages; it must give the first messages")
        ep.prompt_ids = chat_ids(self.tokenizer, messages, add_generation_prompt=True)
        ep.messages = list(messages)
        self.ready.append(ep)

    def _answered(self, ep: Episode, value: Any) -> None:
        try:
            step = check_step(value)
        except EnvError as exc:
            return self._end(ep, "env_error", str(exc))
        if step.reward is not None:
            ep.step_rewards.append(step.reward)
        if step.done:
            return self._end(ep, "done")
        if ep.turns >= self.bounds.max_turns:
            return self._end(ep, "max_turns")
        ids = self.observation(step.messages)
        ep.ids += ids
        ep.loss_mask += [0] * len(ids)
        ep.logprobs += [0.0] * len(ids)
        ep.pieces.append(self.tokenizer.decode(ids, skip_special_tokens=True))
        ep.messages += step.messages
        self.ready.append(ep)

    # -- generation ----------------------------------------------------------------------------
    def _generate(self, ready: list[Episode]) -> None:
        # Episodes with the same ids so far (a group's first turn) are one prompt with n samples.
        same: dict[tuple[int, ...], list[Episode]] = {}
        for ep in ready:
            if self.max_tokens is not None and ep.length + self.sampling.max_new_tokens > self.max_tokens:
                self._drop_observation(ep)
                self._end(ep, "max_tokens")
            else:
                same.setdefault(tuple(ep.prompt_ids + ep.ids), []).append(ep)
        by_n: dict[int, list[tuple[int, ...]]] = {}
        for key, eps in same.items():
            by_n.setdefault(len(eps), []).append(key)
        for n, keys in by_n.items():
            seed_keys = [self._seed_key(same[k][0]) for k in keys]
            call = dataclasses.replace(self.sampling, seed=self.seed_of(seed_keys))

            def land(i: int, samples: list[Sample], keys: list = keys, n: int = n) -> None:
                eps = same[keys[i]]
                if len(samples) != n:
                    raise RolloutError(f"engine {self.engine.name} returned {len(samples)} samples for task "
                                       f"{eps[0].task.id}, not {n}; the engine is broken")
                for ep, sample in zip(eps, samples):
                    self._turn(ep, sample)

            prompts = [list(k) for k in keys]
            t0 = time.monotonic()
            if self.engine.rolling:
                # Each prompt's samples land as they finish, so single-turn groups reach their
                # chunk while the rest of the window is still being sampled.
                self.engine.generate(prompts, n, call, on_result=land)
                self.times.generation_s += time.monotonic() - t0
                continue
            results = self.engine.generate(prompts, n, call)
            self.times.generation_s += time.monotonic() - t0
            if len(results) != len(prompts):
                raise RolloutError(f"engine {self.engine.name} returned samples for {len(results)} of {len(prompts)} "
                                   f"prompts; the engine is broken")
            for i, samples in enumerate(results):
                land(i, samples)

    @staticmethod
    def _drop_observation(ep: Episode) -> None:
        """An observation no turn answers teaches nothing; without it the episode stays within
        max_episode_tokens (and the trainer's positions), which each turn was checked against."""
        if ep.turns and ep.loss_mask and not ep.loss_mask[-1]:
            keep = len(ep.loss_mask)
            while not ep.loss_mask[keep - 1]:
                keep -= 1
            del ep.ids[keep:], ep.loss_mask[keep:], ep.logprobs[keep:]
            ep.pieces.pop()
            while ep.messages and ep.messages[-1]["role"] != "assistant":
                ep.messages.pop()

    @staticmethod
    def _seed_key(ep: Episode) -> str:
        # A first turn keys on the task alone: a single-turn call is seeded as it always was.
        return ep.task.id if ep.turns == 0 else f"{ep.task.id}/{ep.index}/{ep.turns}"

    def _turn(self, ep: Episode, sample: Sample) -> None:
        self.times.turns += 1
        ep.turn_starts.append(len(ep.ids))
        ep.ids += sample.token_ids
        ep.loss_mask += [1] * len(sample.token_ids)
        ep.logprobs += list(sample.logprobs)
        ep.pieces.append(sample.text)
        ep.messages.append({"role": "assistant", "content": sample.text})
        ep.finish_reason = sample.finish_reason
        if self.factory is None:
            self._end(ep, "done")  # the one-turn case: the first completion is the whole episode
        else:
            self._submit(ep, "step", ep.env.step, sample.text)

    # -- the end of an episode -----------------------------------------------------------------
    def _end(self, ep: Episode, termination: str, error: str = "") -> None:
        ep.termination, ep.error = termination, error
        if error:
            _log.warning("episode %d of task %s ends (%s): %s", ep.index, ep.task.id, termination, error)
        if ep.env is not None and callable(getattr(ep.env, "close", None)):
            self.closing.append(self.calls.submit(ep.env.close))
        if termination not in FAILED and ep.turns:
            self._score(ep)
            if self.scoring.judge is not None and ep.finish_reason != TIMED_OUT:
                self.judging.append(ep)  # handed on once judged, with the round's other episodes
                return
        self._handed(ep)

    def _score(self, ep: Episode) -> None:
        """The parts every episode gets at its end (rollout/scoring.py); the judge's comes later."""
        if self.factory is not None:
            env = env_part(ep.step_rewards, self.scoring.env_reward)
            if env is not None:
                ep.reward_parts["env"] = env
        if self.factory is None or self.scoring.reward_with_env:
            last = next((m["content"] for m in reversed(ep.messages) if m["role"] == "assistant"), ep.text)
            try:
                # A CheckedReward hands the messages on to functions that take them (rollout/rewards.py).
                extra = {"messages": ep.messages} if isinstance(self.reward_fn, CheckedReward) else {}
                ep.reward_parts["reward"] = self.reward_fn(ep.task, last, ep.finish_reason, **extra)
            except RewardTimeout as exc:
                # One hung call must not stall the rank: the sample ends here, with its reason in its
                # row (counted by aggregation, its group kept out of training) and in the log.
                _log.warning("sample %d of task %s ends without a reward: %s", ep.index, ep.task.id, exc)
                ep.finish_reason, ep.reward_parts = TIMED_OUT, {}
        ep.reward = float(sum(ep.reward_parts.values()))

    def _judge(self) -> None:
        episodes, self.judging = self.judging, []
        verdicts = self.scoring.judge.score([(ep.task, ep.messages) for ep in episodes])
        for ep, verdict in zip(episodes, verdicts):
            if verdict.error:
                ep.termination, ep.error, ep.reward, ep.reward_parts = "judge_error", verdict.error, 0.0, {}
                _log.warning("episode %d of task %s ends (judge_error): %s", ep.index, ep.task.id, verdict.error)
            else:
                ep.reward_parts["judge"] = verdict.score
                ep.reward = float(sum(ep.reward_parts.values()))
            self._handed(ep)

    def _handed(self, ep: Episode) -> None:
        self.open[ep.task.id] -= 1
        if self.open[ep.task.id] == 0:
            self.on_group(EpisodeGroup(ep.task, self.groups.pop(ep.task.id)))

    def _close_all(self) -> None:
        """Close the environments of episodes still open (the run failed), then wait for every
        close within one env_step_timeout; a close past it is abandoned."""
        if self.calls is None:
            return
        for eps in self.groups.values():
            for ep in eps:
                if not ep.termination and ep.env is not None and callable(getattr(ep.env, "close", None)):
                    self.closing.append(self.calls.submit(ep.env.close))
        if not self.closing:
            return
        _, late = wait(self.closing, timeout=self.bounds.step_timeout)
        for fut in late:
            self.calls.abandon(fut)
        failed = [f.exception() for f in self.closing if f.done() and f.exception() is not None]
        if failed or late:
            _log.warning("%d environment close() calls raised (first: %r) and %d ran past %g s", len(failed),
                         failed[0] if failed else None, len(late), self.bounds.step_timeout)
        self.closing = []
