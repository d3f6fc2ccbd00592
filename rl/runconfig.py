"""The whole run's config: every component's section, composed (top layer, with the driver).

configs/default.yaml documents every key of this tree; `key=value` on the command line
overrides any of them, for example `train.lr=1e-4 rollout.group_size=16`.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml

from coordination.config import ConfigError, CoordinationConfig, load, non_negative, option, positive, section
from rollout.config import RolloutConfig, TasksConfig
from rollout.inference import InferenceConfig, resolve_between_iterations
from train.config import TrainConfig

DEFAULT_YAML = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"


@dataclass
class RunSection:
    """The run as a whole; `--data-path` and `--eval-interval` land here."""

    data_path: str = option("", "folder holding the task files (set by --data-path)")
    eval_interval: int = option(
        0, "evaluate at iterations 1, 1+K, 1+2K ... (set by --eval-interval K; 0 = never)")
    final_eval: bool = option(
        True, "after the last iteration, evaluate the final checkpoint once more (when eval_interval > 0)")
    max_iterations: int = option(10, "the run stops after this many iterations (every node exits 0)")
    max_staleness: int = option(
        0, "pipelined rollout/update jobs: rollout iteration N samples from a checkpoint no older than "
           "N - 1 - max_staleness (0 = strict alternation)")
    seed: int = option(0, "seed of everything not seeded in its own section")

    def __post_init__(self) -> None:
        if self.eval_interval < 0:  # the one check of --eval-interval too: the flag sets this key
            raise ConfigError(f"eval_interval must be 0 or a positive number of iterations (got {self.eval_interval});"
                              f" give --eval-interval K (or run.eval_interval) with K >= 0, 0 turns evaluation off")
        positive(self.max_iterations, "max_iterations")
        non_negative(self.max_staleness, "max_staleness")


@dataclass
class ModelSection:
    """The starting policy."""

    path: str = option("", "Hugging Face checkpoint folder the run starts from (iteration 0's policy); "
                           "every node must see it at this path")


@dataclass
class WandbSection:
    mode: Literal["offline", "online", "disabled"] = option(
        "offline", "Weights & Biases logging of the per-iteration metrics (by the master): offline (files under "
                   "<log-path>/wandb, upload later with `wandb sync`), online, or disabled")
    project: str = option("baton", "W&B project name")


@dataclass
class LoggingSection:
    """Where metrics go besides metrics/iter-N.json (node-local: may differ between nodes)."""

    tensorboard: bool = option(False, "also write TensorBoard event files under <log-path>/tensorboard")
    wandb: WandbSection = section(WandbSection, "Weights & Biases")
    level: Literal["DEBUG", "INFO", "WARNING"] = option("INFO", "log level of the driver")


@dataclass
class RunConfig:
    run: RunSection = section(RunSection, "the run as a whole")
    model: ModelSection = section(ModelSection, "the starting policy")
    coordination: CoordinationConfig = section(CoordinationConfig, "how nodes find each other and wait")
    tasks: TasksConfig = section(TasksConfig, "task files and reward")
    rollout: RolloutConfig = section(RolloutConfig, "sampling and rollout chunks")
    inference: InferenceConfig = section(InferenceConfig, "the inference engine")
    train: TrainConfig = section(TrainConfig, "the trainer")
    logging: LoggingSection = section(LoggingSection, "metrics outputs")

    def __post_init__(self) -> None:
        # `auto` is decided once, here, so the recorded config.yaml, --dry-run and every phase
        # see the mode that runs.
        self.inference.between_iterations = resolve_between_iterations(
            self.inference, resident_trainer=self.train.resident)


def load_run_config(yaml_files: list[Path], overrides: list[str], flags: dict | None = None) -> RunConfig:
    """defaults <- configs/default.yaml <- each --config file <- the flags that are config keys
    (typed: `{"run.eval_interval": 2}`) <- key=value overrides."""
    files = [DEFAULT_YAML] + [Path(f) for f in yaml_files]
    return load(RunConfig, files, overrides, flags)


def default_yaml() -> str:
    """configs/default.yaml as it must read: every key with its default and its help text.
    `python -m rl.runconfig > configs/default.yaml` regenerates it after a field changes;
    a test fails when the file and the dataclasses disagree."""
    def emit(cls: type, indent: int) -> list[str]:
        lines, hints, inst = [], typing.get_type_hints(cls), cls()
        for f in dataclasses.fields(cls):
            pad, tp, help_ = "  " * indent, hints[f.name], f.metadata.get("help", "")
            if dataclasses.is_dataclass(tp):
                lines += ["", f"{pad}# {help_}", f"{pad}{f.name}:"] + emit(tp, indent + 1)
                continue
            value = yaml.safe_dump(getattr(inst, f.name), default_flow_style=True, width=1000).strip()
            value = value.removesuffix("...").strip()
            lines.append(f"{pad}{f.name}: {value}  # {help_}")
        return lines

    header = ["# baton: every config key, with its default and what it means.",
              "# Generated from the config dataclasses: python -m rl.runconfig > configs/default.yaml",
              "# Override in a YAML file (scripts/run.sh --config FILE) or on the command line (train.lr=1e-4)."]
    return "\n".join(header + emit(RunConfig, 0)).replace("\n\n\n", "\n\n") + "\n"


if __name__ == "__main__":
    print(default_yaml(), end="")
