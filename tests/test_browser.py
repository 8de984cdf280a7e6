"""The lab as a person uses it, in a real browser: headless Chromium driven by Selenium.

`make lab` runs in a copy of the course (so that the lab's autosave never touches the repository), as the
README says to start it; the browser opens lesson 5 from the URL the lab printed, runs every cell from the
Run menu, reads the calculator's table, moves the "GiB per GPU" slider one step with the keyboard and sees
the table change; then it opens an exercise from the file browser. Screenshots of each stage are kept in
`out/browser/` (or `$BROWSER_SCREENSHOTS`). Where no Chromium and chromedriver are installed the test says
so and skips; under CI (`CI=true`), whose `.ci/run` installs them, it fails instead.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
SCREENSHOTS = Path(os.environ.get("BROWSER_SCREENSHOTS", ROOT / "out" / "browser"))

if not (CHROMIUM and CHROMEDRIVER):
    if os.environ.get("CI") == "true":
        pytest.fail("CI must run the browser test: .ci/run installs chromium and chromium-driver", pytrace=False)
    pytest.skip("no chromium and chromedriver here (Debian: apt-get install chromium chromium-driver)",
                allow_module_level=True)

from course_copy import copy_course, started_lab  # noqa: E402
from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(base URL, token) of `make lab` started in a copy of the course."""
    with started_lab(copy_course(tmp_path_factory.mktemp("lab") / "course")) as url:
        yield url


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[webdriver.Chrome]:
    """Headless Chromium. Its temporary folders go to a folder of the test's (`TMPDIR`): Chromium leaves one
    `org.chromium.Chromium.*` folder in the temporary folder every time it runs."""
    options = Options()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_argument("--window-size=1400,1000")
    temporary = tmp_path_factory.mktemp("chromium-tmp")
    service = Service(CHROMEDRIVER, env={**os.environ, "TMPDIR": str(temporary)})
    driver = webdriver.Chrome(service=service, options=options)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


def until(driver: webdriver.Chrome, condition, seconds: float = 120):
    """Wait for `condition(driver)` to be truthy, across the re-renders that replace elements."""
    return WebDriverWait(driver, seconds, ignored_exceptions=[StaleElementReferenceException]).until(condition)


def calculator_table(driver: webdriver.Chrome) -> str:
    tables = [o.text for o in driver.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output") if "fits" in o.text]
    return tables[-1] if tables else ""


def click_menu(driver: webdriver.Chrome, menu: str, item: str) -> None:
    until(driver, lambda d: [m for m in d.find_elements(By.CSS_SELECTOR, ".lm-MenuBar-itemLabel") if m.text == menu])[
        0
    ].click()
    until(driver, lambda d: [i for i in d.find_elements(By.CSS_SELECTOR, ".lm-Menu-itemLabel") if i.text == item])[
        0
    ].click()


def test_lesson_5_runs_in_the_browser_and_its_calculator_answers_a_slider(lab, browser) -> None:
    base, token = lab
    browser.get(f"{base}/lab/tree/work/lessons/05_at_scale.ipynb?token={token}")
    # Opened means every cell shown and the kernel idle: on a loaded machine the page shows one empty cell and a
    # kernel still starting for a while, and "Run All Cells" then runs nothing.
    cells = len(json.loads((ROOT / "lessons" / "05_at_scale.ipynb").read_text())["cells"])
    until(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-Cell")) == cells
          and "| Idle" in d.find_element(By.ID, "jp-main-statusbar").text, seconds=300)
    browser.save_screenshot(str(SCREENSHOTS / "lesson05_opened.png"))

    click_menu(browser, "Run", "Run All Cells")
    until(browser, lambda d: [s for s in d.find_elements(By.CSS_SELECTOR, ".widget-slider") if "GiB per GPU" in s.text],
          seconds=300)
    until(browser, lambda d: "fits" in calculator_table(d))
    first = calculator_table(browser)
    browser.save_screenshot(str(SCREENSHOTS / "lesson05_ran.png"))
    assert "--model llama-2-13b --gpu-memory 40GiB --nodes 4" in first and "fits 40 GiB" in first

    slider = next(s for s in browser.find_elements(By.CSS_SELECTOR, ".widget-slider") if "GiB per GPU" in s.text)
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", slider)
    handle = slider.find_element(By.CSS_SELECTOR, ".noUi-handle")
    handle.click()
    handle.send_keys(Keys.ARROW_RIGHT)
    until(browser, lambda d: "fits 48 GiB" in calculator_table(d), seconds=30)
    browser.save_screenshot(str(SCREENSHOTS / "lesson05_slider_moved.png"))
    assert "--model llama-2-13b --gpu-memory 48GiB --nodes 4" in calculator_table(browser)


def test_an_exercise_opens_from_the_file_browser(lab, browser) -> None:
    base, token = lab
    browser.get(f"{base}/lab/tree/work/exercises?token={token}")

    def listed(name: str):
        return lambda d: [e for e in d.find_elements(By.CSS_SELECTOR, ".jp-DirListing-item") if name in e.text]

    ActionChains(browser).double_click(until(browser, listed("ex01_collectives"))[0]).perform()
    ActionChains(browser).double_click(until(browser, listed("ex01_collectives.ipynb"))[0]).perform()
    tabs = ".lm-TabBar-tabLabel"
    until(browser, lambda d: [t for t in d.find_elements(By.CSS_SELECTOR, tabs) if t.text == "ex01_collectives.ipynb"])
    shown = ".jp-NotebookPanel:not(.lm-mod-hidden)"
    until(browser, lambda d: "YOUR CODE HERE" in d.find_element(By.CSS_SELECTOR, shown).text)
    browser.save_screenshot(str(SCREENSHOTS / "exercise_opened.png"))
