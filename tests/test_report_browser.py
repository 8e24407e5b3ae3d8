"""The HTML report in a real browser: Debian's Chromium, headless, driven by playwright, must load every picture.

A picture that does not decode (a malformed SVG, a data URI cut short) still leaves an ``<img>`` in the page, so
only a browser can tell. Marked ``browser``: scripts/test-all runs it; it skips, saying why, where
/usr/bin/chromium (``apt-get install chromium``; scripts/ensure-chromium) or playwright (the test extra) is missing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.reports import report, report_pictures
from tests.report_samples import sample

CHROMIUM = Path("/usr/bin/chromium")

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not CHROMIUM.exists(),
                                 reason=f"{CHROMIUM} is not installed (apt-get install chromium, or "
                                        "scripts/ensure-chromium): the HTML report was not rendered in a browser")]

LOADED = """async () => {
    const images = [...document.images];
    const decoded = await Promise.all(images.map(i => i.decode().then(() => true, () => false)));
    return {
        images: images.map((i, n) => ({alt: i.alt, width: i.naturalWidth, height: i.naturalHeight,
                                      decoded: decoded[n]})),
        svgs: [...document.querySelectorAll("svg")].map(s => {
            const box = s.getBoundingClientRect();
            return {width: box.width, height: box.height};
        }),
    };
}"""


def test_every_picture_of_the_html_report_loads_in_chromium(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (the report extra) is not installed: no SVG to load")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (the test extra) is not installed")
    data = sample()
    expected = list(report_pictures.svgs(data))
    page_file = report.write(data, tmp_path / "parity.html")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM))  # never a downloaded browser build
        try:
            page = browser.new_page()
            page.goto(page_file.as_uri(), wait_until="load")
            seen = page.evaluate(LOADED)
        finally:
            browser.close()
    assert [image["alt"] for image in seen["images"]] == [name.removesuffix(".svg").replace("-", " ")
                                                         for name in expected]
    broken = [image for image in seen["images"]
              if not (image["decoded"] and image["width"] > 0 and image["height"] > 0)]
    assert not broken, f"pictures that did not load in Chromium: {broken}"
    assert all(box["width"] > 0 and box["height"] > 0 for box in seen["svgs"]), seen["svgs"]
