"""The lens report in a real headless browser (Chromium), with the network off: no console
errors, every view filled, hovering a token changes the attention view, a non-blank picture.

Needs Playwright (the oracles extra) and a Chromium: the system's (/usr/bin/chromium, which
.ci/run installs with apt) or Playwright's own (`playwright install chromium`); skipped with
a message when neither is there."""

import os
import shutil

import pytest
import torch

from decoderlm import CharTokenizer, DecoderLM, ModelConfig
from decoderlm.lens.report import build_report, write_report

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="Playwright is not installed (pip install -e '.[oracles]')"
)

TEXT = "To be, or not to be, that is the question:\nTo be, or not to be, that is the"
# a canvas's pixels, or an element's children and text
FILLED = (
    "e => e.tagName === 'CANVAS' ? e.width * e.height : e.childElementCount + e.textContent.length"
)
VIEWS = ["#summary", "#text", "#thumbs", "#bigcanvas", "#lines", "#scores", "#lens", "#embedding"]


def _chromium() -> str | None:
    """The system Chromium's path, or None to use Playwright's own browser."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return os.path.realpath(path)
    return None


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        try:
            b = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        except Exception as e:  # no browser at all
            pytest.skip(f"no Chromium to drive: install it (apt-get install chromium) ({e})")
        yield b
        b.close()


@pytest.fixture(scope="module")
def report_file(tmp_path_factory):
    tok = CharTokenizer.from_text(TEXT + "xyz")
    torch.manual_seed(0)
    model = DecoderLM(
        ModelConfig(vocab_size=tok.vocab_size, block_size=96, n_layers=3, n_heads=4, d_model=64)
    )
    ids = tok.encode(TEXT)
    corrupted = ids[:-3] + tok.encode("xyz")
    report = build_report(model, tok, ids, corrupted=corrupted, title="browser test")
    html, _ = write_report(report, tmp_path_factory.mktemp("report") / "report.html")
    return html


def test_the_report_shows_every_view_offline_and_reacts_to_hovering(browser, report_file):
    context = browser.new_context(offline=True, viewport={"width": 1280, "height": 900})
    requested = []

    def refuse(route):  # only the file itself may load
        requested.append(route.request.url)
        route.abort()

    context.route(lambda url: not url.startswith("file://"), refuse)
    page = context.new_page()
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(report_file.as_uri())
    page.wait_for_load_state("load")
    for view in VIEWS:
        assert page.locator(view).count() == 1, view
        assert page.eval_on_selector(view, FILLED) > 0, view
    assert page.locator("#text .tok").count() == len(TEXT)
    assert page.locator("#thumbs canvas").count() == 12
    assert page.locator("#lens tr").count() == 1 + 4  # header, embedding, 3 blocks
    assert page.locator("#embedding circle").count() > 0
    assert page.locator("#patching rect").count() == 3 * len(TEXT) + 3 * 4
    assert page.locator("#patching .colour-scale").count() == 1  # the heatmaps' colour scale
    before = page.inner_html("#lines")
    page.hover("#text .tok[data-i='5']")
    after = page.inner_html("#lines")
    assert after != before and page.locator("#lines line").count() > 0
    assert "query 5" in page.inner_text("#bigtitle")
    assert page.is_visible("#tip") and "guesses" in page.inner_text("#tip")
    page.click(".thumb[data-layer='1'][data-head='2']")
    assert "layer 1, head 2" in page.inner_text("#bigtitle")
    shot = page.screenshot(full_page=True)
    assert errors == [] and requested == []
    context.close()
    # not blank: the picture has many colours, not one background
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(shot)).convert("RGB")
    assert len(image.getcolors(maxcolors=1 << 20) or []) > 50
