"""`python -m bench --what WHAT [OPTIONS]`: every benchmark behind one command; OPTIONS are those
of the chosen benchmark (`python -m bench --what WHAT --help`). `python -m coordination.bench`,
`python -m rollout.bench` and `python -m train.bench` are the same commands under the names they
had before the benchmarks moved here."""
from __future__ import annotations

import importlib
import sys

# WHAT -> (module with a click `main`, options it always gets, what it measures).
WHAT: dict[str, tuple[str, tuple[str, ...], str]] = {
    "coordination": ("bench.protocol", (), "the 14-phase table with no-op phases on N local processes: "
                     "the protocol's own cost per iteration and barrier"),
    "rollout": ("bench.rollout_speed", (), "aggregation of 8 ranks x 100,000 samples; samples/s of the engines"),
    "env": ("bench.rollout_speed", ("--env",), "environment episodes (200 ms steps) at concurrency 1 and 32 "
            "against the bound of generation and environment waits"),
    "vllm": ("bench.vllm_speed", (), "one vLLM server on CPU: start, samples/s, reload, stop"),
    "train": ("bench.train_steps", (), "tokens/s and peak memory of DDP and FSDP2 steps on 1 and 2 processes"),
    "levers": ("bench.train_steps", ("--levers",), "each memory/speed lever against the plain trainer"),
    "load-publish": ("bench.train_steps", ("--load-publish",),
                     "load memory and publication time of a ~200M model, full-copy against sharded"),
    "iteration": ("bench.train_steps", ("--iteration",),
                  "whole RL iterations through scripts/run.sh, resident trainer against restarts"),
}


def usage() -> str:
    width = max(map(len, WHAT))
    return ("usage: python -m bench --what WHAT [OPTIONS]   (OPTIONS: python -m bench --what WHAT --help)\n\n"
            + "\n".join(f"  {name:<{width}}  {about}" for name, (_, _, about) in WHAT.items()))


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if argv[:1] == ["--what"] and len(argv) >= 2:
        what, rest = argv[1], argv[2:]
    elif argv[:1] and argv[0].startswith("--what="):
        what, rest = argv[0].split("=", 1)[1], argv[1:]
    else:
        print(f"{usage()}\n\nerror: the first option must be --what WHAT (got {' '.join(argv) or 'nothing'})",
              file=sys.stderr)
        return 2
    if what not in WHAT:
        print(f"{usage()}\n\nerror: --what {what!r} is none of {', '.join(WHAT)}", file=sys.stderr)
        return 2
    module, fixed, _ = WHAT[what]
    # Imported by name only once chosen: the training benchmarks load more than the protocol's, and
    # `--help` and a wrong --what should answer at once.
    command = importlib.import_module(module).main
    return command.main(args=[*fixed, *rest], prog_name=f"python -m bench --what {what}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
