"""The rules `train.cp` (context parallelism, train/context.py) must satisfy, without torch: the
config check, the launch check (rl/validate's rule context-parallel-degree) and the trainer's own
check once it has the model all call these."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from coordination.config import ConfigError

if TYPE_CHECKING:
    from train.config import TrainConfig


# Ring attention's queries per block computation (train/ring.py): its float32 scores are
# [B, h, RING_QUERY_CHUNK, S], so with S = 16k positions per rank and 32 heads one chunk's scores
# take 1 GiB, whatever the sequence length.
RING_QUERY_CHUNK = 512


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_cp_world(cp: int, world_size: int) -> None:
    """cp consecutive ranks split one sequence: cp must divide the number of trainer processes."""
    if world_size % cp:
        raise ConfigError(f"train.cp={cp} does not divide the number of trainer processes ({world_size} = nodes x "
                          f"train.nproc_per_node); set train.cp to one of {_divisors(world_size)}")


def check_cp_node(cp: int, nproc_per_node: int) -> None:
    """A CP group exchanges every attention layer's queries, keys and values twice per pass: it
    must stay inside one node, so cp divides the processes of a node."""
    if nproc_per_node % cp:
        raise ConfigError(f"train.cp={cp} would split a sequence across nodes: a CP group must stay within one "
                          f"node's {nproc_per_node} trainer processes (train.nproc_per_node); set train.cp to one "
                          f"of {_divisors(nproc_per_node)}")


def check_cp_heads(cp: int, config: dict, attn: str, cp_kind: str = "ulysses") -> None:
    """Both kinds split plain causal attention (`config`: the model's config.json); Ulysses gives
    each rank of a group heads/cp query heads and kv_heads/cp kv heads, while ring attention
    keeps every head on every rank, so only Ulysses needs cp to divide the heads."""
    if cp == 1:
        return
    if attn != "sdpa":
        raise ConfigError(f"train.cp={cp} runs attention through PyTorch's SDPA on each rank's heads, but "
                          f"train.attn={attn}; set train.attn=sdpa or train.cp=1")
    kind = config.get("model_type", "this model")
    kinds = set(config.get("layer_types") or [])
    # transformers 5 names each layer's attention in layer_types; older configs only say whether
    # their sliding_window is in use.
    sliding = bool(kinds - {"full_attention"}) if kinds else \
        bool(config.get("sliding_window") and config.get("use_sliding_window", True))
    if sliding:
        raise ConfigError(f"train.cp={cp}: {kind}'s attention is not plain causal attention (layer types "
                          f"{sorted(kinds) or ['sliding window']}), which the context-parallel exchange computes "
                          f"over the whole sequence; set train.cp=1")
    if config.get("output_router_logits"):
        raise ConfigError(f"train.cp={cp}: {kind}'s config asks for the load-balancing loss "
                          f"(output_router_logits), which is computed over a micro-batch's whole sequences while "
                          f"each rank of a CP group routes only its slice of them; set output_router_logits to "
                          f"false in its config.json, or train.cp=1")
    if config.get("kv_lora_rank"):
        raise ConfigError(f"train.cp={cp}: {kind} compresses keys and values (multi-head latent attention, "
                          f"kv_lora_rank), which context parallelism does not split; set train.cp=1")
    if cp_kind == "ring":
        return
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    if not isinstance(heads, int):
        raise ConfigError(f"train.cp={cp}: {kind}'s config names no num_attention_heads to split; set train.cp=1")
    bad = [f"{name} {n}" for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)) if n % cp]
    if bad:
        common = [d for d in _divisors(heads) if kv_heads % d == 0]
        raise ConfigError(f"train.cp={cp} does not divide the model's {' and '.join(bad)}: every rank of a CP "
                          f"group attends with heads/cp query heads and kv_heads/cp kv heads; set train.cp to one "
                          f"of {common}, or train.cp_kind=ring (any head count)")


def check_cp_levers(cfg: "TrainConfig") -> None:
    """The levers context parallelism combines with in this build (the others are untested with
    it): FSDP2 over one mesh of all ranks, no expert parallelism, no torch.compile."""
    if cfg.cp < 1:
        raise ConfigError(f"train.cp must be at least 1 (got {cfg.cp}); 1 = no context parallelism")
    if cfg.cp == 1:
        return
    clashes = [f"{name}={value}" for name, value, ok in (
        ("train.backend", cfg.backend, cfg.backend == "fsdp"),
        ("train.dp_replicate", cfg.dp_replicate, cfg.dp_replicate == 1),
        ("train.ep", cfg.ep, cfg.ep == 1),
        ("train.compile", cfg.compile, cfg.compile is None),
        ("train.attn", cfg.attn, cfg.attn == "sdpa")) if not ok]
    if clashes:
        raise ConfigError(f"train.cp={cfg.cp} needs train.backend=fsdp, train.dp_replicate=1, train.ep=1, "
                          f"train.compile=null and train.attn=sdpa, but the config has {', '.join(clashes)}; "
                          f"change those or set train.cp=1")


def check_cp_launch(cfg: "TrainConfig", num_nodes: int, model_path: str | Path = "") -> None:
    """train.cp against the job's trainer processes and, when this node can read it, the model's
    attention: what the trainer would refuse at phase 10, found at start."""
    if cfg.cp == 1:
        return
    check_cp_node(cfg.cp, cfg.nproc_per_node)
    check_cp_world(cfg.cp, num_nodes * cfg.nproc_per_node)
    config = Path(model_path) / "config.json" if str(model_path) else None
    if config is not None and config.is_file():
        check_cp_heads(cfg.cp, json.loads(config.read_text()), cfg.attn, cfg.cp_kind)


def context_mesh_line(cfg: "TrainConfig", num_nodes: int) -> str:
    """The trainer's mesh under context parallelism, as the dry run prints it."""
    world = num_nodes * cfg.nproc_per_node
    return (f"mesh: {world} trainer processes = dp {world // cfg.cp} x cp {cfg.cp} ({cfg.cp_kind}); FSDP2 shards over "
            f"all {world}, each CP group of {cfg.cp} consecutive ranks on one node splits every sequence")
