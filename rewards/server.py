"""``mmrl serve-rewards CONFIG --port N``: serve reward functions over HTTP (JSON only, never pickle).

The config is a YAML file with a ``rewards:`` section in the training-config format (a training recipe works)::

    rewards:
      functions:
        - {name: pickscore, args: {device: cuda}}
        - {name: hpsv2, args: {checkpoint: /models/HPS_v2.1_compressed.pt}}

Each reward is served under its name (weights and ``multi_reward`` are ignored here: the training run's ``remote``
rewards carry them). A reward that reads the run's reward context (``iou``, ``giou``, ``detection``: the box
convention) is resolved against the context each request carries and built once per distinct set of options it
resolves to; every other reward is built once, at start-up (:mod:`mmrl.rewards.server_rewards`). The protocol is
described in :mod:`mmrl.rewards.remote`.

Security: the server binds 127.0.0.1 unless told otherwise. With a token (the environment variable
``MMRL_REWARD_TOKEN`` or ``--token-file``, never the command line) every request needs ``Authorization: Bearer
<token>`` (compared in constant time) or is answered 401; binding any other than a loopback address without a token
is refused. Requests are parsed with ``json`` and images decoded as PNG only; nothing received is ever unpickled or
evaluated. Every request is bounded before the expensive step it protects (:class:`ServerLimits`): its size and
arrival time before it is read, its JSON nesting and value count before it is parsed, its pixel count (from the PNG
headers) before any image is decoded, and the number of connections and of requests processed at once.

The server is the standard library's ``http.server``, hardened here rather than replaced by an ASGI stack: every
limit above has to be checked by this code anyway (a framework does not know the JSON or PNG budgets), the deadlines
for slow senders are enforced on the socket itself, and the server needs no dependency beyond mmrl's own.
"""

from __future__ import annotations

import dataclasses
import hmac
import io
import ipaddress
import json
import logging
import math
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from mmrl.config.schema import ConfigError
from mmrl.reward import RewardError, RewardInput, RewardScorer
from mmrl.rewards.remote import PROTOCOL, TOKEN_ENV, DeadlineReader, read_token
from mmrl.rewards.server_requests import BadRequest, check_json_shape, decode_batch, decode_context
from mmrl.rewards.server_rewards import ServedReward

__all__ = ["BadRequest", "RewardServer", "ServedReward", "ServerLimits", "build_rewards", "check_json_shape",
           "decode_batch", "serve", "server_token"]

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
MIN_TOKEN_CHARS = 16
_DRAIN_BYTES = 1 << 20  # a refused body up to this much over the size limit is read and dropped before answering
_LINGER_SECONDS = 1.0  # after an error answer, how long unread input is discarded before closing (see _Handler.finish)
_ENDPOINTS = "endpoints: GET /health, GET /rewards, POST /score"


@dataclass(frozen=True)
class ServerLimits:
    """What one request, and the server as a whole, may use; each field is the ``mmrl serve-rewards`` flag of the
    same name (``max_body_mb`` is ``--max-body-mb``).

    Args:
        max_body_mb: Largest request body, in MiB.
        max_megapixels: Pixels of all the images of one request together, in millions, read from the PNG headers
            before any image is decoded (a decoded pixel takes 3 bytes, more while a reward converts it).
        max_json_depth: Deepest nesting of JSON arrays and objects in a request, checked before parsing (``json``
            recurses once per level).
        max_json_values: Most JSON values (array elements and object members) in a request, checked before parsing:
            a 256 MiB body of ``{},{},...`` would otherwise parse into several GiB of Python objects.
        max_connections: Connections served at once, one thread each; a further connection is answered 503 and
            closed at once.
        max_concurrent_requests: ``POST /score`` requests read, decoded and scored at once (memory scales with it);
            a further one waits up to ``request_timeout`` for its turn, then is answered 503.
        idle_timeout: Seconds a connection may take to send a complete request line, from opening or from its
            previous answer; a silent or trickling one is closed. Also bounds sending each answer.
        request_timeout: Seconds in which the headers and the body of a request must arrive once its request line
            has (time waiting for a turn under ``max_concurrent_requests`` not counted); late bodies get 408.
    """

    max_body_mb: float = 256.0
    max_megapixels: float = 64.0
    max_json_depth: int = 32
    max_json_values: int = 1_000_000
    max_connections: int = 64
    max_concurrent_requests: int = 4
    idle_timeout: float = 15.0
    request_timeout: float = 60.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            flag = "--" + field.name.replace("_", "-")
            if field.type == "int":
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ConfigError(flag, value, "an integer >= 1")
            elif not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
                raise ConfigError(flag, value, "a number > 0")
        if self.max_json_depth > 512:
            raise ConfigError("--max-json-depth", self.max_json_depth,
                              "at most 512 (the JSON parser recurses once per level; Python's limit is 1000)")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * (1 << 20))

    @property
    def max_pixels(self) -> int:
        return int(self.max_megapixels * 1_000_000)


def build_rewards(config: dict[str, Any] | str | Path) -> dict[str, ServedReward]:
    """Validate the ``rewards:`` section of ``config`` (a YAML path or a mapping) and build each reward for the empty
    reward context, except those that need a request's context to resolve (see :class:`ServedReward`)."""
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
    return {spec.name: ServedReward(spec.name, spec.args) for spec in section.functions}


def server_token(token_file: str | Path | None = None, token_env: str | None = TOKEN_ENV) -> str | None:
    """The server's token from ``token_file``, else the environment variable ``token_env`` (None: no token).

    Raises:
        ConfigError: The file cannot be read or is empty, or the token is shorter than 16 characters or not
            printable ASCII without spaces. The token itself is never shown.
    """
    key = "--token-file" if token_file is not None else str(token_env)
    try:
        token = read_token(token_file, token_env)
    except ValueError as error:
        raise ConfigError(key, str(token_file) if token_file is not None else "(not shown)",
                          f"{_TOKEN_RULE} ({error})") from None
    _check_token(token, key)
    return token


_TOKEN_RULE = f"a token of at least {MIN_TOKEN_CHARS} printable ASCII characters without spaces"


def _check_token(token: str | None, key: str) -> None:
    if token is None:
        return
    if len(token) < MIN_TOKEN_CHARS or not all("!" <= character <= "~" for character in token):
        raise ConfigError(key, f"a token of {len(token)} characters (not shown)",
                          f"{_TOKEN_RULE}, e.g. from `python -c 'import secrets; print(secrets.token_urlsafe(32))'`")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RewardServer:
    """An HTTP server for reward functions.

    Args:
        rewards: ``{name: reward}``, each a :class:`ServedReward` (see :func:`build_rewards`) or a built reward
            callable, which scores every request whatever its reward context.
        host: Address to bind; 127.0.0.1 (this machine only) by default. Any non-loopback address (a host name,
            0.0.0.0, a LAN address) needs a ``token``.
        port: Port to bind; 0 picks a free one (see :attr:`port`).
        token: Shared secret every request must send as ``Authorization: Bearer <token>`` (None: no check, allowed
            on loopback addresses only). At least 16 printable ASCII characters.
        limits: Resource limits (see :class:`ServerLimits`; the defaults when None).
    """

    def __init__(self, rewards: dict[str, ServedReward | Callable[[RewardInput], Any]], host: str = DEFAULT_HOST,
                 port: int = DEFAULT_PORT, token: str | None = None, limits: ServerLimits | None = None):
        if not rewards:
            raise ConfigError("rewards.functions", [], "at least one reward to serve")
        self.limits = limits if limits is not None else ServerLimits()
        _check_token(token, "token")
        needs_token = ("a token (environment variable MMRL_REWARD_TOKEN or --token-file) to bind an address other "
                       "machines can reach, or a loopback address (127.0.0.1, ::1, localhost)")
        if token is None and not _is_loopback(host):
            raise ConfigError("--host", host, needs_token)
        self.token = token
        self.rewards = {name: reward if isinstance(reward, ServedReward) else ServedReward(name, function=reward)
                        for name, reward in rewards.items()}
        self.request_slots = threading.BoundedSemaphore(self.limits.max_concurrent_requests)
        handler = type("Handler", (_Handler,), {"server_state": self})
        try:
            self.httpd = _HTTPServer((host, port), handler, self.limits.max_connections)
        except OSError as error:
            raise ConfigError("--port", port, f"a free port on {host} ({error.strerror or error})") from None
        if token is None and not _is_loopback(self.host):  # "localhost" resolved to another address
            self.httpd.server_close()
            raise ConfigError("--host", f"{host} (bound to {self.host})", needs_token)
        self._thread: threading.Thread | None = None

    @property
    def served(self) -> list[str]:
        """The names of the rewards served, sorted."""
        return sorted(self.rewards)

    @property
    def reads_context(self) -> list[str]:
        """The names of the rewards that take options from a request's reward context, sorted."""
        return sorted(name for name, reward in self.rewards.items() if reward.reads_context)

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

    def authorized(self, header: str | None) -> None:
        """Check an ``Authorization`` header against the token (constant time); raises :class:`BadRequest` 401."""
        if self.token is None:
            return
        scheme, _, given = (header or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise BadRequest(401, "this server needs a token: send 'Authorization: Bearer <token>' (the remote "
                                  "reward sends the token of MMRL_REWARD_TOKEN or of its token_file option)")
        # Header values arrive decoded as latin-1, so this encoding gives back the bytes that were sent.
        if not hmac.compare_digest(given.strip().encode("latin-1"), self.token.encode("ascii")):
            raise BadRequest(401, "wrong token")

    @contextmanager
    def request_slot(self, reader: DeadlineReader) -> Iterator[None]:
        """Hold one of the ``max_concurrent_requests`` turns; the wait moves ``reader``'s deadline (the wait is not
        the client's slowness, and a refused client's body is still read within its own time)."""
        started = time.monotonic()
        acquired = self.request_slots.acquire(timeout=self.limits.request_timeout)
        reader.deadline += time.monotonic() - started
        if not acquired:
            raise BadRequest(503, f"the server is busy: all {self.limits.max_concurrent_requests} scoring turns are "
                                  "taken (--max-concurrent-requests); try again later")
        try:
            yield
        finally:
            self.request_slots.release()

    def answer(self, body: bytes) -> dict[str, Any]:
        """Answer the body of a POST /score request (raises :class:`BadRequest`)."""
        check_json_shape(body, self.limits.max_json_depth, self.limits.max_json_values)
        try:
            request = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as error:  # ValueError: also huge integer literals
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise BadRequest(400, f"the request body is not JSON: {reason}") from None
        return self.score(request)

    def score(self, request: Any) -> dict[str, Any]:
        """Answer a decoded POST /score request (raises :class:`BadRequest`)."""
        if not isinstance(request, dict):
            raise BadRequest(400, "the request must be a JSON object")
        protocol = request.get("protocol", PROTOCOL)
        if protocol != PROTOCOL:
            raise BadRequest(400, f"protocol {protocol!r} is not supported; this server speaks protocol {PROTOCOL}")
        name = request.get("reward")
        if not isinstance(name, str) or name not in self.rewards:
            raise BadRequest(404, f"reward {name!r} is not served here; served: {self.served}")
        reward = self.rewards[name]
        variant = reward.variant(decode_context(request))  # a refused context costs no image decoding
        batch = decode_batch(request, self.limits.max_pixels)
        with reward.lock:
            function = reward.instance(variant)
            if len(batch) == 0:  # the remote reward's start-up check: the reward is built for this context, unused
                return {"scores": []}
            try:
                column = RewardScorer([name], [function], [1.0]).raw_scores(batch)[:, 0]  # float64, as returned
            except (RewardError, ConfigError) as error:
                raise BadRequest(422, str(error)) from None
        return {"scores": [value if math.isfinite(value) else None for value in column.tolist()]}


# ---------------------------------------------------------------------------------------- HTTP


class _HTTPServer(ThreadingHTTPServer):
    """One thread per connection, at most ``max_connections`` at once; a further connection is answered 503."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, max_connections: int):
        self.max_connections = max_connections
        self.connection_slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.connection_slots.acquire(blocking=False):
            _refuse(request, self.max_connections)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self.connection_slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connection_slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that resets or times out is routine for a server; the base class prints a traceback to stderr.
        logger.debug("reward server: connection from %s ended with an error", client_address, exc_info=True)


def _refuse(request: socket.socket, max_connections: int) -> None:
    """Answer 503 on a connection over the limit, from the accepting thread, without waiting on the client."""
    body = json.dumps({"error": f"the server has {max_connections} connections open, its limit "
                                "(--max-connections); try again later"}).encode("utf-8")
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\nRetry-After: 1\r\n\r\n").encode("ascii")
    try:
        request.setblocking(False)  # a fresh socket's send buffer takes these few hundred bytes at once
        request.send(head + body)
    except OSError:
        pass  # the client is gone or not reading: closing is all that is left


class _Handler(BaseHTTPRequestHandler):
    server_state: RewardServer
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are separate writes: without this, delayed ACKs cost ~40 ms

    def setup(self) -> None:
        super().setup()
        limits = self.server_state.limits
        self.connection.settimeout(limits.idle_timeout)
        self._reader = DeadlineReader(self.connection, write_timeout=limits.idle_timeout)
        self.rfile.close()  # the base class's reader, replaced by one that keeps a total deadline
        self.rfile = io.BufferedReader(self._reader)
        self._linger = False

    def handle_one_request(self) -> None:
        self._reader.deadline = time.monotonic() + self.server_state.limits.idle_timeout  # for the request line
        super().handle_one_request()

    def parse_request(self) -> bool:
        self._reader.deadline = time.monotonic() + self.server_state.limits.request_timeout  # headers and body
        if not super().parse_request():
            return False
        length = self.headers.get("Content-Length", "")
        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        self._body_left = int(length) if length.isascii() and length.isdigit() and not chunked else 0
        return True

    def finish(self) -> None:
        """After an error answer, discard what the client still sends for a moment before closing: closing a socket
        with unread input resets the connection, and the reset can destroy the answer before the client reads it."""
        try:
            if self._linger:
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_WR)
                self._reader.deadline = time.monotonic() + _LINGER_SECONDS
                while self._reader.read(1 << 16):
                    pass
        except OSError:  # TimeoutError included: the client kept sending; close anyway
            pass
        finally:
            super().finish()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 — the base class's name
        logger.debug("%s - %s", self.address_string(), format % args)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (malformed request line, headers too long, unknown method) as JSON too."""
        self._error(code, message or self.responses.get(code, ("error",))[0])

    def _send(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        if not self._discard_body():
            self.close_connection = True  # the unread rest of a body would be taken for the next request
        data = json.dumps(body).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if status >= 400:
            self.send_header("Connection", "close")
            self.close_connection = True
            self._linger = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        self._send(status, {"error": message}, headers)

    def do_GET(self) -> None:  # noqa: N802 — http.server's naming
        state = self.server_state
        try:
            state.authorized(self.headers.get("Authorization"))
            if self.path == "/health":
                self._send(200, {"status": "ok", "protocol": PROTOCOL, "rewards": state.served,
                                 "reads_context": state.reads_context})
            elif self.path == "/rewards":
                self._send(200, {"rewards": state.served, "reads_context": state.reads_context})
            else:
                raise BadRequest(404, f"no such endpoint {self.path!r}; {_ENDPOINTS}")
        except BadRequest as error:
            self._error(error.status, str(error))

    def do_POST(self) -> None:  # noqa: N802
        state = self.server_state
        try:
            state.authorized(self.headers.get("Authorization"))
            if self.path != "/score":
                raise BadRequest(404, f"no such endpoint {self.path!r}; {_ENDPOINTS}")
            length = self._content_length(state.limits.max_body_bytes)
            with state.request_slot(self._reader):
                body = self._read_body(length)
                answer = state.answer(body)
        except BadRequest as error:
            self._error(error.status, str(error))
            return
        except Exception as error:  # a reward crashed: answer 500 and keep serving the other requests
            logger.exception("reward server: request failed")
            self._error(500, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            return
        self._send(200, answer)

    def _content_length(self, limit: int) -> int:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise BadRequest(411, "chunked bodies are not accepted; send a Content-Length")
        length_text = self.headers.get("Content-Length")
        if length_text is None:
            raise BadRequest(411, "a Content-Length header is required")
        if not (length_text.isascii() and length_text.isdigit()):
            raise BadRequest(400, f"Content-Length {length_text!r} is not a non-negative integer")
        length = int(length_text)
        content_type = self.headers.get("Content-Type", "")
        if content_type.split(";")[0].strip().lower() != "application/json":
            raise BadRequest(415, f"Content-Type {content_type!r} is not accepted; send application/json")
        if length > limit:
            raise BadRequest(413, f"the body has {length} bytes; at most {limit} are accepted (--max-body-mb)")
        return length

    def _read_body(self, length: int) -> bytes:
        try:
            body = self.rfile.read(length)
        except TimeoutError:
            self._body_left = 0  # nothing more is read from a client this slow
            raise BadRequest(408, f"the request did not arrive within {self.server_state.limits.request_timeout}s "
                                  "(--request-timeout)") from None
        except OSError as error:  # the client reset the connection: not a server fault to log as one
            self._body_left = 0
            raise BadRequest(400, f"the body could not be read ({type(error).__name__})") from None
        self._body_left = 0
        if len(body) < length:
            raise BadRequest(400, f"the body ended after {len(body)} of its {length} bytes")
        return body

    def _discard_body(self) -> bool:
        """Read and drop what is left of the request's body; False when it is too large to drop.

        The client sends its whole body before reading the answer, so a refusal (401, 413, 503...) sent without
        reading the body would reach it as a reset. Bodies up to ``max_body_mb`` + 1 MiB are dropped in small pieces
        (no memory), within the request's deadline.
        """
        left, self._body_left = getattr(self, "_body_left", 0), 0
        if left > self.server_state.limits.max_body_bytes + _DRAIN_BYTES:
            return False
        try:
            while left > 0:
                chunk = self.rfile.read(min(left, 1 << 16))
                if not chunk:
                    return False
                left -= len(chunk)
        except OSError:  # TimeoutError included: answer anyway, then close
            return False
        return True

    def _not_allowed(self) -> None:
        self._error(405, f"method {self.command} is not allowed; {_ENDPOINTS}")

    do_PUT = do_DELETE = do_PATCH = _not_allowed  # noqa: N815


def serve(config: str | Path, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, token: str | None = None,
          limits: ServerLimits | None = None) -> int:
    """Build the rewards of ``config`` and serve them until interrupted (Ctrl-C or SIGTERM); returns 0."""
    server = RewardServer(build_rewards(config), host=host, port=port, token=token, limits=limits)

    def _stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _stop) if threading.current_thread() is threading.main_thread() else None
    access = "token required" if token is not None else "no token: this machine only"
    print(f"mmrl: serving rewards {', '.join(server.served)} on {server.url} "
          f"(POST /score, GET /health, GET /rewards; {access})", flush=True)
    for name in server.served:
        if server.rewards[name].deferred is not None:
            print(f"mmrl: reward {name!r} is built for each request's reward context (for none: "
                  f"{server.rewards[name].deferred})", flush=True)
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
