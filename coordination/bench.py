"""`python -m coordination.bench`: the coordination benchmark under its name from before the
benchmarks moved to the top layer; it is `python -m bench --what coordination` (bench/protocol.py)."""
from bench.protocol import main

if __name__ == "__main__":
    main(prog_name="python -m coordination.bench")
