"""Training: trajectories -> advantages -> torchrun trainer (FSDP2/DDP) -> published checkpoint.

Phase 8 `data.prepare_training_data` writes per-rank shards and the plan; phase 10 runs
`torchrun ... -m train.trainer --plan PLAN` (command from `launch.torchrun_command`) on every
node; the trainer publishes `checkpoints/iter-N` (`checkpoint.publish_checkpoint`) and writes
per-rank result records (`results.read_results`). `python -m train.sft` warm-starts a model,
`python -m train.tiny` writes the tiny CPU model, `python -m train.bench` measures a step.
"""
