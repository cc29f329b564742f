"""A headless Chromium for tests of the page, driven by Selenium through Debian's ``chromium`` and
``chromium-driver`` packages (CI installs them); without them the test skips and says why."""

from __future__ import annotations

import os
import shutil
import time

import pytest


def chromium(width: int = 1400, height: int = 1000):
    """A headless Chromium (Selenium's ``WebDriver``), or a skip that says what is missing."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')")
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not binary or not driver:
        pytest.skip("no headless browser: apt-get install chromium chromium-driver (Debian) to run the page's tests")
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must not try to download a driver
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)


def wait_for(what, timeout_s: float = 30.0, every_s: float = 0.1, why: str = ""):
    """``what()``'s first truthy value within ``timeout_s`` seconds, or a failure saying ``why``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = what()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {why or what}"
        time.sleep(every_s)
