"""One side of an exclusive-create race, for the netfs tier:

    python -m tests.create_racer FOLDER SYNC_FOLDER ME OTHER COUNT

For each i below COUNT: marks `SYNC_FOLDER/i-ME`, waits for `SYNC_FOLDER/i-OTHER` (a local
folder, so both sides start each create within about a millisecond), then calls `create_record`
on `FOLDER/claim-i`. Prints one JSON line: {"won": [i...], "lost": [i...], "errors": {i: text}}."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from coordination.records import create_record


def main() -> int:
    folder, sync, me, other, count = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    out: dict = {"won": [], "lost": [], "errors": {}}
    for i in range(count):
        (sync / f"{i}-{me}").touch()
        deadline = time.monotonic() + 30
        while not (sync / f"{i}-{other}").exists():
            if time.monotonic() > deadline:
                out["errors"][i] = f"{other} did not reach name {i} within 30 s"
                print(json.dumps(out), flush=True)
                return 1
            time.sleep(0.0005)
        try:
            won = create_record(folder / f"claim-{i}", "claim", {"by": me}, run_id="race", generation=1)
        except OSError as exc:
            out["errors"][i] = repr(exc)
            continue
        out["won" if won else "lost"].append(i)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
