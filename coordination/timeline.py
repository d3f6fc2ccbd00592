"""Phase start/end events of one rank, one JSON line each (DESIGN §4 `timeline/`).

Each rank appends only to its own file (one writer per file); the file is opened, appended and
closed per event, never held open. `report` draws these as a Gantt chart per rank."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from coordination.records import ensure_dir, own_opener


def append(path: Path, event: dict[str, Any]) -> None:
    ensure_dir(Path(path).parent)
    line = (json.dumps(event, sort_keys=True) + "\n").encode()
    fd = own_opener(str(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT)  # never through a planted link
    try:
        os.write(fd, line)  # one write of a short line: never interleaved with a half line
    finally:
        os.close(fd)


def read(path: Path) -> Iterator[dict[str, Any]]:
    """Events of one timeline file; a torn last line (writer killed mid-write) is skipped."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue
