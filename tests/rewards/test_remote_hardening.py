"""The remote reward client against broken peers and bad options: the token it sends, its total deadline.

Timing bounds are generous: a limit of about a second must act well within 10 s, where the unprotected code waited
for minutes (or forever) instead.
"""

from __future__ import annotations

import json
import socketserver
import threading
import time

import pytest

from mmrl.reward import RewardError
from mmrl.rewards.remote import RemoteReward, read_token

from .test_remote import image_batch

TOKEN = "test-token-0123456789abcdef"
GENEROUS = 10.0  # seconds within which a ~1 s limit must have acted


@pytest.fixture(autouse=True)
def no_token_in_environment(monkeypatch):
    monkeypatch.delenv("MMRL_REWARD_TOKEN", raising=False)


# ------------------------------------------------------------------------------------------------ token


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
