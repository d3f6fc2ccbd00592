"""Benchmarks: the top layer, above rl/ (docs/design.md §3). Each drives the layers below it the
way a user does (whole runs through scripts/run.sh, the trainer under torchrun, engines, the
protocol on many local processes) and prints one JSON document with `--json`. One command runs
them all: `python -m bench --what WHAT [OPTIONS]` (bench/__main__.py)."""
