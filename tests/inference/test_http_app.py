"""serve.py as users run it: a real server process on loopback (stopped by pid) over a trained DALLE and CLIP,
asked over HTTP. Images are byte for byte what the generate.py command they come with writes; requests arriving
together share batches and draw what they draw alone; bad requests get a 400 with one line and the server goes
on; 16 clients x 200 requests are all answered with the memory flat; headless Chromium (Debian's, through its
chromedriver) types a caption into the page and sees the images."""

import base64
import json
import os
import shutil
import socket
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import ROOT, ServerProcess

pytestmark = pytest.mark.e2e
SERVE = os.path.join(ROOT, "serve.py")
ARTIFACTS = os.environ.get("DALLE_TEST_ARTIFACTS", "")


class Server(ServerProcess):
    """python serve.py ARGS on a free loopback port, until stop()."""

    def __init__(self, *args, log):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
        self.log = log
        super().__init__([sys.executable, SERVE, *args, "--port", str(self.port)], log, self.url("/health"), env=env)

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"

    def get(self, path):
        with urllib.request.urlopen(self.url(path), timeout=30) as r:
            return r.status, r.read()

    def post(self, body, timeout=120):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url("/generate"), data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def rss_mb(self):
        for line in open(f"/proc/{self.proc.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def server(exports, tmp_path_factory):
    dalle, clip = exports
    log = tmp_path_factory.mktemp("server") / "serve.log"
    srv = Server("--dalle_path", dalle, "--clip_path", clip, "--max_batch", "16", "--max_wait", "0.2", log=log)
    yield srv
    srv.stop()


def png_bytes(b64):
    data = base64.b64decode(b64)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return data


def test_images_are_what_their_generate_py_command_writes(server, tmp_path, monkeypatch):
    import shlex

    import generate

    status, answer = server.post({"text": "a red circle", "num_images": 3, "seed": 11, "keep": 2})
    assert status == 200, answer
    assert len(answer["images"]) == 2 and answer["seed"] == 11 and set(answer["seeds"]) <= {11, 12, 13}
    assert answer["scores"] == sorted(answer["scores"], reverse=True)  # CLIP's best first
    for b64, command in zip(answer["images"], answer["commands"]):
        argv = shlex.split(command)
        assert argv[:2] == ["python", "generate.py"]
        folder = generate.main([*argv[2:], "--outputs_dir", str(tmp_path / argv[argv.index("--seed") + 1]), "--quiet"])
        assert open(os.path.join(folder[0], "0000.png"), "rb").read() == png_bytes(b64)


def test_requests_arriving_together_share_batches_and_draw_what_they_draw_alone(server):
    colours = "red blue green".split()
    bodies = [{"text": f"a {c} square", "num_images": 2, "seed": 100 + i} for i, c in enumerate(colours)]
    alone = [server.post(b)[1]["images"] for b in bodies]
    before = json.loads(server.get("/health")[1])["batches"]
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = [a["images"] for _, a in pool.map(server.post, bodies)]
    batches = json.loads(server.get("/health")[1])["batches"] - before
    assert together == alone
    assert batches < len(bodies), f"{len(bodies)} requests arriving together ran in {batches} batches"


@pytest.mark.parametrize(
    "body,says",
    [
        ({"text": ""}, '"text" must be a caption'),
        ({"text": "a" * 10000}, '"text" has 10000 characters, at most 1000: shorten it'),
        ({"text": "a red circle", "num_images": 17}, '"num_images" must be from 1 to 16 (got 17)'),
        ({"text": "a red circle", "colour": "red"}, "unknown field 'colour': the fields are text, num_images"),
        (b"a red circle", "the body is not JSON"),
        ({"text": "a red circle", "temperature": -1}, "temperature must be at least 0"),
        ({"text": "a red circle", "num_images": "four"}, '"num_images" must be an integer'),
        ({"text": "a red circle", "keep": 9, "num_images": 2}, '"keep" must be from 0 to "num_images" 2'),
    ],
    ids=["empty", "10000-chars", "too-many", "unknown-field", "not-json", "temperature", "not-a-number", "keep"],
)
def test_a_bad_request_is_a_400_with_one_line(server, body, says):
    status, answer = server.post(body)
    assert status == 400 and says in answer["error"] and "\n" not in answer["error"], answer
    assert server.post({"text": "a red circle", "num_images": 1})[0] == 200  # the server goes on


def test_clients_that_leave_mid_request_do_not_stop_the_others(server):
    body = json.dumps({"text": "a big circle", "num_images": 16}).encode()
    head = f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"

    def leave():  # send the request, then hang up before the answer
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(head.encode() + b"\r\n\r\n" + body)

    with ThreadPoolExecutor(8) as pool:
        left = [pool.submit(leave) for _ in range(4)]
        stayed = [pool.submit(server.post, {"text": "a small circle", "num_images": 1, "seed": i}) for i in range(4)]
        assert all(f.result()[0] == 200 for f in stayed)
        [f.result() for f in left]
    assert server.post({"text": "a small circle", "num_images": 1})[0] == 200
    assert "Traceback" not in open(server.log).read()


def test_sixteen_clients_two_hundred_requests_all_answered_memory_flat(server):
    def one(i):
        return server.post({"text": f"a shape number {i % 7}", "num_images": 1 + i % 2, "seed": i})[0]

    def round_of(n):
        with ThreadPoolExecutor(16) as pool:
            return list(pool.map(one, range(n)))

    assert set(round_of(48)) == {200}  # warm: the allocator's pools and the batch sizes seen once
    before = server.rss_mb()
    codes = round_of(200)
    after = server.rss_mb()
    assert codes.count(200) == 200, codes
    print(f"server RSS {before:.0f} MB before 200 requests, {after:.0f} MB after")
    assert after - before < 50, f"RSS grew {after - before:.0f} MB over 200 requests"


@pytest.mark.skipif(
    not shutil.which("chromium") or not shutil.which("chromedriver"),
    reason="needs Debian's chromium and chromium-driver (scripts/install_cluster.sh installs them)",
)
def test_the_page_in_headless_chromium(server, tmp_path):
    import io

    from PIL import Image
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,800"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        driver.get(server.url("/"))
        driver.find_element(By.ID, "text").send_keys("a small red circle above a large blue square")
        count = driver.find_element(By.ID, "num_images")
        count.clear()
        count.send_keys("4")
        driver.find_element(By.ID, "go").click()
        WebDriverWait(driver, 120).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#images img")) == 4)
        images = driver.find_elements(By.CSS_SELECTOR, "#images img")
        for img in images:
            src = img.get_attribute("src")
            assert src.startswith("data:image/png;base64,")
            assert Image.open(io.BytesIO(png_bytes(src.split(",", 1)[1]))).size == (16, 16)  # the model's size
        captions = [c.text for c in driver.find_elements(By.CSS_SELECTOR, "figcaption")]
        assert all("seed " in c and "CLIP " in c and "python generate.py" in c for c in captions), captions
        shot = os.path.join(ARTIFACTS or str(tmp_path), "serve-page.png")
        driver.save_screenshot(shot)
        assert Image.open(shot).size[0] > 0
    finally:
        driver.quit()
