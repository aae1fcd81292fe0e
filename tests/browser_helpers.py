"""Headless Debian chromium through chromedriver (selenium), for the chat page's tests.

The network is closed here: chromium's background services (component updates, sync,
QUIC probes) would stall it, so they are off, and the profile is a fresh folder each time.
Selenium is given both binaries, so it never looks for (downloads) a driver of its own.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Callable, TypeVar

import pytest

INSTALL = ("the browser tests need Debian's chromium and chromium-driver and the selenium package: "
           "apt-get install chromium chromium-driver; pip install -e '.[test]'")

T = TypeVar("T")


def _binaries() -> tuple[str, str] | None:
    browser = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def chromium(width: int = 1280, height: int = 860):
    """A headless chromium session, or a skip that says how to install one; close with ``quit()``."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip(INSTALL)
    found = _binaries()
    if found is None:
        pytest.skip(INSTALL)
    browser, driver = found
    os.environ.setdefault("SE_AVOID_STATS", "true")  # selenium's telemetry: nowhere to send it
    profile = tempfile.mkdtemp(prefix="superfluid-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--window-size={width},{height}", f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    d = webdriver.Chrome(options=opts, service=Service(executable_path=driver))
    d.set_script_timeout(30)
    quit_ = d.quit

    def quit_and_clean() -> None:
        quit_()
        shutil.rmtree(profile, ignore_errors=True)

    d.quit = quit_and_clean
    return d


def wait_for(check: Callable[[], T], timeout: float = 20.0, every: float = 0.02, what: str = "the condition") -> T:
    """``check()``'s first truthy value, polled; AssertionError past the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)
