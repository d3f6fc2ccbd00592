"""The RL job: the CLI, the run config, the phase bindings, the dry run and the pipelined jobs.

It sits above coordination/ (the protocol), rollout/ and train/, and nothing below imports it
(docs/design.md §3).
"""
