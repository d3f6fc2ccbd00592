"""Phase start/end events of one rank, one JSON line each (docs/design.md §4 `timeline/`, §11.2).

Each rank appends only to its own file (one writer per file); the file is opened, appended and
closed per event, never held open. `report` draws these as a Gantt chart per rank."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

from coordination.exhaustion import naming
from coordination.records import ensure_dir, fence_check, open_own, own_opener

log = logging.getLogger("baton.timeline")


def append(path: Path, event: dict[str, Any]) -> None:
    fence_check()  # a superseded process adds no line, not even a folder (docs/design.md §5 rule 7)
    ensure_dir(Path(path).parent)
    line = (json.dumps(event, sort_keys=True) + "\n").encode()
    fd = own_opener(str(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT)  # never through a planted link
    try:
        with naming(path):  # os.write names no file; a full disk's stop line must
            os.write(fd, line)  # one write of a short line: never interleaved with a half line
    finally:
        os.close(fd)


def read(path: Path) -> Iterator[dict[str, Any]]:
    """Events of one timeline file. A line that is not a JSON object (a torn last line of a writer
    killed mid-write, or bytes that are not UTF-8) is skipped with a warning naming file and line:
    a report draws what it can instead of failing on one damaged line. A timeline that is a link
    is refused (LinkInRunFolder), never read as this run's."""
    try:
        with open_own(Path(path), "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return
    for lineno, raw in enumerate(data.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            event = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            log.warning("%s:%d: skipped a damaged timeline line (%s)", path, lineno, type(exc).__name__)
            continue
        if isinstance(event, dict):
            yield event
        else:
            log.warning("%s:%d: skipped a timeline line that is not an event object", path, lineno)
