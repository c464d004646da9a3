"""Screenshots of the built documentation site, for a person to look at.

``make docs-shots`` builds the site into ``site/``, serves it on 127.0.0.1 and
takes one PNG per page with headless Chromium (Debian: ``apt-get install -y
chromium``), 1280 px wide, into ``build/docs-shots/``::

    python docs/shots.py [SITE_DIR] [OUT_DIR] [--tiles] [--height PX]

``--tiles`` also shoots each page whole (up to 16000 px tall) and, where
Pillow is installed, cuts it into 2000-px tiles (``page-1.png``, ...), so long
pages can be read to the end.  (A headless screenshot of a page scrolled to
an anchor comes out blank, so tiles are cut from one tall shot instead.)

The site ships its Mermaid script (``docs/javascripts/mermaid.tiny.js``), so
the diagrams draw with no network; a page whose diagram Mermaid could not
parse (its source left as text) is named at the end.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                  "--virtual-time-budget=15000"]


def find_chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    sys.exit("docs-shots: no Chromium found; install it (Debian: apt-get install -y "
             "chromium)")


class Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass


def pages(site: Path) -> list[tuple[str, str]]:
    """(name, URL path) of every page, in the site's order of files."""
    out = []
    for index in sorted(site.rglob("index.html")):
        rel = index.parent.relative_to(site).as_posix()
        if rel.startswith(("search", "assets", "_")):
            continue
        out.append(("index" if rel == "." else rel.replace("/", "-"),
                    "/" if rel == "." else f"/{rel}/"))
    return out


TILE = 2000
TALL = 16000


def tiles(png: Path) -> list[Path]:
    """Cut a tall shot into ``TILE``-px pieces, its blank bottom dropped."""
    try:
        from PIL import Image, ImageChops
    except ImportError:
        return [png]
    with Image.open(png) as image:
        gray = image.convert("L")
        rgb = image.convert("RGB")
    # the footer sits at the bottom of the tall window, the page's end far
    # above it: keep the content, then the footer, and drop the blank between
    white = ImageChops.invert(gray).point(lambda v: 255 if v > 0 else 0)

    def blank(y: int) -> bool:
        return white.crop((0, y, white.width, y + 1)).getbbox() is None

    y = rgb.height - 1
    while y > 0 and not blank(y):   # the footer
        y -= 1
    footer = y + 1
    while y > 0 and blank(y):       # the blank between
        y -= 1
    if footer - y > 200:
        content = rgb.crop((0, 0, rgb.width, min(y + 60, footer)))
        foot = rgb.crop((0, footer, rgb.width, rgb.height))
        rgb = Image.new("RGB", (rgb.width, content.height + foot.height), "white")
        rgb.paste(content, (0, 0))
        rgb.paste(foot, (0, content.height))
    height = rgb.height
    out = []
    for i, top in enumerate(range(0, height, TILE), start=1):
        piece = png.with_name(f"{png.stem}-{i}.png")
        rgb.crop((0, top, rgb.width, min(top + TILE, height))).save(piece)
        out.append(piece)
    png.unlink()
    return out


def unrendered_diagrams(chromium: str, url: str) -> int:
    """Mermaid sources the page still shows as text after its scripts ran
    (Mermaid could not parse them: the page shows the source instead)."""
    with tempfile.TemporaryDirectory() as profile:
        cmd = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
               "--window-size=1280,2000", "--dump-dom", url]
        try:
            dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
        except subprocess.TimeoutExpired:
            return -1
    return dom.count('<pre class="mermaid"')


def shoot(chromium: str, url: str, png: Path, height: int) -> bool:
    with tempfile.TemporaryDirectory() as profile:
        cmd = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
               f"--window-size=1280,{height}", f"--screenshot={png}", url]
        try:
            subprocess.run(cmd, capture_output=True, timeout=120, check=False)
        except subprocess.TimeoutExpired:
            return False
    return png.is_file() and png.stat().st_size > 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", nargs="?", default=str(ROOT / "site"))
    parser.add_argument("out", nargs="?", default=str(ROOT / "build" / "docs-shots"))
    parser.add_argument("--tiles", action="store_true",
                        help="also each whole page, cut into 2000-px tiles")
    parser.add_argument("--height", type=int, default=2000)
    ns = parser.parse_args(argv)
    site, out = Path(ns.site).resolve(), Path(ns.out).resolve()
    if not (site / "index.html").is_file():
        sys.exit(f"docs-shots: {site} holds no built site; run `make docs` first")
    chromium = find_chromium()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Handler, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    failed = []
    try:
        for name, url in pages(site):
            png = out / f"{name}.png"
            if not shoot(chromium, base + url, png, ns.height):
                failed.append(f"{name} (no screenshot)")
                continue
            made = [png]
            has_diagrams = 'class="mermaid"' in (site / url.strip("/") / "index.html").read_text(
                encoding="utf-8")
            if has_diagrams:
                left = unrendered_diagrams(chromium, base + url)
                if left:
                    failed.append(f"{name} ({left} Mermaid diagrams did not render)")
            if ns.tiles:
                whole = out / "tiles" / f"{name}.png"
                whole.parent.mkdir(exist_ok=True)
                if shoot(chromium, base + url, whole, TALL):
                    made += tiles(whole)
                else:
                    failed.append(f"{name} (whole)")
            for path in made:
                print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    finally:
        server.shutdown()
    if failed:
        print(f"docs-shots: look at {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
