"""Serve the built docs site and look at it in headless Chromium: ``python -m scripts.docs_screenshots``.

It builds the site (``mkdocs build --strict``), serves it on a loopback port, and with Debian's ``chromium``
(``apt-get install -y chromium``; run as root it needs ``--no-sandbox``):

1. takes screenshots of the home page and of the flag reference (``docs/assets/screenshots/``);
2. searches ``--max-staleness-steps`` three ways, each in a fresh browser, reading the page over the DevTools
   protocol until the results appear and stop changing: one must link to the flag's entry in the reference
   (``reference/flags/#max-staleness-steps``):

   - typed into the search box key by key (a key down and a key up for each character) as soon as the box is
     there, whether or not the search index is ready yet;
   - pasted into the box (one ``Input.insertText``: an ``input`` event and no key event, as a paste with the mouse)
     once the search says it is ready ("Type to start searching"). Material reads the box on a keyup, so this
     fails unless ``docs/overrides/main.html`` passes the input on to it;
   - opened as a link, ``/?q=--max-staleness-steps`` (Material opens its search with that query on load).

The result goes into ``docs/build-notes.md`` between its markers. Exit 0 when both pages were captured and each
search has a result linking to the entry, else 1 naming what failed. Not part of the test command (it needs
Chromium).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "docs" / "assets" / "screenshots"
NOTES = ROOT / "docs" / "build-notes.md"
NOTES_START, NOTES_END = "<!-- screenshots:start -->", "<!-- screenshots:end -->"
QUERY = "--max-staleness-steps"
ENTRY = "reference/flags/#max-staleness-steps"
TIMEOUT_S = 60


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


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


async def search_results(binary: str, url: str, how: str | None = None) -> list[str]:
    """The hrefs of Material's search results (``a.md-search-result__link``) on ``url``, read over the DevTools
    protocol once they appear and stop changing (the search index is built in a web worker, which --dump-dom's
    virtual time does not wait for), after putting ``QUERY`` into the search box if ``how`` is "type" (key by
    key, as soon as the box is there) or "paste" (all at once, once the search is ready). [] when none appears
    within the deadline."""
    # Chromium's helper processes can still be writing to the profile as the browser exits: leave what is left.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        sandbox = ["--no-sandbox"] if os.geteuid() == 0 else []
        cmd = [binary, "--headless", "--disable-gpu", *sandbox, f"--user-data-dir={profile}"]
        proc = subprocess.Popen([*cmd, "--remote-debugging-port=0", url], stderr=subprocess.DEVNULL)
        try:
            port_file = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + TIMEOUT_S
            while not port_file.is_file() or not port_file.read_text().strip():
                if proc.poll() is not None:
                    raise RuntimeError(f"Chromium exited ({proc.returncode}) without a DevTools port")
                await _before(deadline)
            port = port_file.read_text().split()[0]
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{port}/json/list") as r:
                    page = next(t for t in await r.json() if t["type"] == "page")
                async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                    calls = itertools.count(1)
                    if how is not None:  # as a user does: into the search box, then type or paste
                        box = "document.querySelector('[data-md-component=search-query]')"
                        while not await _evaluate(ws, next(calls), f"document.readyState == 'complete' && !!{box}"):
                            await _before(deadline)
                        await _evaluate(ws, next(calls), f"{box}.focus(), true")
                        if how == "type":
                            for key in QUERY:
                                for event in _key_events(key):
                                    await _call(ws, next(calls), "Input.dispatchKeyEvent", event)
                        else:  # the search's dropdown, open now, says "Type to start searching" once it is ready
                            meta = "document.querySelector('.md-search-result__meta').textContent.trim()"
                            while True:
                                await _before(deadline)
                                if await _evaluate(ws, next(calls), f"{meta} == 'Type to start searching'"):
                                    break
                            await _call(ws, next(calls), "Input.insertText", {"text": QUERY})
                    # Read once they stop changing: typed key by key, the first results shown can be for the
                    # first keys (Material searches as one types), not yet for the whole query.
                    expr = "Array.from(document.querySelectorAll('a.md-search-result__link'), a => a.href)"
                    shown = None
                    while not (links := await _evaluate(ws, next(calls), expr)) or links != shown:
                        if time.monotonic() > deadline:
                            return list(links or [])
                        shown = links
                        await asyncio.sleep(0.25)
                    return list(links)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def _key_events(key: str) -> list[dict]:
    """Input.dispatchKeyEvent's key down (which puts ``key`` in the focused box) and key up for one character."""
    if key == "-":
        code, keycode = "Minus", 189
    elif key.isascii() and key.isalnum():
        code, keycode = (f"Digit{key}" if key.isdigit() else f"Key{key.upper()}"), ord(key.upper())
    else:
        raise ValueError(f"no key for {key!r}")
    event = {"key": key, "code": code, "windowsVirtualKeyCode": keycode}
    return [{"type": "keyDown", "text": key, **event}, {"type": "keyUp", **event}]


async def _before(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(f"the page was not ready within {TIMEOUT_S} s")
    await asyncio.sleep(0.25)


async def _call(ws: aiohttp.ClientWebSocketResponse, call: int, method: str, params: dict) -> dict:
    await ws.send_json({"id": call, "method": method, "params": params})
    return await asyncio.wait_for(_reply(ws, call), timeout=TIMEOUT_S)


async def _evaluate(ws: aiohttp.ClientWebSocketResponse, call: int, expression: str) -> object:
    reply = await _call(ws, call, "Runtime.evaluate", {"expression": expression, "returnByValue": True})
    return reply["result"]["result"].get("value")


async def _reply(ws: aiohttp.ClientWebSocketResponse, call: int) -> dict:
    async for msg in ws:
        data = json.loads(msg.data)
        if data.get("id") == call:
            return data
    raise RuntimeError("the DevTools connection closed")


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
        for how, url, put in (
            ("typed into the search box key by key", base, "type"),
            ("pasted into the search box once the search is ready", base, "paste"),
            ("as a ?q= link", f"{base}?q={QUERY}", None),
        ):
            links = asyncio.run(search_results(binary, url, put))
            # A result's href carries the highlighted words (?h=...) between the page and the entry's anchor.
            hits = [i for i, link in enumerate(links) if re.sub(r"\?[^#]*", "", link) == base + ENTRY]
            line = f"search `{QUERY}` {how}: {len(links)} results"
            if hits:
                entry = links[hits[0]].replace(base, "/")
                passed.append(f"{line}; result {hits[0] + 1} links to the flag's entry (`{entry}`)")
            else:
                failed.append(f"{line}; none links to `/{ENTRY}` (first: {links[:2]})")
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
