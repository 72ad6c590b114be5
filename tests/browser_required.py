"""A real browser for the tests that look at MLflow's UI: Playwright driving Debian's `chromium` (Playwright
cannot download its own browsers here). Skipped where either is missing, unless KLSTUDY_REQUIRE_BROWSER=1
(set by .ci/run, which installs chromium), where a missing one fails them instead."""

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("KLSTUDY_CHROMIUM", "/usr/bin/chromium")
# On a machine without internet, Chromium waits on its background services unless they are off.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WINDOW = {"width": 1600, "height": 1000}
try:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
except ImportError:  # require_browser() says so
    PlaywrightTimeout = TimeoutError
# Where the screenshots go: CI keeps them; docs/mlflow_ui.md shows two of them.
ARTIFACTS = Path(os.environ.get("KLSTUDY_TEST_ARTIFACTS", Path(__file__).resolve().parents[1] / "test-artifacts"))


def require_browser():
    """Playwright's sync API, or skip (fail under KLSTUDY_REQUIRE_BROWSER=1) with what installs it."""
    missing = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as error:
        missing = f"playwright does not import ({error}): make setup installs the test extra"
    if missing is None and not shutil.which(CHROMIUM):
        missing = f"no Chromium at {CHROMIUM}: apt-get install chromium (or set KLSTUDY_CHROMIUM)"
    if missing is not None:
        if os.environ.get("KLSTUDY_REQUIRE_BROWSER") == "1":
            pytest.fail(f"KLSTUDY_REQUIRE_BROWSER=1 but {missing}")
        pytest.skip(missing)
    return sync_playwright


@contextmanager
def browser(**options):
    """A fresh Chromium profile (no stored UI state: what a newcomer sees); `options` go to the context
    (http_credentials, viewport)."""
    sync_playwright = require_browser()
    with sync_playwright() as playwright, tempfile.TemporaryDirectory(prefix="klstudy-chromium-") as profile:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, args=FLAGS, headless=True, **{"viewport": WINDOW, **options})
        context.set_default_timeout(60_000)
        try:
            yield context
        finally:
            context.close()


def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path))
    return path
