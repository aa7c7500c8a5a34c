"""lnn-serve's page for phones in a real headless Chromium (Debian's `chromium`, driven by Playwright):
take a photo (the file input), read the answer in words with its advice, see it in this phone's history,
get a retake reason for an uncertain answer, and a one-line reason for a file that is not a photo; a
large photo is shrunk on the phone to the server's upload side (twice what the model needs) before it is
sent, with the original's answer; the QR code of the page's address is shown for another phone (read back
from the screenshot with OpenCV's QR reader).

The server is the real command on a free loopback port. The retake case answers with a routed response
carrying the trust gate's `reason` field, so the page's wording is tested whatever the model answers.
A screenshot of a phone-sized page is written to the test's tmp folder; set LNN_SCREENSHOT to a path
relative to the repository to copy it there too (docs/images/serve_page.png was made this way)."""

import json
import os
import shutil

import pytest

pytest.importorskip("uvicorn")
sync_api = pytest.importorskip("playwright.sync_api")

from conftest import EXAMPLES, REPO, qr_code_text  # noqa: E402
from hostile_images import with_data_left_over  # noqa: E402
import lnn  # noqa: E402
from lnn.tools.infer import DEFAULT_MODEL, judge_images  # noqa: E402
from lnn.tools.serve import DEFAULTS, launch_process  # noqa: E402
from lnn.tools.serve_app import prepare_upload  # noqa: E402

PHONE = {"width": 390, "height": 844}
WAIT_MS = 60_000


@pytest.fixture(scope="module")
def server_url():
    process, url = launch_process("--port", "0", "--device", "numpy")
    yield url
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run installs it)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        yield browser
        browser.close()


def photo_part(body: bytes) -> bytes:
    """The photo in a multipart form the page posted: its JPEG, from its start marker on."""
    return body[body.index(b"\xff\xd8\xff"):]


def served_judgement(session, data: bytes) -> tuple:
    """(probabilities [1, K], reasons) of one upload as lnn-serve judges it: prepare_upload at the server's
    --max-pixels, then judge_images."""
    x, check, _ = prepare_upload(session, data, DEFAULTS.max_pixels)
    return judge_images(session, [x], [check])


def wait_ready(page, url):
    for _ in range(600):
        if page.request.get(url + "readyz").ok:
            return
        page.wait_for_timeout(100)
    pytest.fail("lnn-serve never became ready")


def test_photo_answer_history_and_screenshot(browser, server_url, tmp_path):
    page = browser.new_page(viewport=PHONE)
    wait_ready(page, server_url)
    page.goto(server_url)
    photo = page.locator("#photo")
    assert photo.get_attribute("capture") == "environment" and photo.get_attribute("accept") == "image/*"

    photo.set_input_files(str(EXAMPLES / "leaves" / "late_blight.jpg"))
    page.wait_for_function("document.querySelector('#headline').textContent.includes('Late blight')", timeout=WAIT_MS)
    assert "sure" in page.text_content("#headline")
    assert page.text_content("#advice").startswith("Advice: Remove and destroy infected leaves")
    assert page.locator("#others li").count() == 2

    photo.set_input_files(str(EXAMPLES / "leaves" / "healthy.jpg"))
    page.wait_for_function("document.querySelector('#headline').textContent.includes('Healthy')", timeout=WAIT_MS)
    history = page.locator("#history li")
    assert history.count() == 2 and "Healthy" in history.nth(0).text_content()
    assert "Late blight" in history.nth(1).text_content()

    page.screenshot(path=str(tmp_path / "serve_page.png"), full_page=True)
    print(f"screenshot: {tmp_path / 'serve_page.png'}")
    if os.environ.get("LNN_SCREENSHOT"):
        shutil.copyfile(tmp_path / "serve_page.png", REPO / os.environ["LNN_SCREENSHOT"])

    page.reload()                                        # the history is kept on the phone
    assert page.locator("#history li").count() == 2
    page.close()


def test_not_a_photo_gets_the_servers_reason(browser, server_url, tmp_path):
    page = browser.new_page(viewport=PHONE)
    wait_ready(page, server_url)
    page.goto(server_url)
    (tmp_path / "notes.jpg").write_text("a shopping list, not a photo")
    page.locator("#photo").set_input_files(str(tmp_path / "notes.jpg"))
    page.wait_for_function("document.querySelector('#headline').textContent.includes('No answer')", timeout=WAIT_MS)
    assert "not an image" in page.text_content("#advice")
    assert page.locator("#history li").count() == 0
    page.close()


def test_a_large_photo_is_shrunk_on_the_phone_before_sending(browser, server_url, tmp_path):
    import cv2
    import numpy as np

    leaf = cv2.imread(str(EXAMPLES / "leaves" / "late_blight.jpg"))
    cv2.imwrite(str(tmp_path / "big.jpg"), cv2.resize(leaf, (2400, 1800)))
    sent = []

    def keep_and_send(route):
        sent.append(route.request.post_data_buffer)
        route.continue_()

    page = browser.new_page(viewport=PHONE)
    wait_ready(page, server_url)
    page.goto(server_url)
    page.route("**/v1/classify", keep_and_send)
    page.locator("#photo").set_input_files(str(tmp_path / "big.jpg"))
    page.wait_for_function("document.querySelector('#headline').textContent.includes('Late blight')", timeout=WAIT_MS)
    jpeg = photo_part(sent[0])
    height, width = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR).shape[:2]
    side = page.request.get(server_url + "v1/model").json()["upload_side"]
    assert (width, height) == (round(side * 4 / 3), side) == (683, 512)
    session = lnn.load(DEFAULT_MODEL, device="numpy")           # the server's, as judged without it
    (sent_probabilities, _), (probabilities, _) = (served_judgement(session, data)
                                                    for data in (jpeg, (tmp_path / "big.jpg").read_bytes()))
    np.testing.assert_allclose(sent_probabilities, probabilities, atol=0.01)
    page.close()


def test_a_phone_photo_shrunk_on_the_page_keeps_the_photo_checks_reason(browser, server_url, tmp_path):
    """A 12 MP photo, sharp, blurred past the photo checks' threshold, too dark, or with the leaf small in the
    frame, gets the same reason from the photo the page sends as from the original, and nearly the same
    probabilities (the page's 2x2 halving and JPEG at 0.92, then the box's reduced decoding)."""
    import cv2
    import numpy as np

    leaf = cv2.imread(str(EXAMPLES / "leaves" / "early_blight.jpg"))
    frame = np.full((3024, 4032, 3), (90, 110, 120), np.uint8)
    frame[1200:1900, 1700:2400] = cv2.resize(leaf, (700, 700))
    photos = {"sharp": leaf, "blurred": cv2.GaussianBlur(leaf, (0, 0), 3), "dark": (leaf * 0.25).astype(np.uint8)}
    photos = {name: cv2.resize(image, (4032, 3024), interpolation=cv2.INTER_CUBIC) for name, image in photos.items()}
    photos["small leaf"] = frame
    session = lnn.load(DEFAULT_MODEL, device="numpy")
    page = browser.new_page(viewport=PHONE)
    wait_ready(page, server_url)
    sent = []
    page.route("**/v1/classify", lambda route: (sent.append(route.request.post_data_buffer),
                                                route.fulfill(status=400, json={"error": "x", "status": 400})))
    page.goto(server_url)
    reasons = {}
    for count, (name, image) in enumerate(photos.items(), start=1):
        original = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 92])[1].tobytes()
        (tmp_path / "photo.jpg").write_bytes(original)
        page.locator("#photo").set_input_files(str(tmp_path / "photo.jpg"))
        for _ in range(WAIT_MS // 100):
            if len(sent) == count:
                break
            page.wait_for_timeout(100)
        (sent_probabilities, sent_reasons), (probabilities, original_reasons) = (
            served_judgement(session, data) for data in (photo_part(sent[count - 1]), original))
        reasons[name] = original_reasons[0]
        assert sent_reasons == original_reasons, name
        np.testing.assert_allclose(sent_probabilities, probabilities, atol=0.1, err_msg=name)
    assert reasons == {"sharp": None, "blurred": "blurred", "dark": "too_dark", "small leaf": "not_a_leaf"}
    page.close()


def test_a_photo_is_shrunk_to_no_more_than_1600_px_without_the_models_side(browser, server_url, tmp_path):
    """Where the server's /v1/model cannot be read (or gives no upload side), a photo is still shrunk to 1600
    pixels on its long side."""
    import cv2
    import numpy as np

    cv2.imwrite(str(tmp_path / "big.jpg"), cv2.resize(cv2.imread(str(EXAMPLES / "leaves" / "late_blight.jpg")),
                                                      (2400, 1800)))
    sent = []
    page = browser.new_page(viewport=PHONE)
    wait_ready(page, server_url)
    page.route("**/v1/model", lambda route: route.fulfill(status=500, body="no"))
    page.route("**/v1/classify", lambda route: (sent.append(route.request.post_data_buffer),
                                                route.fulfill(status=400, json={"error": "x", "status": 400})))
    page.goto(server_url)
    page.locator("#photo").set_input_files(str(tmp_path / "big.jpg"))
    page.wait_for_function("document.querySelector('#headline').textContent.includes('No answer')", timeout=WAIT_MS)
    jpeg = photo_part(sent[0])
    assert cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR).shape[:2] == (1200, 1600)
    page.close()


def test_the_answers_notes_are_shown_and_cleared(browser, server_url, tmp_path):
    """A JPEG with bytes before its end marker that no block uses (DJI drones write them; most damage ends so)
    is answered with a note, which the page shows under the answer; the next photo's answer has none."""
    (tmp_path / "drone.jpg").write_bytes(with_data_left_over((EXAMPLES / "leaves" / "late_blight.jpg").read_bytes()))
    page = browser.new_page(viewport=PHONE)
    wait_ready(page, server_url)
    page.goto(server_url)
    page.locator("#photo").set_input_files(str(tmp_path / "drone.jpg"))
    page.wait_for_function("document.querySelector('#headline').textContent.includes('Late blight')", timeout=WAIT_MS)
    notes = page.locator("#notes li")
    assert notes.count() == 1 and notes.nth(0).text_content().startswith("Note: ")
    assert "ran on after its image ended" in notes.nth(0).text_content()
    page.locator("#photo").set_input_files(str(EXAMPLES / "leaves" / "healthy.jpg"))
    page.wait_for_function("document.querySelector('#headline').textContent.includes('Healthy')", timeout=WAIT_MS)
    assert page.locator("#notes li").count() == 0
    page.close()


def test_uncertain_answer_shows_the_retake_reason(browser, server_url):
    page = browser.new_page(viewport=PHONE)
    page.goto(server_url)
    answer = {"file": "leaf.jpg", "label": "late_blight", "display": "Late blight", "confidence": 0.41,
              "uncertain": True, "reason": "blurred",
              "top_k": [{"label": "late_blight", "display": "Late blight", "probability": 0.41},
                        {"label": "early_blight", "display": "Early blight", "probability": 0.33}]}
    page.route("**/v1/classify", lambda route: route.fulfill(status=200, content_type="application/json",
                                                              body=json.dumps(answer)))
    page.locator("#photo").set_input_files(str(EXAMPLES / "leaves" / "early_blight.jpg"))
    page.wait_for_function("document.querySelector('#headline').textContent.includes('Uncertain')", timeout=WAIT_MS)
    assert "blurred" in page.text_content("#advice") and "Hold the phone still" in page.text_content("#advice")
    assert page.locator("#others li").count() == 0           # a photo to retake shows no disease scores
    answer.update(reason="not_a_leaf", instruction="Photograph one tomato leaf, close up.")    # the server's words win
    page.locator("#photo").set_input_files(str(EXAMPLES / "leaves" / "healthy.jpg"))
    page.wait_for_function("document.querySelector('#advice').textContent.includes('close up.')", timeout=WAIT_MS)
    assert page.locator("#others li").count() == 0
    answer.update(reason="low_confidence", instruction=None)             # a best guess under the threshold: listed
    page.locator("#photo").set_input_files(str(EXAMPLES / "leaves" / "late_blight.jpg"))
    page.wait_for_function("document.querySelectorAll('#others li').length == 2", timeout=WAIT_MS)
    page.close()


def test_the_page_shows_its_address_as_a_qr_code_for_another_phone(browser, server_url, tmp_path):
    """The server here listens on loopback only, so its page says no phone can open it; the code a server on the
    station's Wi-Fi sends (asked for here with that Host) is shown and reads back as that address."""
    import cv2
    import httpx

    page = browser.new_page(viewport=PHONE)
    wait_ready(page, server_url)
    page.goto(server_url)
    page.click("#share summary")
    page.wait_for_function("document.querySelector('#share-text').textContent.includes('this computer only')",
                           timeout=WAIT_MS)
    assert page.locator("#share-code").is_hidden()

    station = "http://192.168.1.23:8080/"
    code = httpx.get(server_url + "address.png", headers={"Host": "192.168.1.23:8080"}).content
    page.route("**/address.png", lambda route: route.fulfill(status=200, content_type="image/png", body=code))
    page.reload()
    page.click("#share summary")
    shown = page.locator("#share-code")
    shown.wait_for(state="visible", timeout=WAIT_MS)
    assert "point the camera" in page.text_content("#share-text")
    shown.screenshot(path=str(tmp_path / "code.png"))
    assert qr_code_text(cv2.imread(str(tmp_path / "code.png"))) == station
    page.close()
