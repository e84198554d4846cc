"""The labeling page in a real browser (headless Chromium from the Debian packages, driven by Selenium through the
system chromedriver: nothing is downloaded), the exported labels training a reward model, and a server killed with
SIGKILL keeping every judgement it confirmed.

Set LHPD_WRITE_SCREENSHOT=1 to write the screenshot taken here to docs/labeling.png.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from lm_human_preference_details.labeling.labelclient import LabelClient, LabelServerError
from lm_human_preference_details.labeling.labelstore import LabelStore, load_candidates, read_judgements, shown_order
from lm_human_preference_details.modeling import load_reward_model
from tests.labeling import QUERY_LENGTH, RESPONSE_LENGTH, SCRIPT, ThreadedServer, write_candidates
from tests.planted import REPO, free_port, run_script, script_env, write_query_file

CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
BROWSER_MISSING = not (os.path.isfile(CHROMEDRIVER) and os.path.isfile(CHROMIUM))
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
ANN = [0, 1, 3, 0, 1, 2]
"""the sample ann picks on rows 0-5 (in the browser, by the key of its shown position)"""
BOB = [0, 1, 3, 2, 1, 0]
"""the sample bob picks (through the API client): the same as ann on rows 0, 1, 2 and 4"""

pytestmark = [
    pytest.mark.skipif(
        BROWSER_MISSING and not IN_CI,
        reason="chromium and chromium-driver are not installed (apt-get install chromium chromium-driver); under "
        "CI=true these tests run and fail instead",
    ),
    pytest.mark.usefixtures("single_thread"),
]


@pytest.fixture(scope="module")
def driver():
    assert not BROWSER_MISSING, f"CI needs {CHROMIUM} and {CHROMEDRIVER}: apt-get install chromium chromium-driver"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,860"):
        options.add_argument(flag)
    # Chromium puts its profile and singleton socket under TMPDIR; a socket's path is limited to 107 bytes, so a long
    # TMPDIR (a deep CI work directory) would stop Chromium at its start: give it a short one of its own
    with tempfile.TemporaryDirectory(prefix="chromium-", dir="/tmp") as short_tmp:
        service = Service(executable_path=CHROMEDRIVER, env={**os.environ, "TMPDIR": short_tmp})  # no Selenium Manager
        browser = webdriver.Chrome(service=service, options=options)
        yield browser
        browser.quit()


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer, tiny_model_dir):
    root = tmp_path_factory.mktemp("browser-labels")
    candidates = write_candidates(root / "candidates.json", tokenizer, tiny_model_dir)
    store = LabelStore(load_candidates(str(candidates)), str(root / "human.json"), shared_fraction=1.0)
    from lm_human_preference_details.labeling.labelserver import create_app

    server = ThreadedServer(create_app(store, None))
    yield {"root": root, "store": store, "url": server.url, "output": root / "human.json"}
    server.stop()
    store.close()


def wait_for(driver, condition, timeout: float = 15.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(lambda d: condition(d))


def name_field(driver):
    """The page's name field once the page shows it (it exists, hidden, while the page's script starts)."""
    from selenium.webdriver.common.by import By

    return wait_for(
        driver, lambda d: (field := d.find_element(By.ID, "name")).is_displayed() and field.is_enabled() and field
    )


def shown_row(driver) -> str | None:
    return driver.execute_script("return document.body.dataset.row || null")


def press(driver, key: str, then_row: str) -> None:
    """Type one key on the page and wait until it shows `then_row`."""
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(driver).send_keys(key).perform()
    wait_for(driver, lambda d: shown_row(d) == then_row)


def key_for(name: str, row: int, sample: int) -> str:
    """The key that picks `sample` of `row` on `name`'s page (responses are shown in a per-labeler order)."""
    return str(shown_order(name, row, 4).index(sample) + 1)


@pytest.fixture(scope="module")
def session(driver, served):
    """ann labels in the browser with the keyboard (one mistake undone, a reload in the middle), bob through the API;
    what the page showed on the way."""
    from selenium.webdriver.common.by import By

    seen = {}
    driver.get(served["url"])
    name = name_field(driver)
    name.send_keys("ann\n")
    wait_for(driver, lambda d: shown_row(d) == "0")
    press(driver, key_for("ann", 0, ANN[0]), "1")
    press(driver, key_for("ann", 1, 2), "2")  # a mistake on row 1 ...
    seen["texts_row2"] = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#responses .text")]
    seen["script_elements"] = len(driver.find_elements(By.CSS_SELECTOR, "#responses script, #query script"))
    seen["alert"] = driver.execute_script("return typeof window.__alerted")
    press(driver, "u", "1")  # ... undone
    seen["status_after_undo"] = driver.find_element(By.ID, "status").text
    press(driver, key_for("ann", 1, ANN[1]), "2")
    driver.refresh()
    wait_for(driver, lambda d: shown_row(d) == "2")
    seen["resumed_progress"] = driver.find_element(By.ID, "progress").text
    screenshot = served["root"] / "labeling.png"
    driver.save_screenshot(str(screenshot))
    if os.environ.get("LHPD_WRITE_SCREENSHOT") == "1":
        shutil.copy(screenshot, REPO / "docs" / "labeling.png")
    seen["screenshot"] = screenshot
    for row in range(2, 6):
        press(driver, key_for("ann", row, ANN[row]), str(row + 1) if row < 5 else "done")
    bob = LabelClient(served["url"], "bob")
    seen["bob_labelled"] = bob.label_all(lambda r: shown_order("bob", r["row"], 4).index(BOB[r["row"]]))
    driver.get(served["url"] + "/stats")
    wait_for(driver, lambda d: d.execute_script("return document.body.dataset.loaded") == "1")
    seen["pairs"] = [[c.text for c in tr.find_elements(By.TAG_NAME, "td")] for tr in driver.find_elements(
        By.CSS_SELECTOR, "#pairs tbody tr")]  # fmt: skip
    seen["fleiss"] = driver.find_element(By.ID, "fleiss").text
    seen["labelers"] = [[c.text for c in tr.find_elements(By.TAG_NAME, "td")] for tr in driver.find_elements(
        By.CSS_SELECTOR, "#labelers tbody tr")]  # fmt: skip
    return seen


def test_keyboard_labels_undo_and_reload_resume(session, served):
    judgements = [(j.labeler, j.row, j.label) for j in served["store"].judgements()]
    assert [(row, label) for name, row, label in judgements if name == "ann"] == list(enumerate(ANN))
    assert session["status_after_undo"] == "undid row 1"
    assert session["resumed_progress"].startswith("2 labelled, 0 skipped, 4 left for you")
    with open(f"{served['output']}.judgements.jsonl", encoding="utf-8") as f:
        events = [json.loads(line) for line in f]
    undone = [e for e in events if e["event"] == "undo"]
    assert len(undone) == 1 and undone[0]["row"] == 1 and undone[0]["labeler"] == "ann"
    first = next(e for e in events if e["event"] == "label")
    assert first["shown_order"] == shown_order("ann", 0, 4) and first["label"] == ANN[0]


def test_script_in_a_response_is_shown_as_text(session):
    assert SCRIPT in [text.strip() for text in session["texts_row2"]]
    assert session["script_elements"] == 0 and session["alert"] == "undefined"


def test_stats_page_shows_the_hand_computed_agreement(session, served):
    # ann and bob agree on 4 of 6 rows; each picked samples 0 and 1 twice, 2 and 3 once: chance 10/36, so Cohen's
    # kappa = (24/36 - 10/36) / (26/36) = 7/13 = 0.538; with two labelers Fleiss' kappa is the same here
    assert session["bob_labelled"] == 6
    assert session["pairs"] == [["ann & bob", "6", "0.667", "0.538"]]
    assert session["fleiss"].endswith("0.538")
    assert session["labelers"] == [["ann", "6", "0", "6", "0.667 (6 rows)"], ["bob", "6", "0", "6", "0.667 (6 rows)"]]


def test_screenshot_shows_the_page(session):
    from PIL import Image

    with Image.open(session["screenshot"]) as image:
        assert image.size[0] >= 1200 and len(image.getcolors(1 << 20) or []) > 20  # a rendered page, not blank


def test_scalar_compare_page_compares_two_responses(driver, tmp_path, tokenizer, tiny_model_dir):
    from selenium.webdriver.common.by import By

    from lm_human_preference_details.labeling.labelserver import create_app

    candidates = write_candidates(tmp_path / "compare.json", tokenizer, tiny_model_dir, "scalar_compare")
    store = LabelStore(load_candidates(str(candidates)), str(tmp_path / "compare-labels.json"))
    server = ThreadedServer(create_app(store, None))
    try:
        driver.get(server.url)  # another port, another origin: no name remembered
        name_field(driver).send_keys("cat\n")
        wait_for(driver, lambda d: shown_row(d) == "0")
        keys = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#responses .key")]
        scale = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#scale button")]
        press(driver, "5", "1")  # "B much better"
    finally:
        server.stop()
        store.close()
    assert keys == ["A", "B"] and scale[0] == "1: A much better" and scale[-1] == "5: B much better"
    (judgement,) = store.judgements()
    assert judgement.label == (2.0 if shown_order("cat", 0, 2) == [0, 1] else -2.0)  # score(sample1) - score(sample0)


@pytest.mark.slow
def test_exported_labels_train_a_reward_model(session, served, tiny_model_dir, tmp_path):
    deadline = time.time() + 10
    while len(rows := json.loads(served["output"].read_text())) < 6 and time.time() < deadline:
        time.sleep(0.1)  # rewritten at most every labelstore.EXPORT_SECONDS
    assert [r["best"] for r in rows] == ANN  # ties (ann vs bob) go to the earlier judgement: ann's
    corpus = write_query_file(tmp_path / "queries.txt", n=40)
    rm_dir = tmp_path / "rm"
    run_script(
        "train_reward.py",
        *("--base_model", tiny_model_dir, "--label_dataset", str(served["output"])),
        *("--task.query_dataset", str(corpus), "--task.query_length", str(QUERY_LENGTH)),
        *("--task.response_length", str(RESPONSE_LENGTH), "--labels.num_train", "6", "--batch_size", "2"),
        *("--rollout_batch_size", "8", "--normalize_samples", "0", "--output_dir", str(rm_dir)),
        timeout=300,
    )
    _, metadata = load_reward_model(str(rm_dir))
    assert metadata["label_dataset"] == str(served["output"]) and metadata["num_train"] == 6


def start_server(candidates, output, port: int) -> subprocess.Popen:
    """`label_generation.py serve` as a user starts it; returns once it printed its URL."""
    process = subprocess.Popen(
        [sys.executable, str(REPO / "label_generation.py"), "serve", "--candidates", str(candidates)]
        + ["--output", str(output), "--port", str(port), "--shared_fraction", "1"],
        cwd=REPO,
        env=script_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in process.stdout:
        lines.append(line)
        if f"127.0.0.1:{port}/" in line:
            return process
    raise AssertionError("serve exited before listening:\n" + "".join(lines))


@pytest.mark.slow
def test_sigkill_in_the_middle_of_labeling_loses_no_confirmed_judgement(tmp_path, tokenizer, tiny_model_dir):
    candidates = write_candidates(tmp_path / "candidates.json", tokenizer, tiny_model_dir)
    content = json.loads(candidates.read_text())
    content["rows"] *= 40  # 240 rows: labeling is still going on when the server is killed
    candidates.write_text(json.dumps(content))
    output, port = tmp_path / "human.json", free_port()
    process = start_server(candidates, output, port)
    client = LabelClient(f"http://127.0.0.1:{port}", "ann", timeout=5)
    confirmed = []

    def label():
        try:
            row = client.next()
            while row["row"] is not None:
                answered = row["row"]
                row = client.judge(answered, 0)["next"]
                confirmed.append(answered)
        except (OSError, LabelServerError):
            return

    worker = threading.Thread(target=label)
    worker.start()
    deadline = time.time() + 60
    while len(confirmed) < 5 and time.time() < deadline and worker.is_alive():
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    worker.join()
    assert 5 <= len(confirmed) < 240
    logged = [j.row for j in read_judgements(str(output))[0]]
    assert logged[: len(confirmed)] == confirmed and len(logged) <= len(confirmed) + 1  # at most the one in flight

    process = start_server(candidates, output, port)  # the same command again
    try:
        resumed = client.next()
        assert resumed["row"] == len(logged) and resumed["progress"]["labelled"] == len(logged)
        with open(output, encoding="utf-8") as f:
            assert len(json.load(f)) == len(logged)  # the label file holds every logged judgement
    finally:
        process.send_signal(signal.SIGINT)  # Ctrl-C
        rest = process.communicate(timeout=30)[0]
    assert process.returncode == 0 and f"stopped: {len(logged)} judgements" in rest


class ServedStore:
    """A label store of `label_type` candidates behind a ThreadedServer (polling every half second)."""

    def __init__(self, root, tokenizer, model_dir, label_type="best_of_4", shared=1.0, token=None, num_rows=6):
        from lm_human_preference_details.labeling.labelserver import create_app

        root.mkdir(parents=True, exist_ok=True)
        candidates = write_candidates(root / "candidates.json", tokenizer, model_dir, label_type, num_rows)
        self.store = LabelStore(load_candidates(str(candidates)), str(root / "labels.json"), shared_fraction=shared)
        self.server = ThreadedServer(create_app(self.store, token, poll_seconds=0.5))
        self.url = self.server.url

    def close(self):
        self.server.stop()
        self.store.close()


OVERFLOW = """
const list = document.getElementById("responses").getBoundingClientRect();
return [...document.querySelectorAll("#responses .response")].map((box) => {
  const r = box.getBoundingClientRect();
  return Math.max(r.right - list.right, list.left - r.left);
});
"""
"""per response box, how far it reaches past its column (<= 0: inside)"""


@pytest.mark.parametrize("label_type", ["scalar_compare", "scalar_rating"])
def test_response_boxes_stay_inside_their_column(driver, tmp_path, tokenizer, tiny_model_dir, label_type):
    served = ServedStore(tmp_path, tokenizer, tiny_model_dir, label_type)
    try:
        driver.get(served.url)
        name_field(driver).send_keys("kim\n")
        wait_for(driver, lambda d: shown_row(d) == "0")
        overflow = driver.execute_script(OVERFLOW)
    finally:
        served.close()
    assert overflow and max(overflow) <= 0.5, overflow


def page_overflow(driver) -> int:
    """How many CSS pixels the page scrolls sideways."""
    return driver.execute_script("return document.documentElement.scrollWidth - document.documentElement.clientWidth")


def test_labeling_and_stats_pages_fit_a_390px_phone_screen(driver, session, served):
    driver.set_window_size(390, 844)
    try:
        driver.get(served["url"] + "/stats")
        wait_for(driver, lambda d: d.execute_script("return document.body.dataset.loaded") == "1")
        stats_overflow = page_overflow(driver)
        driver.save_screenshot(str(served["root"] / "stats-390.png"))
        driver.get(served["url"])
        wait_for(driver, lambda d: shown_row(d) == "done")  # ann labelled every row
        labeling_overflow = page_overflow(driver)
        width = driver.execute_script("return document.documentElement.clientWidth")
    finally:
        driver.set_window_size(1280, 860)
    assert width <= 400 and stats_overflow <= 0 and labeling_overflow <= 0, (stats_overflow, labeling_overflow)


def test_done_screen_keeps_the_controls_says_why_and_shows_a_row_that_comes_back(
    driver, tmp_path, tokenizer, tiny_model_dir
):
    from selenium.webdriver.common.by import By

    served = ServedStore(tmp_path, tokenizer, tiny_model_dir, shared=0.0, num_rows=2)
    try:
        other = LabelClient(served.url, "eve")
        assert other.next()["row"] == 0  # eve is shown row 0: it is kept from dan
        driver.get(served.url)
        name_field(driver).send_keys("dan\n")
        wait_for(driver, lambda d: shown_row(d) == "1")
        press(driver, key_for("dan", 1, 2), "done")
        done = driver.find_element(By.ID, "done").text
        controls = {i: driver.find_element(By.ID, i) for i in ("progress", "undo", "rename")}
        shown = {i: e.is_displayed() for i, e in controls.items()}
        undo_enabled = controls["undo"].is_enabled()
        progress = controls["progress"].text
        other.skip(0)  # eve moves on: row 0 is free, and dan's page shows it without a reload
        wait_for(driver, lambda d: shown_row(d) == "0", timeout=10)
    finally:
        served.close()
    assert "1 row is being labelled by others" in done and "checking again" in done
    assert shown == {"progress": True, "undo": True, "rename": True} and undo_enabled
    assert progress.startswith("1 labelled, 0 skipped, 0 left for you")


def test_a_page_left_behind_by_another_tab_recovers(driver, tmp_path, tokenizer, tiny_model_dir):
    from selenium.webdriver.common.by import By

    served = ServedStore(tmp_path, tokenizer, tiny_model_dir)
    try:
        driver.get(served.url)
        name_field(driver).send_keys("fay\n")
        wait_for(driver, lambda d: shown_row(d) == "0")
        key = driver.execute_script("return JSON.parse(localStorage.getItem('labelerKeys')).fay")
        assert key and driver.find_element(By.ID, "key").get_attribute("textContent") == key  # shown on the page
        with pytest.raises(LabelServerError, match="403: the name 'fay' is in use"):
            LabelClient(served.url, "fay").judge(0, 1)  # without fay's labeler key
        LabelClient(served.url, "fay", key=key).judge(0, 1)  # fay's other tab labels row 0
        press(driver, key_for("fay", 0, 3), "1")  # this tab still shows row 0: it moves on instead of sticking
        status = driver.find_element(By.ID, "status").text
        labels = [(j.row, j.label) for j in served.store.judgements()]
    finally:
        served.close()
    assert "already labelled row 0" in status and labels == [(0, shown_order("fay", 0, 4)[1])]


def test_the_token_url_leaves_no_token_in_the_address_bar(driver, tmp_path, tokenizer, tiny_model_dir):
    from selenium.webdriver.common.by import By

    token = "k" * 24
    served = ServedStore(tmp_path, tokenizer, tiny_model_dir, token=token)
    first_tab = driver.current_window_handle
    driver.switch_to.new_window("tab")  # a history of its own
    try:
        driver.get(f"{served.url}/?token={token}")
        name_field(driver)  # the page talks to the API: the cookie carries the token
        first = driver.current_url
        instructions = driver.find_element(By.ID, "instructions").get_attribute("textContent")
        driver.get(f"{served.url}/stats?token={token}")
        wait_for(driver, lambda d: d.execute_script("return document.body.dataset.loaded") == "1")
        second = driver.current_url
        history = driver.execute_script("return history.length")
    finally:
        driver.close()
        driver.switch_to.window(first_tab)
        served.close()
    assert first == served.url + "/" and second == served.url + "/stats" and instructions
    assert history <= 3  # the redirects added no entries of their own: (a blank page,) the page, the stats page
