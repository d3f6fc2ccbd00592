"""One process of the barrier stress test: ROUNDS barriers in a row on one log path.

Each arrival carries a value; the master releases GO with the sum of what it read. Every
process checks after each GO that all N arrivals of the round exist and that the sum is right:
a GO released before the last arrival would fail one of the two checks."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from coordination.barrier import Barrier
from coordination.config import CoordinationConfig
from coordination.join import join_job
from coordination.layout import RunLayout
from coordination.records import read_record


def main(log_path: str, rank: int, n: int, rounds: int) -> None:
    layout = RunLayout(Path(log_path))
    cfg = CoordinationConfig(heartbeat_interval=1.0, peer_timeout=30.0)
    node = join_job(layout, job="both", rank=rank, num_nodes=n, job_facts={"rank_weights": [1] * n},
                    config={"test": "rounds"}, cfg=cfg)
    done = []
    try:
        for k in range(1, rounds + 1):
            b = Barrier(node, k, 0, "sync")
            b.arrive(payload={"value": rank * 1000 + k})
            if node.is_master:
                arrivals = b.wait_arrivals(list(range(n)))
                go = b.release("continue", payload={"sum": sum(a.payload["value"] for a in arrivals.values())})
            else:
                go = b.wait_go()
            present = [read_record(node.job.arrival(k, 0, "sync", r)).data["payload"]["value"] for r in range(n)]
            expected = sum(r * 1000 + k for r in range(n))
            if go.payload["sum"] != expected or sum(present) != expected:
                raise SystemExit(f"round {k}: early or wrong release: GO sum {go.payload['sum']}, "
                                 f"arrivals {present}, expected {expected}")
            done.append(k)
    finally:
        node.close()
    print(json.dumps({"rank": rank, "rounds": done}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
