"""A small generated web site for the `web` environment (rollout/envs/web.py), and its server.

`python -m rollout.envs.web_site --out DIR [--port 0]` writes a site of linked HTML pages under
DIR/site: a directory page links to sections, each section to its items, and each item page
states one fact ("The code of Alder Fen is 4821."). It then serves DIR/site over HTTP on
127.0.0.1 (port 0: a free one), writes one task per item (the question, the start URL, the
answer) into DIR/train.jsonl and, every fourth, DIR/eval.jsonl, so DIR is a `--data-path` for
`tasks.env=web`, then DIR/server.json (url, pid), prints the URL and serves until SIGTERM or
SIGINT. A fact lies two links from the start page, through the right section, so an agent finds
it by following links. Everything is derived from --seed: the same seed writes the same site,
whatever the port.
"""
from __future__ import annotations

import argparse
import functools
import html
import json
import os
import random
import signal
import sys
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_SYLLABLES = ("al", "der", "fen", "bri", "mor", "ca", "lin", "tor", "vel", "sun", "ra", "kel", "do", "mi", "ston")


def _name(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = " ".join("".join(rng.choice(_SYLLABLES) for _ in range(2)).capitalize() for _ in range(2))
        if name not in taken:
            taken.add(name)
            return name


def _page(title: str, body: str) -> str:
    return (f"<!doctype html>\n<html><head><title>{html.escape(title)}</title></head>\n"
            f"<body><h1>{html.escape(title)}</h1>\n{body}\n</body></html>\n")


def _links(items: list[tuple[str, str]]) -> str:
    return "<ul>\n" + "".join(f'<li><a href="{href}">{html.escape(text)}</a></li>\n' for href, text in items) + "</ul>"


def write_site(root: Path, *, sections: int = 3, items: int = 4, seed: int = 0) -> list[dict[str, str]]:
    """Write the pages under `root`; return one fact per item page: {"item", "path", "answer"}."""
    if sections < 1 or items < 1 or sections * items < 4:
        raise ValueError(f"a site needs sections x items >= 4 facts, so that train and eval both get tasks (got "
                         f"sections={sections}, items={items})")
    rng, taken = random.Random(seed), set()
    facts: list[dict[str, str]] = []
    section_links = []
    for s in range(sections):
        section = _name(rng, taken)
        item_links = []
        for i in range(items):
            item, code = _name(rng, taken), str(rng.randint(1000, 9999))
            path = f"s{s}/i{i}.html"
            (root / f"s{s}").mkdir(parents=True, exist_ok=True)
            (root / path).write_text(_page(item, f"<p>{html.escape(item)} belongs to {html.escape(section)}.</p>\n"
                                                 f"<p>The code of {html.escape(item)} is {code}.</p>\n"
                                                 + _links([("index.html", f"Back to {section}")])))
            item_links.append((f"i{i}.html", item))
            facts.append({"item": item, "path": path, "answer": code})
        (root / f"s{s}" / "index.html").write_text(
            _page(section, f"<p>Places of {html.escape(section)}.</p>\n" + _links(item_links + [("../index.html",
                                                                                                  "Directory")])))
        section_links.append((f"s{s}/index.html", section))
    (root / "index.html").write_text(_page("Directory", "<p>Every section of the directory.</p>\n"
                                           + _links(section_links)))
    return facts


def tasks_for(facts: list[dict[str, str]], base_url: str) -> dict[str, list[dict[str, str]]]:
    """One `web` task per fact (start at the directory page, answer with the item's code), split
    into train and eval: every fourth fact is an eval task."""
    tasks = [{"id": f"web-{n}", "prompt": f"What is the code of {f['item']}?", "url": f"{base_url}/index.html",
              "answer": f["answer"]} for n, f in enumerate(facts)]
    return {"train": [t for n, t in enumerate(tasks) if n % 4 != 3], "eval": tasks[3::4]}


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        pass  # one line per request on stderr would drown the log of a run


def serve(out: Path, *, host: str, port: int, sections: int, items: int, seed: int) -> None:
    site = out / "site"
    facts = write_site(site, sections=sections, items=items, seed=seed)
    server = ThreadingHTTPServer((host, port), functools.partial(_Quiet, directory=str(site)))
    server.daemon_threads = True
    url = f"http://{host}:{server.server_address[1]}"
    # Tasks and server.json name the bound port, so they are written after the bind; server.json
    # last, by rename: a reader that sees it finds the tasks too and a server that answers.
    for split, tasks in tasks_for(facts, url).items():
        (out / f"{split}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    (out / "server.json.tmp").write_text(json.dumps({"url": url, "pid": os.getpid()}))
    os.replace(out / "server.json.tmp", out / "server.json")
    print(f"serving {len(facts)} facts at {url}/index.html; tasks in {out}/train.jsonl and eval.jsonl", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rollout.envs.web_site", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True,
                        help="folder for site/, train.jsonl, eval.jsonl and server.json")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (default: loopback only)")
    parser.add_argument("--port", type=int, default=0, help="port (0: a free one, written to server.json)")
    parser.add_argument("--sections", type=int, default=3)
    parser.add_argument("--items", type=int, default=4, help="items per section (one task each)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        serve(args.out, host=args.host, port=args.port, sections=args.sections, items=args.items, seed=args.seed)
    except ValueError as exc:
        parser.error(f"{exc}; raise --sections or --items")


if __name__ == "__main__":
    main()
