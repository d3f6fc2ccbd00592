"""Launches children through the real launch path while other threads hold and churn import locks:

    python tests/launch_contender.py LOG_FILE COUNT MODULE_FOLDER

Before any launch, one thread holds the module lock of `ctypes` (not imported yet) for good, the
way a thread that is importing a module holds it at the moment another thread forks, and two
threads import fresh modules from MODULE_FOLDER (each takes ~1 ms to run) without pause. A forked
child that ran any Python import would wait forever on the held lock. Prints one JSON line:
{"launched": N, "seconds": S} after COUNT children ran `true` and exited 0."""
from __future__ import annotations

import importlib
import importlib._bootstrap as bootstrap
import json
import os
import sys
import threading
import time
from pathlib import Path


def main() -> int:
    log_file, count, modules = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    from coordination.procgroup import start_child  # the launch path imports no ctypes itself
    if "ctypes" in sys.modules:
        print("ctypes is imported already: the held lock would prove nothing", file=sys.stderr)
        return 2
    held, stop = threading.Event(), threading.Event()

    def hold_ctypes_lock() -> None:
        with bootstrap._ModuleLockManager("ctypes"):
            held.set()
            stop.wait()

    def churn(first: int) -> None:
        i = first
        while not stop.is_set():
            name = f"churn_{i}"
            (modules / f"{name}.py").write_text("import time\nt = time.monotonic()\nwhile time.monotonic() - t < 0.001:\n"
                                                "    pass\n")
            importlib.invalidate_caches()
            importlib.import_module(name)
            i += 2

    sys.path.insert(0, str(modules))
    threading.Thread(target=hold_ctypes_lock, daemon=True).start()
    held.wait()
    for first in (0, 1):
        threading.Thread(target=churn, args=(first,), daemon=True).start()
    t0 = time.monotonic()
    for _ in range(count):
        child = start_child(["true"], env=dict(os.environ), log_file=log_file, what="probe", start_timeout=60)
        code = child.wait(60)
        child.join_output()
        if code != 0:
            print(f"a child exited with code {code}", file=sys.stderr)
            return 1
    stop.set()
    print(json.dumps({"launched": count, "seconds": round(time.monotonic() - t0, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
