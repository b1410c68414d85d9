"""Serve the built docs site and look at it in headless Chromium: ``python -m scripts.docs_screenshots``.

It builds the site (``mkdocs build --strict``), serves it on a loopback port, and with Debian's ``chromium``
(``apt-get install -y chromium``; run as root it needs ``--no-sandbox``):

1. takes screenshots of the home page and of the flag reference (``docs/assets/screenshots/``);
2. opens the site with ``?q=--max-staleness-steps`` (Material opens its search with that query on load), lets the
   page run (``--virtual-time-budget``) and dumps the DOM: a search result must appear and link to the flag's entry
   in the reference (``reference/flags/#max-staleness-steps``).

The result goes into ``docs/build-notes.md`` between its markers. Exit 0 when both pages were captured and the
search result links to the entry, else 1 naming what failed. Not part of the test command (it needs Chromium).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import html.parser
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "docs" / "assets" / "screenshots"
NOTES = ROOT / "docs" / "build-notes.md"
NOTES_START, NOTES_END = "<!-- screenshots:start -->", "<!-- screenshots:end -->"
QUERY = "--max-staleness-steps"
ENTRY = "reference/flags/#max-staleness-steps"
TIMEOUT_S = 90


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


class _SearchResults(html.parser.HTMLParser):
    """The hrefs of Material's search results (``a.md-search-result__link``) in a dumped DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "a" and "md-search-result__link" in (a.get("class") or "").split():
            self.links.append(a.get("href") or "")


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    sys.exit("no Chromium found: apt-get install -y chromium")


def _browser(binary: str, *args: str) -> subprocess.CompletedProcess:
    sandbox = ["--no-sandbox"] if os.geteuid() == 0 else []  # Chromium's sandbox refuses to run as root
    cmd = [binary, "--headless", "--disable-gpu", "--hide-scrollbars", "--window-size=1280,900", *sandbox, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)


def build(site: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    if proc.returncode != 0:
        sys.exit(f"mkdocs build --strict failed:\n{proc.stderr[-4000:]}")


def check(site: Path, binary: str) -> tuple[list[str], list[str]]:
    """(what passed, what failed), each a line for the build notes."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    passed, failed = [], []
    try:
        SHOTS.mkdir(parents=True, exist_ok=True)
        for name, page in (("home.png", ""), ("flags.png", "reference/flags/")):
            shot = SHOTS / name
            shot.unlink(missing_ok=True)
            proc = _browser(binary, f"--screenshot={shot}", "--virtual-time-budget=5000", base + page)
            ok = shot.is_file() and shot.stat().st_size > 10_000
            (passed if ok else failed).append(
                f"screenshot of `/{page}`: `docs/assets/screenshots/{name}`"
                + ("" if ok else f" missing or blank ({proc.stderr.strip()[-300:]})")
            )
        proc = _browser(binary, "--dump-dom", "--virtual-time-budget=15000", f"{base}?q={QUERY}")
        results = _SearchResults()
        results.feed(proc.stdout)
        hits = [link for link in results.links if link.split("?")[0].endswith(ENTRY)]
        line = f"search `{QUERY}`: {len(results.links)} results, first {results.links[:1]}"
        if hits:
            passed.append(f"{line}; one links to the flag's entry (`{hits[0]}`)")
        else:
            failed.append(f"{line}; none links to `{ENTRY}`")
    finally:
        server.shutdown()
        server.server_close()
    return passed, failed


def record(binary: str, passed: list[str], failed: list[str]) -> None:
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        NOTES_START,
        "",
        f"{'PASSED' if not failed else 'FAILED'}, {when}, {version}:",
        "",
        *(f"- passed: {line}" for line in passed),
        *(f"- FAILED: {line}" for line in failed),
        "",
        "![The home page](assets/screenshots/home.png)",
        "",
        "![The flag reference](assets/screenshots/flags.png)",
        "",
        NOTES_END,
    ]
    text = NOTES.read_text()
    if NOTES_START in text:
        text = text.split(NOTES_START)[0] + "\n".join(lines) + text.split(NOTES_END, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + "\n".join(lines) + "\n"
    NOTES.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-record", action="store_true", help="leave docs/build-notes.md as it is")
    args = ap.parse_args(argv)
    binary = chromium()
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        build(site)
        passed, failed = check(site, binary)
    for line in passed:
        print(f"passed: {line}")
    for line in failed:
        print(f"FAILED: {line}", file=sys.stderr)
    if not args.no_record:
        record(binary, passed, failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
