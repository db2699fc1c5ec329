"""The report in a real browser: headless Chromium opens report.html from disk, every figure must render
with data, the console must stay free of errors, user text must not execute. Full-page screenshots of
every page go to $KVSIM_SCREENSHOT_DIR when it is set (e.g. runs/screenshots, git-ignored; a second each,
so not otherwise: no assertion reads them).

Needs chromium and chromedriver (`apt-get install -y chromium chromium-driver`, as .ci/run does) and
selenium (the `test` extra); skips with the reason when one is missing.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path


from reports.html import build_report
from sim.config import parse_scenario
from kvsim import run_to_dir, sweep_to_dir, write_results
from sim.run import run

ROOT = Path(__file__).resolve().parents[1]
SIZE_BOUND_BYTES = 10_000_000


# Plotly must have drawn every figure: its layout exists, every trace has finite points, and marks are in the SVG.
FIGURE_STATE_JS = """
return Array.from(document.querySelectorAll('div.figure')).map(gd => ({
  id: gd.id,
  plotted: !!gd._fullLayout,
  traces: (gd.data || []).length,
  empty_traces: (gd.calcdata || []).filter(cd => !cd.some(
      p => Number.isFinite(p.x) || Number.isFinite(p.y) || Number.isFinite(p.s))).length,
  marks: gd.querySelectorAll('.scatterlayer path.js-line, .scatterlayer path.js-fill, .barlayer path').length,
  title: (gd.querySelector('.gtitle') || {}).textContent || '',
  legend: (gd.querySelector('.legend') || {}).textContent || '',
  xticks: Array.from(gd.querySelectorAll('.xtick text')).map(t => t.textContent).join('|'),
  yticks: Array.from(gd.querySelectorAll('.ytick text')).map(t => t.textContent).join('|'),
}));
"""


def open_report(driver, path: Path, screenshot: Path) -> list[dict]:
    """Load the page, wait for every figure, save a full-page screenshot (named as ``screenshot``) to
    $KVSIM_SCREENSHOT_DIR when it is set; the figures' state."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get_log("browser")  # drop what an earlier page logged
    driver.get(path.resolve().as_uri())
    WebDriverWait(driver, 60).until(lambda d: d.execute_script(
        "const f = document.querySelectorAll('div.figure');"
        "return document.readyState === 'complete' && f.length > 0 && "
        "Array.from(f).every(gd => gd._fullLayout && gd.querySelector('.main-svg'));"))
    state = driver.execute_script(FIGURE_STATE_JS)
    save_screenshot(driver, screenshot)
    return state


def save_screenshot(driver, screenshot: Path) -> None:
    """A full-page screenshot of the page as it is, named as ``screenshot``, into $KVSIM_SCREENSHOT_DIR
    (nothing when it is not set)."""
    if not os.environ.get("KVSIM_SCREENSHOT_DIR"):
        return
    width = driver.execute_script("return document.documentElement.scrollWidth")
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
    png = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
    driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    keep = Path(os.environ["KVSIM_SCREENSHOT_DIR"])
    keep.mkdir(parents=True, exist_ok=True)
    (keep / screenshot.name).write_bytes(base64.b64decode(png["data"]))


def hover_text(driver, title_part: str, curve: int, point: int = 0) -> str:
    """The hover label plotly draws for one point (of a trace on the first subplot) of the figure whose
    title contains ``title_part``."""
    return driver.execute_script("""
      const gd = Array.from(document.querySelectorAll('div.figure'))
          .find(g => g.querySelector('.gtitle').textContent.includes(arguments[0]));
      Plotly.Fx.hover(gd, [{curveNumber: arguments[1], pointNumber: arguments[2]}]);
      return gd.querySelector('.hoverlayer').textContent;""", title_part, curve, point)


def console_errors(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def assert_rendered(state: list[dict], expected_figures: int) -> None:
    assert len(state) == expected_figures, state
    for fig in state:
        assert fig["plotted"] and fig["traces"] > 0, fig
        assert fig["empty_traces"] == 0, fig
        assert fig["marks"] > 0, fig


def test_quickstart_report_renders_in_chromium(browser, tmp_path):
    """The quickstart's own report: all figures drawn with data, no console error, under the size bound."""
    _, paths = run_to_dir(ROOT / "scenarios" / "quickstart.yaml", tmp_path / "quickstart")
    report = paths["report"]
    assert report.stat().st_size < SIZE_BOUND_BYTES
    state = open_report(browser, report, tmp_path / "quickstart.png")
    errors = console_errors(browser)
    assert not errors, errors
    assert_rendered(state, 6)  # with the decomposition's figure (sim run decomposes the quickstart)
    titles = [f["title"] for f in state]
    assert any("where it goes" in t for t in titles) and any("address space" in t for t in titles)
    breakdown = next(f for f in state if "where it goes" in f["title"])
    for bar in ("fastertransformer", "orca-max", "Orca (Max), paper", "Orca (Pow2), paper", "vLLM, paper"):
        assert bar in breakdown["xticks"], breakdown  # ours and the paper's published bars


def test_user_text_cannot_run_and_page_still_renders(browser, tmp_path):
    """A scenario and a policy named with <script> and <img onerror>: shown as text, nothing executes."""
    scenario_name = "<script>window.__kvsim_pwned = 1</script> evil & co"
    policy_name = '<img src=x onerror="window.__kvsim_pwned = 2"><script>window.__kvsim_pwned = 3</script>'
    scenario = parse_scenario({
        "name": scenario_name, "description": "</script><script>window.__kvsim_pwned = 4</script>",
        "model": "opt-13b", "gpu": "a100-40gb",
        "workload": {"arrival": {"kind": "poisson", "rate": 4.0}, "lengths": "alpaca", "num_requests": 40, "seed": 3},
        "policies": ["orca-max", {"preset": "vllm", "name": policy_name}]})
    run_dir = tmp_path / "evil"
    write_results(run(scenario), run_dir)
    state = open_report(browser, run_dir / "report.html", tmp_path / "escaped.png")
    errors = console_errors(browser)
    assert not errors, errors
    assert browser.execute_script("return window.__kvsim_pwned === undefined")
    assert browser.execute_script("return document.querySelectorAll('img').length") == 0
    assert scenario_name in browser.find_element("tag name", "h1").text
    assert_rendered(state, 5)
    assert any(policy_name[:20] in f["legend"] for f in state)  # legends cut long names...
    assert policy_name in hover_text(browser, "Latency distributions", curve=4)  # ...hover shows them whole

    # the same run compared with a copy of the same name: labels carry the folder names, still escaped
    import shutil

    copy = shutil.copytree(run_dir, tmp_path / "copy" / run_dir.name)
    compare = build_report([run_dir, copy], tmp_path / "compare.html")
    state = open_report(browser, compare, tmp_path / "compare.png")
    assert not console_errors(browser)
    assert browser.execute_script("return window.__kvsim_pwned === undefined")
    assert_rendered(state, 5)
    assert any("evil#2 / " + policy_name[:20] in f["legend"] for f in state)


def test_sim_sweep_report_renders_in_chromium(browser, tmp_path):
    """What `sim sweep` writes: latency vs rate and vs block size with error bars over seeds, capacity bars
    (one 'none'), the capacity and ratio tables."""

    sweep = tmp_path / "s.yaml"
    sweep.write_text("""\
name: browser sweep
base:
  name: tiny
  model: opt-13b
  gpu: a100-40gb
  workload: {arrival: {kind: poisson, rate: 2.0}, lengths: alpaca, num_requests: 40}
  policies: [fastertransformer, vllm]
axes:
  workload.arrival.rate: [2, 8]
  block_size: [8, 64]
  seed: [0, 1]
capacity: {slo: {mean_normalized_latency_s: 0.05}, min: 1, max: 32, relative_tolerance: 0.1}
""")
    _, paths = sweep_to_dir(sweep, tmp_path / "sweep", workers=1)
    state = open_report(browser, paths["report"], tmp_path / "sim-sweep.png")
    errors = console_errors(browser)
    assert not errors, errors
    assert_rendered(state, 3)
    assert [f["title"] for f in state] == ["Mean normalized latency vs request rate",
                                           "Mean normalized latency vs block size",
                                           "Sustainable request rate per policy"]
    assert "(2 seeds)" in hover_text(browser, "vs request rate", curve=0)
    tables = browser.find_element("tag name", "body").text
    assert "lowest failing" in tables and "browser sweep" in tables
