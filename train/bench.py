"""`python -m train.bench [--iteration|--levers|--load-publish]`: the training benchmarks under
their name from before the benchmarks moved to the top layer; it is `python -m bench --what train`
(bench/train_steps.py)."""
from bench.train_steps import main

if __name__ == "__main__":
    main(prog_name="python -m train.bench")
