"""A headless Chromium for tests of the page, driven by Selenium through Debian's ``chromium`` and
``chromium-driver`` packages (CI installs them); without them the test skips and says why."""

from __future__ import annotations

import os
import shutil
import time

import pytest


class NoBrowser(Exception):
    pass


def launch(width: int = 1400, height: int = 1000):
    """A headless Chromium (Selenium's ``WebDriver``); :class:`NoBrowser` says what is missing
    (``benchmarks/page_overhead.py`` uses it too)."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        raise NoBrowser("selenium is not installed (pip install -e '.[test]')") from None
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not binary or not driver:
        raise NoBrowser("no headless browser: apt-get install chromium chromium-driver (Debian)")
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must not try to download a driver
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)


def chromium(width: int = 1400, height: int = 1000):
    """:func:`launch`, or a skip of the test that says what is missing."""
    try:
        return launch(width, height)
    except NoBrowser as e:
        pytest.skip(f"{e}: the page's browser tests need it")


def wait_for(what, timeout_s: float = 30.0, every_s: float = 0.1, why: str = ""):
    """``what()``'s first truthy value within ``timeout_s`` seconds, or a failure saying ``why``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = what()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {why or what}"
        time.sleep(every_s)
