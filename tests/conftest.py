from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one xdist worker per core: torch's (OpenMP's) threads one per worker, not one per core in each worker,
    # whose spinning waits burned CPU time (before torch is first imported: test modules import it later)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

if "KVSIM_TRACE_CACHE" not in os.environ:  # parsed traces (traces/cache.py) kept for this run only, not in ~/.cache
    import atexit
    import tempfile

    _trace_cache = tempfile.mkdtemp(prefix="kvsim-trace-cache-")
    os.environ["KVSIM_TRACE_CACHE"] = _trace_cache
    atexit.register(shutil.rmtree, _trace_cache, ignore_errors=True)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sim import trace_paths  # noqa: E402
from sim.config import parse_scenario  # noqa: E402

TRACES_DIR: str | None = None  # pytest --traces-dir DIR (searched before $KVSIM_TRACES and ../shared/traces)


def pytest_addoption(parser):
    parser.addoption("--traces-dir", default=None, metavar="DIR",
                     help="folder of real traces (searched before $KVSIM_TRACES, then ../shared/traces)")


def pytest_configure(config):
    global TRACES_DIR
    TRACES_DIR = config.getoption("--traces-dir")


# The slowest files first, slowest at the top (seconds on the 2-core reference machine; the compile test
# with a cold Triton cache, as on a fresh machine): xdist then hands them out longest first and both
# workers finish together. pyproject's --no-loadscope-reorder keeps this order (xdist's own puts the files
# with the most tests first, which left the one-test compile and pipeline files to the very end).
SLOW_FILES_FIRST = ("test_gpu_compile.py", "test_gpu_pipeline.py", "test_gpu_kernels.py", "test_gpu_cli.py",
                    "test_report_browser.py", "test_report_layout.py", "test_engine.py", "test_equivalence_traces.py",
                    "test_steptime_fit.py", "test_gpu_model.py", "test_cluster.py", "test_traces.py",
                    "test_hostile_corpus.py", "test_processes.py", "test_plan.py", "test_gpu_device_check.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept


def scenario(**over):
    """A small valid scenario (OPT-13B on an A100-40GB), with top-level keys overridden."""
    data = {
        "name": "t",
        "model": "opt-13b",
        "gpu": "a100-40gb",
        "workload": {"arrival": {"kind": "poisson", "rate": 4.0}, "lengths": "sharegpt", "num_requests": 200, "seed": 1},
        "policies": ["fastertransformer", "orca-max", "orca-pow2", "orca-oracle", "vllm"],
    }
    data.update(over)
    return parse_scenario(data)


@pytest.fixture
def make_scenario():
    return scenario


def shared_trace(rel: str) -> Path:
    """A real trace by its path in a traces folder (sim.trace_paths' search order); skip if it is absent."""
    p = trace_paths.find_trace(rel, TRACES_DIR)
    if p is None:
        pytest.skip(f"trace {rel} not found in {trace_paths.searched(TRACES_DIR)}; real traces live outside the "
                    "project: `sim trace fetch tests` downloads them")
    return p


def needs_plain_python(what: str) -> None:
    """Skip a test that wraps the engine's own methods when the compiled build runs (sim/native.py): its
    modules call each other directly, past any wrapper. CI runs the whole suite in plain Python too."""
    from sim import native

    if native.active():
        pytest.skip(f"{what} wraps engine methods, which the compiled build calls directly: covered by the "
                    "plain-Python run of the suite")


def check_after_every_step(monkeypatch, check) -> dict:
    """Run ``check(scheduler)`` after every completed step and every span of steps; returns a counter
    ``{"n": steps checked}``. Wraps the scheduler's own methods (not an earlier wrapper), so calling it
    again in the same test (hypothesis examples) checks once per step, not once per call."""
    from sim.scheduler import Scheduler

    needs_plain_python("checking after every step")

    orig = Scheduler.__dict__.get("_unchecked_complete", Scheduler.complete)
    orig_span = Scheduler.__dict__.get("_unchecked_complete_span", Scheduler.complete_span)
    monkeypatch.setattr(Scheduler, "_unchecked_complete", orig, raising=False)
    monkeypatch.setattr(Scheduler, "_unchecked_complete_span", orig_span, raising=False)
    calls = {"n": 0}

    def complete(self, end_s):
        mem = orig(self, end_s)
        check(self)
        calls["n"] += 1
        return mem

    def complete_span(self, ends):
        mem = orig_span(self, ends)
        check(self)
        calls["n"] += 1
        return mem

    monkeypatch.setattr(Scheduler, "complete", complete)
    monkeypatch.setattr(Scheduler, "complete_span", complete_span)
    return calls


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
BROWSER_WINDOW = (1300, 1000)


@pytest.fixture(scope="session")
def _chromium(tmp_path_factory):
    """One headless Chromium for the whole session (tests/test_report_browser.py, test_report_layout.py):
    starting one costs seconds; each test gets it back at the default window size (``browser``)."""
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("chromium and chromedriver not installed "
                    "(apt-get install -y chromium chromium-driver; .ci/run installs them)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed (pip install -e '.[test]')")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
                 "--no-first-run", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                 f"--window-size={BROWSER_WINDOW[0]},{BROWSER_WINDOW[1]}",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture
def browser(_chromium):
    """The session's Chromium at its default window size, with the previous page's console log dropped."""
    _chromium.set_window_size(*BROWSER_WINDOW)
    _chromium.get("about:blank")
    _chromium.get_log("browser")
    return _chromium

