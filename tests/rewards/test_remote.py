"""Remote scoring: server and client on localhost, retries, dead and garbage servers, what the server refuses."""

from __future__ import annotations

import base64
import http.client
import json
import os
import pickle
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import yaml

from mmrl.config import ConfigError
from mmrl.reward import RewardError, RewardInput, RewardScorer, build_reward
from mmrl.rewards.remote import RemoteReward
from mmrl.rewards.server import RewardServer, ServerLimits, build_rewards

from .conftest import random_images

ROOT = Path(__file__).resolve().parents[2]
FAST = {"timeout": 5.0, "retries": 2, "backoff": 0.01}


@pytest.fixture(scope="module")
def served(tiny_models):
    rewards_config = {"rewards": {"functions": [
        {"name": "jpeg_incompressibility"},
        {"name": "clip_score", "args": {"model": tiny_models.clip_config, "pretrained": tiny_models.clip_weights}},
        {"name": "pref_winrate", "args": {"judge_args": {"reward": "jpeg_incompressibility"}}},
        {"name": "exact_match"},
    ]}}
    rewards = build_rewards(rewards_config)
    server = RewardServer(rewards, port=0).start()
    yield server, rewards
    server.close()


def image_batch(n: int = 6, seed: int = 0) -> RewardInput:
    prompts = ["a cat", "a dog", "a red car"]
    return RewardInput(rows=[{"prompt": prompts[i % 3], "id": i} for i in range(n)],
                       payload={"images": random_images(n, seed=seed)}, group_ids=torch.arange(n) // 3)


def post(url: str, body: bytes, content_type: str = "application/json", headers: dict | None = None):
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.request("POST", "/score", body=body, headers={"Content-Type": content_type, **(headers or {})})
    response = connection.getresponse()
    data = response.read()
    connection.close()
    return response.status, json.loads(data)


# ------------------------------------------------------------------------------------------------ round trip


def test_server_binds_localhost_by_default(served):
    server, _ = served
    assert server.host == "127.0.0.1"
    with urlopen_json(server.url + "/health") as health:
        assert health["status"] == "ok"
        assert health["rewards"] == ["clip_score", "exact_match", "jpeg_incompressibility", "pref_winrate"]


class urlopen_json:  # noqa: N801 — a tiny context manager for GET requests
    def __init__(self, url: str):
        import urllib.request

        with urllib.request.urlopen(url, timeout=10) as response:
            self.data = json.loads(response.read())

    def __enter__(self):
        return self.data

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("name", ["jpeg_incompressibility", "clip_score", "pref_winrate"])
def test_round_trip_equals_local_scoring(served, name):
    server, rewards = served
    batch = image_batch(6)
    batch.payload["images"][4, 0, 0, 0] = float("nan")  # not sent; NaN locally as well
    remote = RemoteReward(url=server.url, reward=name, **FAST)
    local = RewardScorer([name], [rewards[name].instance_for()], [1.0], on_nonfinite="skip").score(batch)
    got = RewardScorer([name], [remote], [1.0], on_nonfinite="skip").score(batch)
    assert torch.equal(got.valid, local.valid) and got.valid.tolist() == [True] * 4 + [False, True]
    assert torch.equal(got.scores, local.scores)  # bitwise: the server scores exactly the 8-bit images
    raw, local_raw = remote(batch), RewardScorer([name], [rewards[name].instance_for()], [1.0]).raw_scores(batch)[:, 0]
    assert torch.isnan(raw[4]) and torch.isfinite(raw[[0, 1, 2, 3, 5]]).all()
    assert torch.equal(raw[[0, 1, 2, 3, 5]], local_raw[[0, 1, 2, 3, 5]])  # float64 survives JSON exactly


def test_round_trip_uint8_images_of_different_sizes(served):
    server, rewards = served
    images = [(random_images(1, size=s, seed=s)[0] * 255).round().to(torch.uint8) for s in (16, 24, 40)]
    batch = RewardInput(rows=[{"prompt": "a cat"}] * 3, payload={"images": images}, group_ids=torch.zeros(3))
    remote = RemoteReward(url=server.url, reward="clip_score", **FAST)
    assert torch.equal(remote(batch), rewards["clip_score"].instance_for()(batch))


def test_text_outputs_are_sent_as_json(served):
    server, rewards = served
    batch = RewardInput(rows=[{"solution": "4", "prompt": "2+2"}, {"solution": "5", "prompt": "2+2"}],
                        payload={"completions": ["4", "four"]}, group_ids=torch.tensor([0, 0]))
    remote = RemoteReward(url=server.url, reward="exact_match", images=None, outputs=["completions"],
                          fields=["solution"], **FAST)
    assert remote(batch).tolist() == [1.0, 0.0] == rewards["exact_match"].instance_for()(batch)


def test_client_checks_the_reward_is_served(served):
    server, _ = served
    with pytest.raises(RewardError, match=r"does not serve 'pickscore'; it serves \['clip_score', "):
        RemoteReward(url=server.url, reward="pickscore", **FAST)
    with pytest.raises(RewardError, match=r"serves .*; set this reward's args.reward to one of them"):
        RemoteReward(url=server.url, **FAST)


def test_client_errors_from_the_server_stop_without_retrying(served):
    server, _ = served
    remote = RemoteReward(url=server.url, reward="nope", check_server=False, **FAST)
    with pytest.raises(RewardError, match=r"failed: HTTP 404: reward 'nope' is not served here"):
        remote(image_batch(2))
    remote = RemoteReward(url=server.url, reward="exact_match", images=None, fields=["prompt"], **FAST)
    with pytest.raises(RewardError, match=r"failed: HTTP 422: reward 'exact_match': dataset rows \[0, 1\] have no "
                                          r"'solution' field"):
        remote(image_batch(2))


def test_values_that_are_not_json_are_refused_before_sending(served):
    server, _ = served
    remote = RemoteReward(url=server.url, reward="jpeg_incompressibility", **FAST)
    batch = image_batch(2)
    batch.rows[0]["thing"] = object()
    with pytest.raises(RewardError, match=r"row 0.thing is a object, which cannot be sent as JSON; leave it out"):
        remote(batch)
    with pytest.raises(RewardError, match=r"dataset row 0 has no field 'missing'"):
        RemoteReward(url=server.url, reward="jpeg_incompressibility", fields=["missing"], **FAST)(image_batch(2))


# ------------------------------------------------------------------------------------------------ failures


def test_server_killed_mid_run_fails_after_the_retries(tiny_models):
    server = RewardServer(build_rewards({"rewards": {"functions": [{"name": "jpeg_incompressibility"}]}}),
                          port=0).start()
    url = server.url
    remote = RemoteReward(url=url, retries=3, backoff=0.05, timeout=5.0)
    assert remote.reward == "jpeg_incompressibility"  # the only reward served
    batch = image_batch(3)
    assert torch.isfinite(remote(batch)).all()
    server.close()
    started = time.perf_counter()
    with pytest.raises(RewardError) as info:
        remote(batch)
    elapsed = time.perf_counter() - started
    text = str(info.value)
    assert "\n" not in text
    assert f"POST {url}/score failed 4 times in a row" in text and "ConnectionRefusedError" in text
    assert elapsed >= 0.05 + 0.1 + 0.2  # backoff 0.05 · 2^k before each of the 3 retries


class GarbageHandler(BaseHTTPRequestHandler):
    """Answers every POST with ``self.server.answers`` in turn (the last one repeats) and counts requests."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._reply(200, b'{"rewards": ["fake"]}')

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        server = self.server
        server.count += 1
        status, body = server.answers[min(server.count - 1, len(server.answers) - 1)]
        if status is None:  # die mid-request: drop the connection without an answer
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self._reply(status, body)

    def _reply(self, status, body):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def garbage_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), GarbageHandler)
    httpd.count = 0
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"<html>oops</html>", r"answer is not JSON \(starts with '<html>oops</html>'\)"),
        (b'{"scores": [1.0, 2.0]}', r"answer has 2 scores for 3 samples"),
        (b'{"scores": [1.0, "high", 2.0]}', r"score 1 is 'high', not a number or null"),
        (b'{"scores": [1.0, true, 2.0]}', r"score 1 is True, not a number or null"),
        (b'{"score": [1, 2, 3]}', r"answer has no 'scores' entry"),
        (b'{"scores": "1,2,3"}', r"'scores' is a str, not a list"),
        (b"\xff\xfe", r"answer is not JSON"),
    ],
)
def test_garbage_answers_fail_clearly_after_the_retries(garbage_server, body, message):
    garbage_server.answers = [(200, body)]
    url = f"http://127.0.0.1:{garbage_server.server_address[1]}"
    remote = RemoteReward(url=url, reward="fake", **FAST)
    with pytest.raises(RewardError, match=r"failed 3 times in a row \(last error: " + message):
        remote(image_batch(3))
    assert garbage_server.count == 3


def test_server_dying_mid_request_is_retried_then_fails_clearly(garbage_server):
    garbage_server.answers = [(None, b""), (200, b'{"scores": [1, 2, 3]}')]
    url = f"http://127.0.0.1:{garbage_server.server_address[1]}"
    assert RemoteReward(url=url, reward="fake", **FAST)(image_batch(3)).tolist() == [1.0, 2.0, 3.0]
    garbage_server.count = 0
    garbage_server.answers = [(None, b"")]
    with pytest.raises(RewardError, match=r"failed 3 times in a row \(last error: RemoteDisconnected"):
        RemoteReward(url=url, reward="fake", **FAST)(image_batch(3))
    assert garbage_server.count == 3


def test_transient_server_errors_are_retried(garbage_server):
    garbage_server.answers = [(500, b'{"error": "CUDA out of memory"}'), (503, b"busy"),
                              (200, b'{"scores": [0.5, null, 2]}')]
    url = f"http://127.0.0.1:{garbage_server.server_address[1]}"
    scores = RemoteReward(url=url, reward="fake", **FAST)(image_batch(3))
    assert garbage_server.count == 3
    assert scores[0] == 0.5 and torch.isnan(scores[1]) and scores[2] == 2.0
    garbage_server.count = 0
    garbage_server.answers = [(500, b'{"error": "CUDA out of memory"}')]
    with pytest.raises(RewardError, match=r"last error: HTTP 500: CUDA out of memory"):
        RemoteReward(url=url, reward="fake", **FAST)(image_batch(3))


def test_unreachable_server_at_start_is_a_clear_error():
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(RewardError, match=rf"GET http://127.0.0.1:{port}/rewards failed 3 times in a row"):
        RemoteReward(url=f"http://127.0.0.1:{port}", **FAST)
    with pytest.raises(RewardError, match=r"url 'localhost:8000' must start with http://"):
        RemoteReward(url="localhost:8000")


# ------------------------------------------------------------------------------------------------ server refusals


def _request_body(**overrides) -> dict:
    body = {"protocol": 1, "reward": "jpeg_incompressibility", "rows": [{"prompt": "x"}], "group_ids": [0],
            "payload": {"images": {"png": []}}}
    body.update(overrides)
    return body


def _png(side: int) -> str:
    """A base64 PNG of a black ``side`` x ``side`` RGB image."""
    from mmrl.rewards.images import encode_png

    return base64.b64encode(encode_png(torch.zeros(3, side, side, dtype=torch.uint8))).decode()


class Boom:
    """Unpickling this would create a folder: proof that nothing is unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_server_refuses_bad_requests_and_never_unpickles(served, tmp_path):
    server, _ = served
    url = server.url
    marker = tmp_path / "unpickled"
    evil = pickle.dumps(Boom(str(marker)))
    status, answer = post(url, evil, content_type="application/octet-stream")
    assert status == 415 and "application/json" in answer["error"]
    status, answer = post(url, evil)
    assert status == 400 and answer["error"].startswith("the request body is not JSON: ")
    png_field = {"images": {"png": [base64.b64encode(evil).decode()]}}
    status, answer = post(url, json.dumps(_request_body(payload=png_field)).encode())
    assert status == 400 and "is not a readable PNG image" in answer["error"]
    assert not marker.exists()
    for body, code, message in [
        (b"[1, 2]", 400, "must be a JSON object"),
        (json.dumps(_request_body(protocol=2)).encode(), 400, "protocol 2 is not supported"),
        (json.dumps(_request_body(rows="x")).encode(), 400, "'rows' must be a list of JSON objects"),
        (json.dumps(_request_body(group_ids=[0, 1])).encode(), 400, "'group_ids' must be a list of 1 integers"),
        (json.dumps(_request_body(payload={"images": {"pickle": "x"}})).encode(), 400, "must be {'png'"),
        (json.dumps(_request_body(payload={"images": {"png": ["***"]}})).encode(), 400, "is not base64"),
        (json.dumps(_request_body(payload={"images": {"png": []}})).encode(), 400, "list of 1 base64 strings"),
        (json.dumps(_request_body(payload={"more": {"png_sets": [[]]}})).encode(), 400,
         "['png_sets'] must be a list of 1 non-empty lists of base64 strings"),
        (json.dumps(_request_body(payload={"more": {"png_sets": [[_png(2), _png(3)]]}})).encode(), 400,
         "payload['more'] image set 0 has images of different sizes"),
    ]:
        status, answer = post(url, body)
        assert (status, message in answer["error"]) == (code, True), answer


def test_server_refuses_oversized_and_unsized_bodies():
    server = RewardServer(build_rewards({"rewards": {"functions": [{"name": "jpeg_incompressibility"}]}}),
                          port=0, limits=ServerLimits(max_body_mb=0.001)).start()
    try:
        status, answer = post(server.url, b"{" + b" " * 4000 + b"}")
        assert status == 413 and "at most 1048 are accepted" in answer["error"]
        host, port = server.host, server.port
        connection = http.client.HTTPConnection(host, port, timeout=10)
        connection.putrequest("POST", "/score")
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Transfer-Encoding", "chunked")
        connection.endheaders()
        connection.send(b"0\r\n\r\n")
        response = connection.getresponse()
        assert response.status == 411 and "chunked" in json.loads(response.read())["error"]
        connection.close()
        connection = http.client.HTTPConnection(host, port, timeout=10)
        connection.request("GET", "/nowhere")
        response = connection.getresponse()
        assert response.status == 404 and "endpoints" in json.loads(response.read())["error"]
        connection.close()
    finally:
        server.close()


def test_server_config_is_validated():
    with pytest.raises(ConfigError, match=r"config key 'rewards'.*a 'rewards: \{functions"):
        build_rewards({"run": {}})
    with pytest.raises(ConfigError, match=r"rewards\.functions\[1\]\.name.*each reward once"):
        build_rewards({"rewards": {"functions": [{"name": "exact_match"}, {"name": "exact_match"}]}})
    with pytest.raises(ConfigError, match=r"rewards\.functions\[0\]\.name.*one of"):
        build_rewards({"rewards": {"functions": [{"name": "nonexistent"}]}})


# ------------------------------------------------------------------------------------------------ CLI


def test_cli_serve_rewards_starts_answers_and_stops(tmp_path):
    config = tmp_path / "serve.yaml"
    # iou without a convention needs the run's: the server starts anyway and builds it per request context.
    config.write_text(yaml.safe_dump({"rewards": {"functions": [{"name": "jpeg_compressibility"}, {"name": "iou"}]}}))
    process = subprocess.Popen([sys.executable, "-m", "mmrl", "serve-rewards", str(config), "--port", "0"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("mmrl: serving rewards iou, jpeg_compressibility on http://127.0.0.1:"), (
            line + process.stderr.read() if process.poll() is not None else line)
        assert process.stdout.readline().startswith("mmrl: reward 'iou' is built for each request's reward context "
                                                    "(for none: no box convention: set the option convention")
        url = line.split(" on ")[1].split()[0]
        with urlopen_json(url + "/health") as health:
            assert health == {"status": "ok", "protocol": 1, "rewards": ["iou", "jpeg_compressibility"],
                              "reads_context": ["iou"]}
        remote = RemoteReward(url=url, reward="jpeg_compressibility", **FAST)
        batch = image_batch(2)
        assert torch.equal(remote(batch), build_reward("jpeg_compressibility", {})(batch))
    finally:
        process.terminate()
        out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert "reward server stopped" in out


def test_cli_serve_rewards_bad_config_is_one_line(tmp_path, capsys):
    from mmrl.cli import main

    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"rewards": {"functions": [{"name": "jpeg_compressibility",
                                                                 "args": {"qualty": 5}}]}}))
    assert main(["serve-rewards", str(config), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rewards.functions[0].args.qualty" in err
