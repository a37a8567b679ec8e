"""The reward server and client against hostile or broken peers: tokens, request limits, slow senders, deadlines.

Timing bounds are generous: a limit of about a second must act well within 10 s, where the unprotected code waited
for minutes (or forever) instead.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
import zlib

import pytest
import torch
import yaml

import mmrl.rewards.server as server_module
import mmrl.rewards.server_requests as requests_module
from mmrl.config import ConfigError
from mmrl.reward import RewardError, RewardInput, build_reward
from mmrl.rewards.images import encode_png
from mmrl.rewards.remote import RemoteReward, read_token
from mmrl.rewards.server import RewardServer, ServerLimits, check_json_shape, server_token

from .test_remote import ROOT, image_batch

TOKEN = "test-token-0123456789abcdef"
FAST = {"timeout": 5.0, "retries": 1, "backoff": 0.01}
GENEROUS = 10.0  # seconds within which a ~1 s limit must have acted


@pytest.fixture(scope="module")
def rewards():
    return {"jpeg_incompressibility": build_reward("jpeg_incompressibility", {}),
            "exact_match": build_reward("exact_match", {})}


@pytest.fixture(autouse=True)
def no_token_in_environment(monkeypatch):
    monkeypatch.delenv("MMRL_REWARD_TOKEN", raising=False)


def start(rewards, token=None, host="127.0.0.1", **limits) -> RewardServer:
    return RewardServer(rewards, host=host, port=0, token=token, limits=ServerLimits(**limits)).start()


def request(server: RewardServer, method: str, path: str, body: bytes | None = None, token: str | None = None,
            content_type: str = "application/json") -> tuple[int, dict, dict]:
    """(status, headers, JSON answer) of one request to a running server."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=GENEROUS)
    headers = {"Content-Type": content_type}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    try:
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read())
    finally:
        connection.close()


def score_body(**overrides) -> bytes:
    body = {"protocol": 1, "reward": "exact_match", "rows": [{"solution": "4"}], "group_ids": [0],
            "payload": {"completions": {"json": ["4"]}}}
    body.update(overrides)
    return json.dumps(body).encode()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def blank_png(width: int, height: int, first_ihdr: tuple[int, int] | None = None, data: bool = True) -> bytes:
    """A black 8-bit RGB PNG, compressed row by row (a 6000x6000 one takes ~100 KB and no 108 MB buffer).

    ``first_ihdr`` puts an extra IHDR chunk of that size before the real one; ``data=False`` leaves out the image
    data (a header that only claims a size).
    """
    header = b"\x89PNG\r\n\x1a\n"
    ihdrs = [first_ihdr, (width, height)] if first_ihdr else [(width, height)]
    for w, h in ihdrs:
        header += png_chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    if not data:
        return header
    compressor, row = zlib.compressobj(), b"\x00" * (1 + 3 * width)  # filter byte 0, then the pixels
    idat = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    return header + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")


def png_request(*pngs: bytes) -> bytes:
    return json.dumps({"protocol": 1, "reward": "jpeg_incompressibility", "rows": [{}] * len(pngs),
                       "group_ids": [0] * len(pngs),
                       "payload": {"images": {"png": [base64.b64encode(p).decode() for p in pngs]}}}).encode()


@pytest.fixture
def decode_calls(monkeypatch):
    """Record every PNG decode of the server."""
    calls = []
    decode = requests_module.decode_png

    def recorded(data, where="image"):
        calls.append(where)
        return decode(data, where)

    monkeypatch.setattr(requests_module, "decode_png", recorded)
    return calls


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` (end of stream or reset) within ``seconds``; whatever it sends is read."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return True


# ------------------------------------------------------------------------------------------------ token


def test_token_is_required_on_every_endpoint(rewards, monkeypatch):
    compared = []
    compare = server_module.hmac.compare_digest
    monkeypatch.setattr(server_module.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or compare(a, b))
    with start(rewards, token=TOKEN) as server:
        endpoints = [("GET", "/health", None), ("GET", "/rewards", None), ("POST", "/score", score_body()),
                     ("GET", "/nowhere", None)]
        for method, path, body in endpoints:
            status, headers, answer = request(server, method, path, body)
            assert status == 401 and headers["WWW-Authenticate"] == "Bearer", (path, answer)
            assert answer["error"].startswith("this server needs a token: send 'Authorization: Bearer <token>'")
            status, _, answer = request(server, method, path, body, token=TOKEN[:-1] + "X")
            assert (status, answer) == (401, {"error": "wrong token"})
        assert compared == [(TOKEN[:-1].encode() + b"X", TOKEN.encode())] * 4  # constant-time comparison, each time
        assert request(server, "GET", "/health", token=TOKEN)[0] == 200
        assert request(server, "POST", "/score", score_body(), token=TOKEN)[2] == {"scores": [1.0]}


def test_client_sends_the_token_from_the_environment_or_a_file(rewards, monkeypatch, tmp_path):
    batch = RewardInput(rows=[{"solution": "4"}, {"solution": "5"}], payload={"completions": ["4", "4"]},
                        group_ids=torch.tensor([0, 0]))
    options = {"reward": "exact_match", "images": None, "outputs": ["completions"], **FAST}
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with start(rewards, token=TOKEN) as server:
        with pytest.raises(RewardError, match=r"GET .*/rewards failed: HTTP 401: this server needs a token"):
            RemoteReward(url=server.url, **options)  # not retried: "failed:", not "failed 2 times"
        assert RemoteReward(url=server.url, token_file=str(token_file), **options)(batch).tolist() == [1.0, 0.0]
        monkeypatch.setenv("MMRL_REWARD_TOKEN", TOKEN)
        assert RemoteReward(url=server.url, **options)(batch).tolist() == [1.0, 0.0]
        monkeypatch.setenv("OTHER_TOKEN", "wrong-" + TOKEN)
        remote = RemoteReward(url=server.url, token_env="OTHER_TOKEN", check_server=False, **options)
        big = RewardInput(rows=[{"solution": "4", "pad": "x" * (8 << 20)}], payload={"completions": ["4"]},
                          group_ids=torch.tensor([0]))
        with pytest.raises(RewardError, match=r"POST .*/score failed: HTTP 401: wrong token"):
            remote(big)  # an 8 MiB body: the server reads and drops it, so that the client gets the answer


def test_client_token_sources_and_url_checks(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n")
    monkeypatch.setenv("MMRL_REWARD_TOKEN", "env-" + TOKEN)
    assert read_token(token_file, "MMRL_REWARD_TOKEN") == TOKEN  # the file wins, surrounding whitespace dropped
    assert read_token(None, "MMRL_REWARD_TOKEN") == "env-" + TOKEN
    assert read_token(None, "UNSET_VARIABLE") is None and read_token(None, None) is None
    monkeypatch.setenv("MMRL_REWARD_TOKEN", "")
    assert read_token(None, "MMRL_REWARD_TOKEN") is None
    (tmp_path / "empty").write_text("\n")
    for path, message in [(tmp_path / "empty", "is empty"), (tmp_path / "missing", r"cannot be read \(FileNotFound")]:
        with pytest.raises(RewardError, match=rf"reward 'remote': token file .* {message}"):
            RemoteReward(token_file=str(path), check_server=False)
    monkeypatch.setenv("MMRL_REWARD_TOKEN", "has a space in the middle")
    with pytest.raises(RewardError, match=r"the token in environment variable MMRL_REWARD_TOKEN is not printable ASCII "
                                          r"without spaces") as info:
        RemoteReward(check_server=False)
    assert "has a space" not in str(info.value)  # the token is never shown
    for url in ["http://user:secret@gpu-box:8000", "http://gpu-box:port", "http://gpu-box:8000/?x=1", "http://:8000"]:
        with pytest.raises(RewardError, match=r"must be http\(s\)://HOST\[:PORT\]\[/PATH\]"):
            RemoteReward(url=url, check_server=False, token_env=None)


def test_server_token_sources_and_their_errors(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n")
    monkeypatch.setenv("MMRL_REWARD_TOKEN", "env-" + TOKEN)
    assert server_token(token_file) == TOKEN  # the file wins over the environment
    assert server_token() == "env-" + TOKEN
    assert server_token(token_env="UNSET_VARIABLE") is None
    monkeypatch.setenv("MMRL_REWARD_TOKEN", "")
    assert server_token() is None
    (tmp_path / "empty").write_text("\n")
    for path, message in [(tmp_path / "empty", "is empty"), (tmp_path / "missing", r"cannot be read \(FileNotFound")]:
        with pytest.raises(ConfigError, match=rf"config key '--token-file': .*; allowed: a token of at least 16 .*"
                                              rf"{message}"):
            server_token(path)
    for bad in ["short-secret", "has a space in the middle"]:
        monkeypatch.setenv("MMRL_REWARD_TOKEN", bad)
        with pytest.raises(ConfigError, match=r"config key 'MMRL_REWARD_TOKEN'.*at least 16 printable") as info:
            server_token()
        assert bad not in str(info.value) and "\n" not in str(info.value)  # the token is never shown


def test_non_loopback_bind_needs_a_token(rewards):
    for host in ["0.0.0.0", ""]:
        with pytest.raises(ConfigError, match=r"config key '--host'.*allowed: a token \(environment variable "
                                              r"MMRL_REWARD_TOKEN or --token-file\) to bind"):
            RewardServer(rewards, host=host, port=0)
    with pytest.raises(ConfigError, match=r"at least 16 printable ASCII"):
        RewardServer(rewards, host="0.0.0.0", port=0, token="short")
    with start(rewards, token=TOKEN, host="0.0.0.0") as server:  # all interfaces, this one included
        assert server.host == "0.0.0.0"
        assert request(server, "GET", "/health")[0] == 401
        assert request(server, "GET", "/health", token=TOKEN)[0] == 200


def test_cli_refuses_a_public_bind_without_a_token(tmp_path, capsys):
    from mmrl.cli import main

    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"rewards": {"functions": [{"name": "jpeg_compressibility"}]}}))
    assert main(["serve-rewards", str(config), "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mmrl: config key '--host': got '0.0.0.0'; allowed: a token")


def test_cli_serves_a_public_address_with_a_token_file(tmp_path):
    config, token_file = tmp_path / "serve.yaml", tmp_path / "token"
    config.write_text(yaml.safe_dump({"rewards": {"functions": [{"name": "jpeg_compressibility"}]}}))
    token_file.write_text(TOKEN)
    environment = {key: value for key, value in os.environ.items() if key != "MMRL_REWARD_TOKEN"}
    process = subprocess.Popen([sys.executable, "-m", "mmrl", "serve-rewards", str(config), "--port", "0",
                                "--host", "0.0.0.0", "--token-file", str(token_file)],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)
    try:
        line = process.stdout.readline()
        assert line.startswith("mmrl: serving rewards jpeg_compressibility on http://0.0.0.0:"), (
            line + process.stderr.read() if process.poll() is not None else line)
        assert line.rstrip().endswith("; token required)")
        url = "http://127.0.0.1:" + line.split(" on ")[1].split()[0].rsplit(":", 1)[1]
        with pytest.raises(RewardError, match=r"HTTP 401: this server needs a token"):
            RemoteReward(url=url, **FAST)
        batch = image_batch(2)
        remote = RemoteReward(url=url, token_file=str(token_file), **FAST)
        assert torch.equal(remote(batch), build_reward("jpeg_compressibility", {})(batch))
    finally:
        process.terminate()
        out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err


# ------------------------------------------------------------------------------------------------ JSON limits


@pytest.mark.parametrize(
    ("text", "depth", "values"),
    [
        (b'{"a": [1, 2], "b": {}}', 2, 5),  # document + members a, b + elements 1, 2; {} holds nothing
        (b'{"rows": [{"p": "[[[[{{"}]}', 3, 4),  # brackets inside strings are text
        (b'["a\\"[[[", [], [[]]]', 3, 5),  # an escaped quote does not end the string
        (b' [ ] ', 1, 1),
        (b'"just a string"', 0, 1),
        (b'[[["unterminated', 3, 4),  # invalid JSON: counted as far as the parser would read it
    ],
)
def test_json_shape_is_measured_before_parsing(text, depth, values):
    check_json_shape(text, max_depth=depth, max_values=values)  # exactly at both limits: accepted
    with pytest.raises(server_module.BadRequest, match=rf"holds {values} JSON values; at most {values - 1} are "
                                                       r"accepted \(--max-json-values\)") as info:
        check_json_shape(text, max_depth=depth, max_values=values - 1)
    assert info.value.status == 413
    if depth:
        with pytest.raises(server_module.BadRequest, match=rf"deeper than {depth - 1} levels \(--max-json-depth\)"):
            check_json_shape(text, max_depth=depth - 1, max_values=values)


def test_deep_json_and_huge_numbers_are_400_not_500(rewards):
    with start(rewards) as server:
        deep = b"[" * 200_000 + b"]" * 200_000
        status, _, answer = request(server, "POST", "/score", deep)
        assert (status, answer) == (400, {"error": "the request nests JSON arrays and objects deeper than 32 levels "
                                                   "(--max-json-depth)"})
        deep_row = score_body().replace(b'"solution": "4"', b'"solution": "4", "x": ' + b'{"a": ' * 100_000 + b"1"
                                        + b"}" * 100_000)
        assert request(server, "POST", "/score", deep_row)[0] == 400
        for group_id in [b"1e23", str(10**23).encode(), str(2**63).encode(), str(-(2**63) - 1).encode()]:
            status, _, answer = request(server, "POST", "/score", score_body().replace(b"[0]", b"[" + group_id + b"]"))
            assert (status, answer["error"]) == (400, "'group_ids' must be a list of 1 integers (each within the "
                                                      "64-bit range)"), group_id
        for group_id in [2**63 - 1, -(2**63)]:
            assert request(server, "POST", "/score", score_body(group_ids=[group_id]))[2] == {"scores": [1.0]}
        status, _, answer = request(server, "POST", "/score", score_body().replace(b"[0]", b"[" + b"7" * 5000 + b"]"))
        assert status == 400 and answer["error"].startswith("the request body is not JSON: Exceeds the limit")
        assert "\n" not in answer["error"]


def test_json_value_count_is_limited(rewards):
    with start(rewards, max_json_values=20) as server:
        assert request(server, "POST", "/score", score_body())[0] == 200  # 11 values
        status, _, answer = request(server, "POST", "/score", b"[" + b"{}," * 20 + b"{}]")
        assert (status, answer) == (413, {"error": "the request holds 22 JSON values; at most 20 are accepted "
                                                   "(--max-json-values)"})


# ------------------------------------------------------------------------------------------------ pixel budget


def test_blank_png_helper_makes_real_pngs():
    from mmrl.rewards.images import decode_png

    assert torch.equal(decode_png(blank_png(5, 3)), torch.zeros(3, 3, 5, dtype=torch.uint8))


def test_png_bomb_is_refused_from_its_header_before_decoding(rewards, decode_calls):
    with start(rewards) as server:  # default budget: 64 megapixels
        status, _, answer = request(server, "POST", "/score", png_request(blank_png(60_000, 60_000, data=False)))
        assert (status, answer) == (413, {"error": "the request's images have 3600000000 pixels in all; at most "
                                                   "64000000 are accepted (--max-megapixels); send fewer or smaller "
                                                   "images per request"})
        two = png_request(blank_png(6000, 6000), blank_png(6000, 6000))  # the 280 KB request
        assert len(two) < 300_000
        status, _, answer = request(server, "POST", "/score", two)
        assert status == 413 and "have 72000000 pixels in all; at most 64000000" in answer["error"]
        assert decode_calls == []


def test_pixel_budget_counts_all_images_of_a_request(rewards, decode_calls):
    image = encode_png(torch.zeros(3, 30, 30, dtype=torch.uint8))  # 900 pixels
    with start(rewards, max_megapixels=0.001) as server:  # 1000 pixels
        status, _, answer = request(server, "POST", "/score", png_request(image))
        assert status == 200 and len(answer["scores"]) == 1 and decode_calls == ["payload['images'][0]"]
        status, _, answer = request(server, "POST", "/score", png_request(image, image))
        assert status == 413 and "have 1800 pixels in all; at most 1000 are accepted" in answer["error"]
        assert decode_calls == ["payload['images'][0]"]  # nothing decoded for the refused request


def test_png_with_a_second_larger_header_is_refused_before_decoding(rewards, decode_calls):
    sneaky = blank_png(4, 3, first_ihdr=(1, 1))  # PIL would decode 4x3 after a budget check of 1x1
    with start(rewards) as server:
        status, _, answer = request(server, "POST", "/score", png_request(sneaky))
        assert (status, answer) == (400, {"error": "payload['images'][0] is not a readable PNG image (it declares "
                                                   "both 1x1 and 4x3)"})
        assert decode_calls == []


# ------------------------------------------------------------------------------------------------ connections


def test_connections_over_the_cap_get_503_at_once(rewards):
    with start(rewards, max_connections=2) as server:
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
        try:
            third = socket.create_connection(("127.0.0.1", server.port))
            third.settimeout(GENEROUS)
            answer = b""
            while chunk := third.recv(4096):
                answer += chunk
            third.close()
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503 ")
            assert json.loads(body) == {"error": "the server has 2 connections open, its limit (--max-connections); "
                                                 "try again later"}
        finally:
            idle[0].close()
        deadline = time.monotonic() + GENEROUS  # the freed slot is taken again once the server sees the close
        while health_status(server) != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        idle[1].close()


def health_status(server: RewardServer) -> int | None:
    """GET /health's status; None when a refused connection was reset before its 503 could be read."""
    try:
        return request(server, "GET", "/health")[0]
    except (OSError, http.client.HTTPException):
        return None


def test_scoring_requests_over_the_cap_wait_then_get_503(rewards):
    entered, release = threading.Event(), threading.Event()

    def blocking(batch):
        entered.set()
        release.wait(60)
        return [0.5] * len(batch)

    served = {"blocking": blocking, "exact_match": rewards["exact_match"]}
    with start(served, max_concurrent_requests=1, request_timeout=1.0) as server:
        first = {}
        worker = threading.Thread(target=lambda: first.update(answer=request(
            server, "POST", "/score", score_body(reward="blocking"))))
        worker.start()
        assert entered.wait(GENEROUS)
        status, _, answer = request(server, "POST", "/score", score_body())  # another reward, but no free turn
        assert (status, answer) == (503, {"error": "the server is busy: all 1 scoring turns are taken "
                                                   "(--max-concurrent-requests); try again later"})
        assert request(server, "GET", "/health")[0] == 200  # GETs need no turn
        release.set()
        worker.join(GENEROUS)
        assert first["answer"][0] == 200 and first["answer"][2] == {"scores": [0.5]}
        assert request(server, "POST", "/score", score_body())[2] == {"scores": [1.0]}


def test_silent_connection_is_closed_after_the_idle_timeout(rewards):
    with start(rewards, idle_timeout=0.5) as server:
        silent = socket.create_connection(("127.0.0.1", server.port))
        assert closed_within(silent, GENEROUS)
        silent.close()
        kept = socket.create_connection(("127.0.0.1", server.port))  # idle after an answered request: closed too
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert closed_within(kept, GENEROUS)
        kept.close()


def trickle(sock: socket.socket, data: bytes, interval: float) -> threading.Thread:
    """Send ``data`` one byte per ``interval`` seconds in a thread, until done or the server gives up."""

    def run():
        for byte in data:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                return
            time.sleep(interval)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("phase", ["request line", "headers"])
def test_trickled_request_head_is_cut_off(rewards, phase):
    with start(rewards, idle_timeout=1.0, request_timeout=1.0) as server:
        sock = socket.create_connection(("127.0.0.1", server.port))
        if phase == "headers":
            sock.sendall(b"GET /health HTTP/1.1\r\n")
        # 15 s in all, each byte well within any per-byte timeout
        trickle(sock, b"GET /" + b"a" * 300 if phase == "request line" else b"X-Slow: " + b"a" * 300, 0.05)
        started = time.monotonic()
        assert closed_within(sock, GENEROUS) and time.monotonic() - started < GENEROUS
        sock.close()


def test_trickled_body_gets_408(rewards):
    with start(rewards, request_timeout=1.0) as server:
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 300\r\n\r\n")
        trickle(sock, b" " * 300, 0.05)
        sock.settimeout(GENEROUS)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            chunk = sock.recv(4096)
            assert chunk, answer
            answer += chunk
        sock.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ")
        assert json.loads(body) == {"error": "the request did not arrive within 1.0s (--request-timeout)"}


# ------------------------------------------------------------------------------------------------ client deadline


class TricklingHandler(socketserver.StreamRequestHandler):
    """Reads a request, then answers 200 with a valid JSON body sent one byte per 0.5 s (30 s in all)."""

    def handle(self):
        self.server.count += 1
        length = 0
        while (line := self.rfile.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        self.rfile.read(length)
        body = json.dumps({"scores": [1.0] * 3, "padding": " " * 20}).encode()
        assert len(body) > 60
        try:
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n")
            for byte in body:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.5)
        except OSError:
            pass  # the client gave up


def test_client_deadline_is_total_not_per_read():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), TricklingHandler)
    server.daemon_threads, server.count = True, 0
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        remote = RemoteReward(url=url, reward="fake", timeout=1.0, retries=1, backoff=0.01, check_server=False)
        started = time.monotonic()
        with pytest.raises(RewardError, match=r"POST .*/score failed 2 times in a row \(last error: timed out: no "
                                              r"complete answer within 1.0s\)"):
            remote(image_batch(3))
        assert time.monotonic() - started < GENEROUS  # a per-read timeout would wait 30 s per attempt, then succeed
        assert server.count == 2
    finally:
        server.shutdown()
        server.server_close()


# ------------------------------------------------------------------------------------------------ CLI flags


def test_cli_limit_flags_reach_the_server_and_document_the_defaults(tmp_path, monkeypatch, capsys):
    import dataclasses

    from mmrl.cli import SERVE_LIMIT_FLAGS, main

    defaults = ServerLimits()
    for flag, kind, help_text in SERVE_LIMIT_FLAGS:
        value = getattr(defaults, flag[2:].replace("-", "_"))
        assert f"(default {value:g})" in help_text if isinstance(value, float) else f"(default {value})" in help_text

        assert kind is type(value), flag
    assert [f[0][2:].replace("-", "_") for f in SERVE_LIMIT_FLAGS] == [f.name for f in dataclasses.fields(defaults)]
    calls = []
    monkeypatch.setattr(server_module, "serve", lambda config, **kwargs: calls.append(kwargs) or 0)
    monkeypatch.setenv("MMRL_REWARD_TOKEN", TOKEN)
    config = str(tmp_path / "serve.yaml")
    assert main(["serve-rewards", config, "--max-megapixels", "0.5", "--max-connections", "3",
                 "--request-timeout", "7"]) == 0
    assert calls == [{"host": "127.0.0.1", "port": 8000, "token": TOKEN,
                      "limits": ServerLimits(max_megapixels=0.5, max_connections=3, request_timeout=7.0)}]
    for flag, value, allowed in [("--max-json-depth", "0", "an integer >= 1"), ("--idle-timeout", "-1", "a number > 0"),
                                 ("--max-json-depth", "600", "at most 512")]:
        assert main(["serve-rewards", config, flag, value]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"mmrl: config key '{flag}'") and allowed in err
