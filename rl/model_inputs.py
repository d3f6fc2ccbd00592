"""The starting model against the run's inputs, checked before anything is written (docs/design.md
§5 rule 10): model.path holds a config.json transformers loads, rollout.max_new_tokens leaves room
for a prompt in the model's context, and every prompt this job samples from fits in that context
with max_new_tokens after it. Without these checks the first rollout found them, in phase 1, after
the run folder was written and the trainers launched.

Each rule is a small function whose ConfigError names the value and the fix.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from coordination.config import ConfigError
from rollout.prompts import encode_prompt


def load_model_config(model_path: str) -> Any:
    """model.path's config.json as transformers reads it (what every engine and the trainer load)."""
    from transformers import AutoConfig

    folder = Path(model_path)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model.path={model_path} holds no config.json; give a Hugging Face model folder "
                          f"(config.json, tokenizer and safetensors weights)")
    try:
        return AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"model.path={model_path}: config.json cannot be loaded ({_first_line(exc)}); give a "
                          f"Hugging Face model folder whose config.json transformers reads") from None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def model_context(model_config: Any, max_model_len: int = 0) -> int | None:
    """Positions a prompt and its completion share: vLLM's max_model_len when set, else the
    model's max_position_embeddings (of its text model for multimodal configs); None if unknown."""
    if max_model_len:
        return max_model_len
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def _where(context: int, max_model_len: int) -> str:
    return (f"inference.vllm.max_model_len={max_model_len}" if max_model_len
            else f"the model's {context} positions (max_position_embeddings in model.path's config.json)")


def check_max_new_tokens(max_new_tokens: int, context: int, max_model_len: int = 0) -> None:
    if max_new_tokens >= context:
        raise ConfigError(f"rollout.max_new_tokens={max_new_tokens} leaves no room for a prompt in "
                          f"{_where(context, max_model_len)}; lower rollout.max_new_tokens below {context}")


def check_prompt_lengths(tokenizer: Any, tasks: Sequence[Any], source: Path, max_new_tokens: int, context: int,
                         max_model_len: int = 0) -> None:
    """The longest prompt of `tasks` (from `source`) with max_new_tokens after it fits `context`."""
    plain = [t for t in tasks if not t.get("messages")]
    lengths: list[tuple[int, Any]] = []
    if plain:  # one batched call: a fast tokenizer does a whole task file in well under a second
        ids = tokenizer([t["prompt"] for t in plain], add_special_tokens=True)["input_ids"]
        lengths += [(len(i), t) for i, t in zip(ids, plain)]
    lengths += [(len(encode_prompt(tokenizer, t)), t) for t in tasks if t.get("messages")]
    if not lengths:
        return
    longest, task = max(lengths, key=lambda lt: lt[0])
    if longest + max_new_tokens > context:
        raise ConfigError(f"task {task['id']!r} of {source} has a prompt of {longest} tokens: with "
                          f"rollout.max_new_tokens={max_new_tokens} it needs {longest + max_new_tokens} positions, "
                          f"more than {_where(context, max_model_len)}; shorten or drop the task, or lower "
                          f"rollout.max_new_tokens")


def check_model_inputs(cfg: Any, pools: dict[str, tuple[Sequence[Any], Path]]) -> None:
    """Every rule above for a job that samples from the model (`pools`: split -> (tasks, file))."""
    model_config = load_model_config(cfg.model.path)
    max_model_len = cfg.inference.vllm.max_model_len if cfg.inference.engine == "vllm" else 0
    context = model_context(model_config, max_model_len)
    if context is None:
        return  # the model states no limit: the engine is the judge
    max_new = cfg.rollout.max_new_tokens
    check_max_new_tokens(max_new, context, max_model_len)
    if cfg.tasks.env and cfg.rollout.max_episode_tokens > context:
        raise ConfigError(f"rollout.max_episode_tokens={cfg.rollout.max_episode_tokens} is more than "
                          f"{_where(context, max_model_len)}: an episode could outgrow the model; set "
                          f"rollout.max_episode_tokens={context} or lower")
    if not pools:
        return
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path={cfg.model.path}: its tokenizer cannot be loaded ({_first_line(exc)}); give "
                          f"a model folder with its tokenizer files") from None
    for tasks, source in pools.values():
        check_prompt_lengths(tokenizer, tasks, source, max_new, context, max_model_len)
