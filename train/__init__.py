"""Training: trajectories -> advantages -> torchrun trainer (FSDP2/DDP) -> staged checkpoint.

Phase 8 `data.prepare_training_data` writes per-rank shards and the plan; phase 10 gives the plan
to the node's resident trainer (`resident.ResidentTrainer`, `python -m train.trainer --resident`)
or runs `torchrun ... -m train.trainer --plan PLAN` (command from `launch.torchrun_command`); the
trainer stages the checkpoint folder and writes per-rank result records (`results.read_results`);
phase 11 publishes it (`coordination.checkpoints.publish_checkpoint`). `python -m train.sft`
warm-starts a model, `python -m train.tiny` writes the tiny CPU model. The training benchmarks
live in bench/ (`python -m bench --what train|levers|load-publish|iteration`).
"""
