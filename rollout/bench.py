"""`python -m rollout.bench`: the rollout benchmarks under their name from before the benchmarks
moved to the top layer; it is `python -m bench --what rollout` (bench/rollout_speed.py)."""
from bench.rollout_speed import main

if __name__ == "__main__":
    main(prog_name="python -m rollout.bench")
