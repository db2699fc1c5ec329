"""The report's layout at 900 px and 1400 px in headless Chromium: the page never scrolls sideways, no
HTML element sticks out of its container (tables too wide for the page scroll inside their own box,
except the summary tables, which must fit), and no text plotly draws (titles, tick and bar labels,
legends, annotations) is clipped by its figure. Screenshots of every page and width go to $KVSIM_SCREENSHOT_DIR when it
is set. Skips, saying why, without chromium, chromedriver or
selenium (the session's browser fixture, tests/conftest.py)."""

from __future__ import annotations

import pandas as pd
from test_report_browser import assert_rendered, console_errors, open_report, save_screenshot

from reports.html import build_report
from sim.config import parse_scenario
from kvsim import write_results
from sim.run import run

WIDTHS = (900, 1400)

# Every element that sticks out of its parent (HTML, outside figures and scroll boxes), every scroll box
# that must not scroll (the summary), and every text of a figure's SVG that leaves the figure's box.
LAYOUT_JS = """
const bad = [];
const doc = document.documentElement;
if (doc.scrollWidth > doc.clientWidth + 1) bad.push(`page scrolls sideways: ${doc.scrollWidth} > ${doc.clientWidth}`);
const scrolls = el => ['auto', 'scroll'].includes(getComputedStyle(el).overflowX);
for (const el of document.body.querySelectorAll('*')) {
  if (el.closest('div.figure') || el.closest('script') || el.tagName === 'SCRIPT') continue;
  const parent = el.parentElement;
  if (!parent || parent === doc) continue;
  let p = parent, inScroll = false;
  while (p && p !== document.body) { if (scrolls(p)) { inScroll = true; break; } p = p.parentElement; }
  if (inScroll) continue;
  const r = el.getBoundingClientRect(), q = parent.getBoundingClientRect();
  if (r.width === 0 || r.height === 0 || r.right <= 0) continue;  // plotly's off-screen text tester
  if (r.right > q.right + 1 || r.left < q.left - 1)
    bad.push(`${el.tagName}.${el.className} '${el.textContent.slice(0, 40)}' [${r.left | 0}, ${r.right | 0}] ` +
             `outside its ${parent.tagName} [${q.left | 0}, ${q.right | 0}]`);
}
for (const box of document.querySelectorAll('.wide')) {
  if (box.querySelector('table.summary') && box.scrollWidth > box.clientWidth + 1)
    bad.push(`summary table wider than the page: ${box.scrollWidth} > ${box.clientWidth}`);
}
for (const gd of document.querySelectorAll('div.figure')) {
  const f = gd.getBoundingClientRect();
  const title = (gd.querySelector('.gtitle') || {}).textContent || gd.id;
  for (const t of gd.querySelectorAll('svg text')) {
    if (!t.textContent.trim() || t.closest('.hoverlayer')) continue;
    const r = t.getBoundingClientRect();
    if (r.width === 0) continue;
    if (r.left < f.left - 1 || r.right > f.right + 1 || r.top < f.top - 1 || r.bottom > f.bottom + 1)
      bad.push(`${title}: '${t.textContent.slice(0, 50)}' [${r.left | 0}, ${r.right | 0}] x ` +
               `[${r.top | 0}, ${r.bottom | 0}] leaves the figure [${f.left | 0}, ${f.right | 0}] x [${f.top | 0}, ${f.bottom | 0}]`);
  }
  for (const leg of gd.querySelectorAll('.legend')) {  // plotly cuts a legend wider than its room
    const clip = leg.querySelector('.scrollbox');
    const r = leg.getBoundingClientRect();
    if (r.right > f.right + 1) bad.push(`${title}: a legend leaves the figure (${r.right | 0} > ${f.right | 0})`);
  }
}
return bad;
"""


# Every figure redrawn at its container's new width (what plotly's responsive mode does on a window resize,
# awaited): the page then holds what loading it at that width gives -- the same figure states, sizes,
# margins and layout problems, checked at both widths in both orders -- without parsing plotly.js again.
RESIZE_JS = """const done = arguments[arguments.length - 1];
Promise.all(Array.from(document.querySelectorAll('div.figure')).map(gd => Plotly.Plots.resize(gd))).then(() => done(true));
"""


def check_widths(driver, page, tmp_path, stem: str) -> list[dict]:
    """The page loaded at the first width, then resized to the others; the figures' state as loaded."""
    for i, width in enumerate(WIDTHS):
        driver.set_window_size(width, 1000)
        if i == 0:
            state = open_report(driver, page, tmp_path / f"{stem}-{width}.png")
        else:
            driver.execute_async_script(RESIZE_JS)
            save_screenshot(driver, tmp_path / f"{stem}-{width}.png")
        problems = driver.execute_script(LAYOUT_JS)
        assert not problems, f"{stem} at {width} px:\n" + "\n".join(problems[:30])
    return state


def test_run_report_fits_900_and_1400_px(browser, tmp_path):
    """The quickstart's policies and its Fig. 2 bars (published ones beside ours), on a small workload."""
    scenario = parse_scenario({
        "name": "quickstart", "description": "OPT-13B on 1x A100-40GB, ShareGPT-like lengths",
        "model": "opt-13b", "gpu": "a100-40gb",
        "workload": {"arrival": {"kind": "poisson", "rate": 6.0}, "lengths": "sharegpt", "num_requests": 120,
                     "seed": 0},
        "policies": ["fastertransformer", "orca-max", "orca-pow2", "orca-oracle", "vllm",
                     {"preset": "vllm", "name": LINK}]})
    out = tmp_path / "quickstart"
    write_results(run(scenario, decompose=True), out)
    check_widths(browser, out / "report.html", tmp_path, "quickstart")
    assert "quickstart (quickstart)" not in browser.find_element("tag name", "body").text
    assert_user_text_is_text(browser)


LINK = "<a href=x>big</a>"  # a policy name plotly would draw as a link if it reached it unescaped


def assert_user_text_is_text(driver) -> None:
    """Plotly drew no link (no <a> in any figure) and shows the name as typed in legends and ticks."""
    assert driver.execute_script("return document.querySelectorAll('div.figure svg a').length") == 0
    texts = driver.execute_script("return Array.from(document.querySelectorAll('div.figure svg text'))"
                                  ".map(t => t.textContent)")
    assert LINK in texts, [t for t in texts if "big" in t]


def test_sweep_report_renders_and_fits_900_and_1400_px(browser, tmp_path):
    """A folder holding only a sweep's tidy table and capacity table: both sweep figures drawn with data,
    no console error, user text as text, and the layout holds at both widths."""
    from tables import sweep_table

    d = tmp_path / "sweep"
    d.mkdir()
    names = ["orca-oracle", "vllm", LINK, "<b>x</b>"]
    sweep_table(policies=names).to_parquet(d / "sweep.parquet")
    pd.DataFrame({"policy": names, "sustainable_request_rate": [1.5, 3.0, 2.0, 2.5]}).to_parquet(d / "capacity.parquet")
    state = check_widths(browser, build_report([d]), tmp_path, "sweep")
    assert not console_errors(browser)
    assert_rendered(state, 2)
    assert "<b>x</b>" in state[0]["legend"]
    assert_user_text_is_text(browser)


def test_layout_check_sees_overflow_and_clipping(browser, tmp_path):
    """The check itself: a heading wider than the page, and a figure title longer than its figure."""
    from tables import sweep_table

    d = tmp_path / "sweep"
    d.mkdir()
    sweep_table(policies=("orca-oracle", "vllm")).to_parquet(d / "sweep.parquet")
    page = tmp_path / "broken.html"
    page.write_text(build_report([d]).read_text().replace("</style>", "h1{white-space:nowrap;width:2000px}</style>"))
    browser.set_window_size(900, 1000)
    open_report(browser, page, tmp_path / "broken.png")
    browser.execute_script("const gd = document.querySelector('div.figure');"
                           "return Plotly.relayout(gd, {'title.text': 'a title far too long '.repeat(20)});")
    problems = browser.execute_script(LAYOUT_JS)
    assert any("page scrolls sideways" in p for p in problems), problems
    assert any(p.startswith("H1.") for p in problems), problems
    assert any("a title far too long" in p and "leaves the figure" in p for p in problems), problems
