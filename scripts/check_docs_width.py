#!/usr/bin/env python3
"""List what a built docs page cuts off on the right at a given window width, in headless Chromium.

Each page is copied with a small script that, once loaded, records every element that sticks out of
the window or scrolls horizontally (code blocks, tables, signatures, headings, paragraphs); Chromium
dumps the DOM and the record is read back. Not part of the test suite (it needs Chromium and takes a
few seconds a page); run it after changing the docs' layout:

    NO_MKDOCS_2_WARNING=1 python -m mkdocs build -d /tmp/site
    python scripts/check_docs_width.py /tmp/site --width 1280 api

Exit status: 0 nothing overflows; 1 something does (listed per page).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Sequence

PROBE = """<script>
window.addEventListener('load', () => {
  const width = document.documentElement.clientWidth, found = [];
  const selector = 'pre, pre > code, .md-typeset__scrollwrap, table, .doc-signature, h1, h2, h3, h4, h5, p, li';
  document.querySelectorAll(selector).forEach(e => {
    const scrolls = e.scrollWidth > e.clientWidth + 1 && getComputedStyle(e).overflowX !== 'visible';
    if (scrolls || e.getBoundingClientRect().right > width + 1)
      found.push(e.tagName + ': ' + (e.textContent || '').replace(/\\s+/g, ' ').slice(0, 80));
  });
  const out = document.createElement('div');
  out.id = 'WIDTH-PROBE';
  out.textContent = JSON.stringify(found);
  document.body.appendChild(out);
});
</script>"""


def overflowing(page: Path, width: int, chromium: str) -> List[str]:
    """The elements of ``page`` that are cut off or scroll at ``width`` pixels."""
    probe = page.with_name("width-probe.html")
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"), encoding="utf-8")
    try:
        cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--window-size={width},900"]
        cmd += ["--virtual-time-budget=3000", "--dump-dom", probe.as_uri()]
        dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    finally:
        probe.unlink()
    match = re.search(r'<div id="WIDTH-PROBE">(.*?)</div>', dom)
    if match is None:
        return ["(the probe did not run)"]
    found: List[str] = json.loads(match.group(1).replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))
    return found


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("site", type=Path, help="a built site (mkdocs build -d SITE)")
    parser.add_argument("sections", nargs="*", help="only pages under these folders of the site (e.g. api)")
    parser.add_argument("--width", type=int, default=1280)
    args = parser.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        print("no chromium on PATH (Debian: apt-get install -y chromium)", file=sys.stderr)
        return 2
    roots = [args.site / s for s in args.sections] or [args.site]
    bad = 0
    for page in sorted(p for root in roots for p in root.rglob("index.html")):
        found = overflowing(page, args.width, chromium)
        print(f"{page.relative_to(args.site)}: {'ok' if not found else f'{len(found)} cut off'}")
        for item in found:
            print(f"    {item}")
        bad += bool(found)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
