"""Screenshots of the built docs site taken by headless Chromium with the network off, and a check that no code
block or table scrolls sideways at the window's width.

    python scripts/docs_screenshots.py SITE_DIR OUT_DIR [--width 1400]

SITE_DIR is a `mkdocs build` output. Each page is opened from the file system in a new network namespace
(`unshare -n`, so nothing can be fetched) or, where unshare is refused, with every request sent to a dead proxy.
Per page it prints the number of MathML formulas, SVG images, raw `$`/`\\(` formulas and Mermaid sources left, and
the elements wider than their box (code blocks, tables). Needs `chromium` (Debian's package).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PAGES = ("index", "concepts/index", "getting-started/migrating-from-trl/index", "guides/algorithms/index")
PROBE = """<script>window.addEventListener('load', () => setTimeout(() => {
  const wide = [...document.querySelectorAll('.md-content pre > code, .md-typeset__scrollwrap, .md-typeset table')]
    .filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.tagName + ':' + e.textContent.slice(0, 40));
  const imgs = [...document.images].filter(i => i.src.endsWith('.svg'));
  document.body.setAttribute('data-probe', JSON.stringify({
    math: document.querySelectorAll('math').length, svg: imgs.length,
    svg_loaded: imgs.filter(i => i.complete && i.naturalWidth > 0).length,
    raw_tex: (document.body.innerText.match(/\\\\\\(|\\$\\$/g) || []).length,
    mermaid: document.body.innerText.includes('sequenceDiagram'), wide}));
}, 500));</script>"""


def browser(args: list[str]) -> subprocess.CompletedProcess:
    cmd = ["chromium", "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *args]
    offline = ["unshare", "-n", *cmd] if shutil.which("unshare") else cmd
    done = subprocess.run(offline, capture_output=True, text=True, timeout=120)
    if done.returncode != 0 and offline[0] == "unshare":  # (no namespace for us: a dead proxy instead)
        done = subprocess.run([*cmd, "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>"],
                              capture_output=True, text=True, timeout=120)
    return done


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("site")
    parser.add_argument("out")
    parser.add_argument("--width", type=int, default=1400)
    a = parser.parse_args()
    if shutil.which("chromium") is None:
        sys.exit("chromium is not installed (apt-get install chromium)")
    site, out = Path(a.site).resolve(), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        probe_site = Path(tmp) / "site"
        shutil.copytree(site, probe_site)
        for page in PAGES:
            html = probe_site / f"{page}.html"
            html.write_text(html.read_text().replace("</body>", PROBE + "</body>"))
            shot = out / (page.replace("/index", "").replace("/", "_") + ".png")
            browser([f"--window-size={a.width},1800", f"--screenshot={shot}", (site / f"{page}.html").as_uri()])
            dom = browser([f"--window-size={a.width},1800", "--virtual-time-budget=3000", "--dump-dom", html.as_uri()]).stdout
            found = re.search(r'data-probe="([^"]*)"', dom)
            probe = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&")) if found else None
            ok = bool(probe) and not probe["wide"] and not probe["raw_tex"] and not probe["mermaid"] and \
                probe["svg_loaded"] == probe["svg"]
            failed |= not ok
            print(f"{page:45s} {'ok ' if ok else 'BAD'} {probe} -> {shot}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
