"""``mmrl serve-rewards CONFIG --port N``: serve reward functions over HTTP (JSON only, never pickle).

The config is a YAML file with a ``rewards:`` section in the training-config format (a training recipe works)::

    rewards:
      functions:
        - {name: pickscore, args: {device: cuda}}
        - {name: hpsv2, args: {checkpoint: /models/HPS_v2.1_compressed.pt}}

Each reward is built once and served under its name (weights and ``multi_reward`` are ignored here: the training
run's ``remote`` rewards carry them). The protocol is described in :mod:`mmrl.rewards.remote`.

Security: the server binds 127.0.0.1 unless told otherwise and has no authentication: bind another address only on
a trusted network (or behind an SSH tunnel). Requests are parsed with ``json`` and images decoded as PNG only;
nothing received is ever unpickled or evaluated. Bodies need a ``Content-Length`` of at most ``max_body_mb``.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import logging
import math
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from mmrl.config.schema import ConfigError
from mmrl.reward import RewardError, RewardInput, RewardScorer, build_reward
from mmrl.rewards.images import decode_png
from mmrl.rewards.remote import PROTOCOL

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_BODY_MB = 256.0
_DRAIN_BYTES = 1 << 20  # an oversized body up to this much larger is read and dropped before answering 413


class BadRequest(Exception):
    """A request the server cannot accept; answered with ``status`` and a one-line JSON error."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def build_rewards(config: dict[str, Any] | str | Path) -> dict[str, Callable[[RewardInput], Any]]:
    """Validate the ``rewards:`` section of ``config`` (a YAML path or a mapping) and build each reward once."""
    from mmrl.config import RewardsConfig, from_dict, read_yaml

    data = read_yaml(config) if isinstance(config, (str, Path)) else config
    if not isinstance(data, dict) or "rewards" not in data:
        raise ConfigError("rewards", None, "a 'rewards: {functions: [{name: ..., args: {...}}]}' section to serve")
    section = from_dict(RewardsConfig, data["rewards"], "rewards")
    names = [spec.name for spec in section.functions]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise ConfigError(f"rewards.functions[{index}].name", name,
                              "each reward once (a server serves every reward under its own name)")
    return {spec.name: build_reward(spec.name, spec.args) for spec in section.functions}


class RewardServer:
    """An HTTP server for reward functions.

    Args:
        rewards: ``{name: reward callable}`` (see :func:`build_rewards`).
        host: Address to bind; 127.0.0.1 (this machine only) by default.
        port: Port to bind; 0 picks a free one (see :attr:`port`).
        max_body_mb: Largest accepted request body, in MiB.
    """

    def __init__(self, rewards: dict[str, Callable[[RewardInput], Any]], host: str = DEFAULT_HOST,
                 port: int = DEFAULT_PORT, max_body_mb: float = DEFAULT_MAX_BODY_MB):
        if not rewards:
            raise ConfigError("rewards.functions", [], "at least one reward to serve")
        if not max_body_mb > 0:
            raise ConfigError("--max-body-mb", max_body_mb, "a number > 0")
        self.scorers = {name: RewardScorer([name], [fn], [1.0]) for name, fn in rewards.items()}
        self.locks = {name: threading.Lock() for name in rewards}
        self.max_body_bytes = int(max_body_mb * (1 << 20))
        handler = type("Handler", (_Handler,), {"server_state": self})
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as error:
            raise ConfigError("--port", port, f"a free port on {host} ({error.strerror or error})") from None
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def host(self) -> str:
        return str(self.httpd.server_address[0])

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def start(self) -> RewardServer:
        """Serve in a background thread (for tests and notebooks); stop with :meth:`close`."""
        self._thread = threading.Thread(target=self.serve_forever, name="mmrl-reward-server", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and release the port."""
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
            self._thread = None
        self.httpd.server_close()

    def __enter__(self) -> RewardServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ request handling

    def score(self, request: Any) -> dict[str, Any]:
        """Answer a decoded POST /score request (raises :class:`BadRequest`)."""
        if not isinstance(request, dict):
            raise BadRequest(400, "the request must be a JSON object")
        protocol = request.get("protocol", PROTOCOL)
        if protocol != PROTOCOL:
            raise BadRequest(400, f"protocol {protocol!r} is not supported; this server speaks protocol {PROTOCOL}")
        name = request.get("reward")
        if not isinstance(name, str) or name not in self.scorers:
            raise BadRequest(404, f"reward {name!r} is not served here; served: {sorted(self.scorers)}")
        batch = decode_batch(request)
        with self.locks[name]:
            try:
                column = self.scorers[name].raw_scores(batch)[:, 0]  # float64, exactly what the reward returned
            except (RewardError, ConfigError) as error:
                raise BadRequest(422, str(error)) from None
        return {"scores": [value if math.isfinite(value) else None for value in column.tolist()]}


def decode_batch(request: dict[str, Any]) -> RewardInput:
    """The :class:`RewardInput` of a score request; malformed parts raise :class:`BadRequest` (400)."""
    rows = request.get("rows")
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise BadRequest(400, "'rows' must be a list of JSON objects")
    n = len(rows)
    group_ids = request.get("group_ids", [0] * n)
    if not isinstance(group_ids, list) or len(group_ids) != n or not all(
            isinstance(g, int) and not isinstance(g, bool) for g in group_ids):
        raise BadRequest(400, f"'group_ids' must be a list of {n} integers")
    payload_in = request.get("payload", {})
    if not isinstance(payload_in, dict):
        raise BadRequest(400, "'payload' must be a JSON object")
    payload: dict[str, Any] = {}
    for key, entry in payload_in.items():
        if not isinstance(entry, dict) or len(entry) != 1 or next(iter(entry)) not in ("png", "json"):
            raise BadRequest(400, f"payload[{key!r}] must be {{'png': [base64, ...]}} or {{'json': value}}")
        if "json" in entry:
            payload[key] = entry["json"]
            continue
        items = entry["png"]
        if not isinstance(items, list) or len(items) != n or not all(isinstance(item, str) for item in items):
            raise BadRequest(400, f"payload[{key!r}]['png'] must be a list of {n} base64 strings")
        images = []
        for index, item in enumerate(items):
            try:
                data = base64.b64decode(item, validate=True)
            except (binascii.Error, ValueError):
                raise BadRequest(400, f"payload[{key!r}][{index}] is not base64") from None
            try:
                images.append(decode_png(data, f"payload[{key!r}][{index}]"))
            except RewardError as error:
                raise BadRequest(400, str(error)) from None
        same_size = len({tuple(image.shape) for image in images}) <= 1
        payload[key] = torch.stack(images) if images and same_size else images
    return RewardInput(rows=rows, payload=payload, group_ids=torch.tensor(group_ids, dtype=torch.long))


class _Handler(BaseHTTPRequestHandler):
    server_state: RewardServer
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are separate writes: without this, delayed ACKs cost ~40 ms
    timeout = 120  # seconds a connection may stay silent (slow or stalled clients)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 — the base class's name
        logger.debug("%s - %s", self.address_string(), format % args)

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status >= 400:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"error": message})

    def do_GET(self) -> None:  # noqa: N802 — http.server's naming
        state = self.server_state
        if self.path == "/health":
            self._send(200, {"status": "ok", "protocol": PROTOCOL, "rewards": sorted(state.scorers)})
        elif self.path == "/rewards":
            self._send(200, {"rewards": sorted(state.scorers)})
        else:
            self._error(404, f"no such endpoint {self.path!r}; endpoints: GET /health, GET /rewards, POST /score")

    def do_POST(self) -> None:  # noqa: N802
        state = self.server_state
        if self.path != "/score":
            self._error(404, f"no such endpoint {self.path!r}; endpoints: GET /health, GET /rewards, POST /score")
            return
        try:
            body = self._body(state.max_body_bytes)
            try:
                request = json.loads(body.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise BadRequest(400, "the request body is not JSON") from None
            answer = state.score(request)
        except BadRequest as error:
            self._error(error.status, str(error))
            return
        except Exception as error:  # a reward crashed: answer 500 and keep serving the other requests
            logger.exception("reward server: request failed")
            self._error(500, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            return
        self._send(200, answer)

    def _body(self, limit: int) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise BadRequest(411, "chunked bodies are not accepted; send a Content-Length")
        content_type = self.headers.get("Content-Type", "")
        if content_type.split(";")[0].strip().lower() != "application/json":
            raise BadRequest(415, f"Content-Type {content_type!r} is not accepted; send application/json")
        length_text = self.headers.get("Content-Length")
        if length_text is None:
            raise BadRequest(411, "a Content-Length header is required")
        try:
            length = int(length_text)
        except ValueError:
            raise BadRequest(400, f"Content-Length {length_text!r} is not a number") from None
        if length < 0:
            raise BadRequest(400, f"Content-Length {length} is negative")
        if length > limit:
            if length <= limit + _DRAIN_BYTES:
                self.rfile.read(length)  # read what was sent so that the client receives the answer, not a reset
            raise BadRequest(413, f"the body has {length} bytes; at most {limit} are accepted (--max-body-mb)")
        return self.rfile.read(length)

    def _not_allowed(self) -> None:
        self._error(405, f"method {self.command} is not allowed; endpoints: GET /health, GET /rewards, POST /score")

    do_PUT = do_DELETE = do_PATCH = _not_allowed  # noqa: N815


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(config: str | Path, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
          max_body_mb: float = DEFAULT_MAX_BODY_MB) -> int:
    """Build the rewards of ``config`` and serve them until interrupted (Ctrl-C or SIGTERM); returns 0."""
    server = RewardServer(build_rewards(config), host=host, port=port, max_body_mb=max_body_mb)
    if not _is_loopback(server.host):
        print(f"mmrl: warning: serving on {server.host}, reachable from other machines, without authentication",
              file=sys.stderr, flush=True)

    def _stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _stop) if threading.current_thread() is threading.main_thread() else None
    print(f"mmrl: serving rewards {', '.join(sorted(server.scorers))} on {server.url} "
          "(POST /score, GET /health, GET /rewards)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass  # a requested stop
    finally:
        server.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print("mmrl: reward server stopped", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mmrl.rewards.server CONFIG --port N``: the same as ``mmrl serve-rewards``."""
    from mmrl.cli import main as cli_main

    return cli_main(["serve-rewards", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
