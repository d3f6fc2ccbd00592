"""One contender for a rank, for the claim race tests:

    python -m tests.claim_contender RUN_DIR RANK GO_FILE HOLD_SECONDS

Waits until GO_FILE exists (so that every contender starts its claim at the same moment), joins
the rank (claim + heartbeat), prints one JSON line {"pid", "generation"} or {"pid", "refused"},
and, if it won, holds the rank for HOLD_SECONDS before saying goodbye."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from coordination.claims import ClaimRefused
from coordination.config import CoordinationConfig
from coordination.layout import RunLayout
from coordination.node import Node


def main() -> int:
    run_dir, rank, go, hold = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4])
    cfg = CoordinationConfig(heartbeat_interval=0.5, peer_timeout=3, rejoin_timeout=30)
    while not go.exists():
        time.sleep(0.002)
    try:
        node = Node.join(RunLayout(run_dir), "both", rank, 2, run_id="race", cfg=cfg)
    except ClaimRefused as exc:
        print(json.dumps({"pid": os.getpid(), "refused": str(exc)}), flush=True)
        return 3
    print(json.dumps({"pid": os.getpid(), "generation": node.generation}), flush=True)
    time.sleep(hold)
    node.close("exited", "race over")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
