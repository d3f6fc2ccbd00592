"""The `web` environment: a text browser over a real HTTP site, the shape of a WebGym task.

A task names its question (`prompt`), the page to start from (`url`) and the expected `answer`.
The observation is the page's text followed by its links, numbered:

    Page: http://127.0.0.1:8000/index.html
    Directory
    Every section of the directory.
    Links:
    [1] Alder Fen
    [2] Brimor Dotor

The policy acts with `open <number>` (or `open <link text>`) to follow a link of the current page,
or `answer <text>` to end the episode: reward 1.0 when the text equals the task's answer
(ignoring case and surrounding space and punctuation), else 0.0. A turn with neither action is
answered with how to act (the turn is spent). Only the http(s) links of the page shown can be
opened, so a policy cannot send the environment to an address the site does not link, nor to a
file of the node.

Every request is bounded: `http_timeout` seconds (task field, default 10) for the connection and
each read, and at most `max_page_bytes` (default 65536) of a page are read (the observation says
where it was cut). A server that cannot be reached, refuses, resets or stops answering raises
WebError naming the URL and the cause, which ends the episode as `env_error` with that reason
(rollout/episodes.py). An HTTP error status is a page like any other: the observation says it.
"""
from __future__ import annotations

import re
import urllib.error
import urllib.request
from html.parser import HTMLParser
from typing import Any
from urllib.parse import urljoin, urlsplit

from rollout.envs import Step

HTTP_TIMEOUT = 10.0
MAX_PAGE_BYTES = 65536
ACTION = re.compile(r"^\s*(open|answer)\b[ \t:]*(.*)$", re.I | re.M)
_SKIPPED = {"script", "style", "head"}
HOW = "Act with `open <link number>` to follow a link or `answer <text>` to answer."


class WebError(RuntimeError):
    """A page could not be fetched (the server is unreachable, refused, reset or timed out)."""


class _Text(HTMLParser):
    """The visible text of a page (one line per block) and its links in order."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.lines: list[str] = [""]
        self.links: list[tuple[str, str]] = []  # (text, href)
        self._href: str | None = None
        self._anchor: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in _SKIPPED:
            self._skip += 1
        elif tag == "a":
            self._href, self._anchor = dict(attrs).get("href"), []
        elif tag in ("p", "li", "h1", "h2", "h3", "div", "br", "tr", "title"):
            self.lines.append("")

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIPPED:
            self._skip = max(0, self._skip - 1)
        elif tag == "a" and self._href is not None:
            text = " ".join("".join(self._anchor).split())
            if text:
                self.links.append((text, self._href))
            self._href = None

    def handle_data(self, data: str) -> None:
        if self._skip:
            return
        if self._href is not None:
            self._anchor.append(data)
        else:
            self.lines[-1] += data

    def text(self) -> str:
        return "\n".join(" ".join(line.split()) for line in self.lines if line.strip())


def _positive(task: Any, key: str, default: float) -> float:
    value = task.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"task {task['id']!r}: {key}={value!r} must be a positive number (default {default:g}); "
                         f"fix the task")
    return value


def _normal(text: str) -> str:
    return " ".join(text.strip().strip(".,;:!?\"'`").split()).lower()


class Web:
    def __init__(self, task: Any):
        self.task = task
        self.start = task.get("url")
        if not isinstance(self.start, str) or urlsplit(self.start).scheme not in ("http", "https"):
            raise ValueError(f"task {task['id']!r}: url={self.start!r} is not an http(s) URL; give the start page's "
                             f"full address as the task's 'url'")
        self.timeout = _positive(task, "http_timeout", HTTP_TIMEOUT)
        self.max_bytes = int(_positive(task, "max_page_bytes", MAX_PAGE_BYTES))
        self.links: list[tuple[str, str]] = []  # (text, absolute URL) of the page shown last

    def reset(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{self.task['prompt']}\n{HOW}\n\n{self._open(self.start)}"}]

    def step(self, text: str) -> Step:
        action = ACTION.search(text)
        if action is None:
            return Step([{"role": "user", "content": f"No action found. {HOW}"}], None, False)
        verb, arg = action.group(1).lower(), action.group(2).strip()
        if verb == "answer":
            solved = _normal(arg) == _normal(str(self.task["answer"]))
            return Step([], 1.0 if solved else 0.0, True)
        url = self._link(arg)
        if url is None:
            listed = ", ".join(f"[{i}] {t}" for i, (t, _) in enumerate(self.links, 1)) or "none"
            return Step([{"role": "user", "content": f"No link {arg!r} on this page (links: {listed}). {HOW}"}],
                        None, False)
        return Step([{"role": "user", "content": self._open(url)}], None, False)

    def _link(self, arg: str) -> str | None:
        number = re.fullmatch(r"\[?(\d+)\]?", arg)
        if number is not None:
            k = int(number.group(1))
            return self.links[k - 1][1] if 1 <= k <= len(self.links) else None
        wanted = _normal(arg)
        return next((url for text, url in self.links if _normal(text) == wanted), None)

    def _open(self, url: str) -> str:
        """The page at `url` as the observation text; its links become the ones `open` can follow."""
        body, status, cut = self._fetch(url)
        page = _Text()
        page.feed(body.decode("utf-8", errors="replace"))
        page.close()
        # Only http(s) links are listed: a page linking file:// must not let the policy read this node's files.
        links = [(text, urljoin(url, href)) for text, href in page.links]
        self.links = [(text, target) for text, target in links if urlsplit(target).scheme in ("http", "https")]
        lines = [f"Page: {url}"]
        if status != 200:
            lines.append(f"HTTP status {status}")
        lines.append(page.text())
        if cut:
            lines.append(f"[page cut at {self.max_bytes} bytes]")
        lines.append("Links:" if self.links else "Links: none")
        lines += [f"[{i}] {text}" for i, (text, _) in enumerate(self.links, 1)]
        return "\n".join(lines)

    def _fetch(self, url: str) -> tuple[bytes, int, bool]:
        """(at most max_bytes of the body, status, whether the body was longer), or WebError."""
        try:
            try:
                with urllib.request.urlopen(url, timeout=self.timeout) as response:
                    status, body = response.status, response.read(self.max_bytes + 1)
            except urllib.error.HTTPError as exc:  # a status page is still a page
                with exc:
                    status, body = exc.code, exc.read(self.max_bytes + 1)
        except (urllib.error.URLError, OSError) as exc:  # refused, reset, unresolvable, timed out
            reason = getattr(exc, "reason", None) or exc
            raise WebError(f"cannot fetch {url}: {reason} (http_timeout={self.timeout:g} s); is the site's server "
                           f"running and reachable from this node?") from None
        return body[:self.max_bytes], status, len(body) > self.max_bytes
