"""The trainer's device mesh in words, from the config alone (no torch): what `--dry-run` prints.

FSDP2 shards the dense weights over dp_shard = processes / dp_replicate ranks (train/parallel.py);
with train.ep the experts live on a separate (ep_replicate, ep) mesh of the same processes
(train/expert.py): ep consecutive ranks split each layer's experts, ep_replicate = processes / ep
such groups hold copies. Context parallelism (train.cp, where this build has it) splits each
sequence over cp ranks; 1 when the config has no such key.
"""
from __future__ import annotations

from typing import Any


def mesh_line(train: Any, world_size: int) -> str:
    cp = getattr(train, "cp", 1)
    if train.backend != "fsdp":
        return f"trainer mesh: {world_size} process(es), DDP (every rank holds every weight); cp={cp}"
    shard = world_size // train.dp_replicate
    experts = (f"; experts: ep_replicate={world_size // train.ep} x ep={train.ep} (each rank keeps 1/{train.ep} "
               f"of every layer's experts, whole)") if train.ep > 1 else ""
    return (f"trainer mesh: {world_size} process(es); FSDP2 dp_replicate={train.dp_replicate} x "
            f"dp_shard={shard}{experts}; cp={cp}")
