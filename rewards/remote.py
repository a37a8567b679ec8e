"""The ``remote`` reward: score samples with a reward served over HTTP by ``mmrl serve-rewards``.

Protocol (version 1, JSON only, never pickle)::

    POST /score   Content-Type: application/json
    {"protocol": 1, "reward": "pickscore",
     "context": {"box_convention": "qwen2_vl"},           # the run's reward context (optional)
     "rows": [{"prompt": "a cat"}, ...],                  # dataset rows (the fields the reward reads)
     "group_ids": [0, 0, 1, ...],
     "payload": {"images": {"png": ["<base64 PNG>", ...]},   # 8-bit RGB images, lossless
                 "videos": {"png_frames": [["<base64 PNG>", ...], ...]},  # per video, its frames in order
                 "more_condition_images": {"png_sets": [["<base64 PNG>", ...], ...]},  # several images per sample
                 "completions": {"json": ["...", ...]}}}     # any other payload entry, as JSON
    → 200 {"scores": [0.81, null, ...]}                   # null = no score (NaN; rewards.on_nonfinite decides)
    → 4xx/5xx {"error": "one line"}

    GET /health   → {"status": "ok", "protocol": 1, "rewards": ["iou", "pickscore", ...], "reads_context": ["iou"]}
    GET /rewards  → {"rewards": ["iou", "pickscore", ...], "reads_context": ["iou"]}

**The reward context.** The client sends its run's reward context (:meth:`mmrl.plugin.Plugin.reward_context`, which
the training run hands it through :meth:`RemoteReward.resolve_args`) with every request, and the server resolves
the options of a reward that reads it (``reads_context``: those with a ``resolve_args`` hook, e.g. ``iou``) against
it, as the run would locally (:mod:`mmrl.rewards.server_rewards`): a reward configured there without a box
convention scores in the run's, one that names another convention is refused with 409. A request without
``context`` (a client older than the field) is resolved with no context. The client's start-up check sends a request
without rows but with the context when the reward reads it, so a refusal stops the run before training; a server
whose ``/rewards`` answer has no ``reads_context`` predates the field and would ignore the context, so a client with
a non-empty context refuses it at start-up.

Images are converted to 8-bit RGB exactly as local image rewards do (:mod:`mmrl.rewards.images`), so a remote
reward scores what the same reward would score in-process. Videos (``videos`` option, e.g. the flow plugin's
``payload["videos"]`` ``[N, 3, F, H, W]``) travel as one PNG per frame, converted the same way, and the server
hands them to its reward as a uint8 tensor ``[N, 3, F, H, W]`` (a list of ``[3, F, H, W]`` when sizes differ), the
layout :mod:`mmrl.rewards.videos` reads. An ``extra_images`` entry holding several images per sample (a tensor
``[N, K, C, H, W]``: the flow plugin's ``more_condition_images`` when prompt rows name several input images) travels
as ``png_sets``, K PNGs per sample, and the server hands it over as uint8 ``[N, K, 3, H, W]`` (a list of
``[K, 3, H, W]`` when sizes differ). Samples whose images or videos have non-finite pixels are not sent; they score
NaN locally.

A server started with a token (``MMRL_REWARD_TOKEN`` or ``--token-file``) answers 401 to every request without
``Authorization: Bearer <token>``; the client reads the same token from the environment variable ``token_env`` or
from ``token_file``, never from the config itself.

Each attempt has a total deadline of ``timeout`` seconds, from connecting to the last byte of the answer (a socket
timeout alone restarts with every byte, so a server trickling its answer could hold a client indefinitely). Each
request is tried ``retries + 1`` times: connection failures, missed deadlines, HTTP 5xx/408/429 and unusable
answers (not JSON, wrong length, non-numbers) are retried after ``backoff · 2^k`` seconds; after the last failed
attempt the run stops with a :class:`~mmrl.reward.RewardError` naming the URL and the last error. Other 4xx answers
(the server could not score this request, e.g. a missing dataset field, a missing token, a request over the
server's limits) stop at once with the server's message.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import math
import os
import socket
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import torch
from torch import Tensor

from mmrl.registry import Range
from mmrl.reward import Reward, RewardError, RewardInput, check_reward_context
from mmrl.rewards.images import encode_png, read_images
from mmrl.rewards.server_requests import context_problem, shown_json
from mmrl.rewards.videos import VideoBatch, read_videos

PROTOCOL = 1
MAX_RESPONSE_BYTES = 16 << 20
TOKEN_ENV = "MMRL_REWARD_TOKEN"  # where both `mmrl serve-rewards` and the client look for the token by default
_RETRY_STATUS = frozenset({408, 429})


def read_token(token_file: str | Path | None, token_env: str | None) -> str | None:
    """The shared secret: the content of ``token_file`` if given, else the environment variable ``token_env``.

    Args:
        token_file: A file holding the token (surrounding whitespace, e.g. the final newline, is ignored).
        token_env: An environment variable holding the token; unset or empty means no token.

    Returns:
        The token, or None when neither source has one.

    Raises:
        ValueError: One line naming the problem: an unreadable or empty file, or a token that is not printable ASCII
            without spaces (it travels in an HTTP header). The token itself is never shown.
    """
    if token_file is not None:
        source = f"token file {str(token_file)!r}"
        try:
            token = Path(token_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"{source} cannot be read ({type(error).__name__})") from None
        if not token:
            raise ValueError(f"{source} is empty")
    else:
        token = os.environ.get(token_env, "").strip() if token_env else ""
        if not token:
            return None
        source = f"environment variable {token_env}"
    if not all("!" <= character <= "~" for character in token):
        raise ValueError(f"the token in {source} is not printable ASCII without spaces (it is sent as an HTTP header)")
    return token


class DeadlineReader(io.RawIOBase):
    """Reads a socket under a total deadline (in ``time.monotonic()`` seconds; ``math.inf``: none).

    A socket timeout applies to each receive and restarts with every byte, so a peer sending one byte a second keeps
    a plain reader waiting indefinitely; here every receive waits at most until :attr:`deadline` (which the owner may
    move between reads) and then raises TimeoutError. When ``write_timeout`` is given, the socket's timeout is set
    back to it after each receive, so that writes on the same socket are not bound by a nearly spent deadline.
    ``on_close`` runs when the reader is closed.
    """

    def __init__(self, sock: socket.socket, deadline: float = math.inf, write_timeout: float | None = None,
                 on_close: Callable[[], None] | None = None):
        super().__init__()
        self.sock, self.deadline, self.write_timeout, self.on_close = sock, deadline, write_timeout, on_close

    def close(self) -> None:
        if not self.closed and self.on_close is not None:
            self.on_close()
        super().close()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("deadline passed")
        self.sock.settimeout(min(remaining, 1e6))  # math.inf is not a valid socket timeout
        try:
            return self.sock.recv_into(buffer)
        finally:
            if self.write_timeout is not None:
                self.sock.settimeout(self.write_timeout)


class _DeadlineSocket:
    """A connected socket for :class:`http.client.HTTPConnection` whose sends and receives share one deadline."""

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline = sock, deadline

    def sendall(self, data: bytes) -> None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("deadline passed")
        self.sock.settimeout(remaining)  # sendall's timeout bounds the whole call (Python >= 3.5)
        self.sock.sendall(data)

    def makefile(self, mode: str, *args: Any, **kwargs: Any) -> io.BufferedReader:  # http.client reads answers here
        # http.client closes the connection right after the headers of a "Connection: close" answer and reads the
        # body afterwards; a socket's own file object defers the real close until it is closed itself, so one is
        # held (and closed) with the reader.
        holder = self.sock.makefile("rb", buffering=0)
        return io.BufferedReader(DeadlineReader(self.sock, self.deadline, on_close=holder.close))

    def close(self) -> None:
        self.sock.close()


class _Attempt(Exception):
    """One failed attempt (retried); ``final`` marks failures that retrying cannot fix."""

    def __init__(self, message: str, final: bool = False):
        super().__init__(message)
        self.final = final


def to_json_value(value: Any, where: str) -> Any:
    """``value`` as plain JSON data (tensors and arrays become lists); a clear error names what is not JSON."""
    if isinstance(value, Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): to_json_value(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise RewardError(f"reward 'remote': {where} is a {type(value).__name__}, which cannot be sent as JSON; "
                      "leave it out with the reward's 'fields'/'outputs' options")


class RemoteReward(Reward):
    """Score with a reward served by ``mmrl serve-rewards`` over HTTP (images sent as PNG, JSON only).
    """

    @staticmethod
    def resolve_args(args: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
        """The ``resolve_args`` hook (see :func:`mmrl.reward.build_reward`): the run's reward context becomes the
        ``context`` option, which the server's rewards resolve their options against. The config may not set it."""
        if args.get("context") is not None:
            raise RewardError("option context is the training run's reward context (the plugin's reward_context()), "
                              "set by the run; remove it from the config")
        return {**args, "context": context}

    def __init__(self, url: str = "http://127.0.0.1:8000", reward: str | None = None, images: str | None = "images",
                 outputs: list[str] | None = None, fields: list[str] | None = None,
                 timeout: Annotated[float, Range(0, low_open=True)] = 60.0, retries: Annotated[int, Range(0)] = 3,
                 backoff: Annotated[float, Range(0)] = 1.0, check_server: bool = True,
                 token_env: str | None = TOKEN_ENV, token_file: str | None = None,
                 context: dict[str, Any] | None = None, videos: str | None = None,
                 extra_images: list[str] | None = None):
        """Options (the config's ``args``).

        Args:
            url: Base URL of the server, e.g. http://gpu-box:8000.
            reward: Name of the reward on the server (null: the server must serve exactly one).
            images: Payload entry sent as PNG images (null: send no images).
            outputs: Other payload entries sent as JSON, e.g. [completions].
            fields: Dataset row fields sent (null: all; their values must be JSON data).
            timeout: Seconds one attempt may take in all, from connecting to the answer's last byte.
            retries: Retries after a failed attempt; the run stops after retries + 1 consecutive failures.
            backoff: Seconds before the first retry; doubles with each further retry.
            check_server: At start, check (with the same retries) that the server serves this reward and accepts
                the run's reward context for it.
            token_env: Environment variable holding the server's token (unset or empty: send none).
            token_file: File holding the server's token (read instead of token_env).
            context: The run's reward context, sent with every request; set by the training run (the plugin's
                reward_context()), not in the config. None: none (``{}``).
            videos: Payload entry sent as videos, each frame a PNG (null: send no videos). A video run sets it to
                videos and images to null.
            extra_images: More payload entries sent as PNG images besides ``images``, e.g. [condition_images] for
                an edit judge that compares each edit with its input image (a sample with a non-finite pixel in
                any of them is not sent and scores NaN). An entry with several images per sample (``[N, K, C, H,
                W]``, e.g. more_condition_images) sends each sample's K images.
        """
        if not url.startswith(("http://", "https://")):
            raise RewardError(f"reward 'remote': url {url!r} must start with http:// or https://")
        parts = urllib.parse.urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if not parts.hostname or port == -1 or parts.query or parts.fragment or "@" in parts.netloc:
            raise RewardError(f"reward 'remote': url {url!r} must be http(s)://HOST[:PORT][/PATH] (no user, query "
                              "or fragment)")
        if not timeout > 0:
            raise RewardError(f"reward 'remote': timeout must be > 0 seconds, got {timeout!r}")
        if retries < 0 or backoff < 0:
            raise RewardError(f"reward 'remote': retries and backoff must be >= 0, got {retries!r} and {backoff!r}")
        self.url = url.rstrip("/")
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, port or (443 if self._https else 80)
        self._base_path = parts.path.rstrip("/")
        try:
            self._token = read_token(token_file, token_env)
        except ValueError as error:
            raise RewardError(f"reward 'remote': {error}") from None
        self.reward = reward
        self.images = images
        self.videos = videos
        self.extra_images = list(extra_images or [])
        clashes = [name for name in self.extra_images
                   if name in (images, videos) or name in (outputs or []) or self.extra_images.count(name) > 1]
        if clashes:
            raise RewardError(f"reward 'remote': extra_images names {clashes[0]!r} twice or also as images, videos "
                              "or outputs; each payload entry is sent once")
        self.outputs = list(outputs or [])
        self.fields = None if fields is None else list(fields)
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        try:
            self.context = check_reward_context(context)
        except RewardError as error:
            raise RewardError(f"reward 'remote': {error}") from None
        problem = context_problem(self.context)
        if problem is not None:
            raise RewardError(f"reward 'remote': the run's reward context {problem}, which the server would refuse")
        if check_server:
            served, reads_context = self._server_rewards()
            self.reward = self._resolve(served)
            self._check_context(reads_context)

    # ------------------------------------------------------------------------------------ server queries

    def served(self) -> list[str]:
        """Names of the rewards the server serves (GET /rewards, with retries)."""
        return self._server_rewards()[0]

    def _server_rewards(self) -> tuple[list[str], list[str] | None]:
        """The rewards served and those that read the reward context (None: a server older than the context)."""
        return self._with_retries("GET", "/rewards", None, self._parse_rewards)

    def _check_context(self, reads_context: list[str] | None) -> None:
        """Ask the server to resolve :attr:`reward` for this run's context (a score request without rows), so that
        a refusal (e.g. a box convention that differs from the run's) stops the run at start-up."""
        if reads_context is None:
            if self.context:
                raise RewardError(
                    f"reward 'remote': {self.url} does not read reward contexts (its mmrl predates them), so it would "
                    f"score {self.reward!r} without this run's {shown_json(self.context)}; update mmrl on the server, "
                    "or set check_server: false to score there anyway")
            return
        if self.reward in reads_context:
            self._with_retries("POST", "/score", self._score_body(self.reward, [], [], {}), self._parse_scores)

    def _resolve(self, served: list[str]) -> str:
        if self.reward is None:
            if len(served) != 1:
                raise RewardError(f"reward 'remote': {self.url} serves {served}; set this reward's args.reward to "
                                  "one of them")
            return served[0]
        if self.reward not in served:
            raise RewardError(f"reward 'remote': {self.url} does not serve {self.reward!r}; it serves {served}")
        return self.reward

    @staticmethod
    def _parse_rewards(data: Any, expected: int) -> tuple[list[str], list[str] | None]:
        names = data.get("rewards") if isinstance(data, dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise _Attempt("answer to GET /rewards has no list of reward names")
        reads_context = data.get("reads_context")
        if reads_context is not None and (not isinstance(reads_context, list)
                                          or not all(isinstance(n, str) for n in reads_context)):
            raise _Attempt("answer to GET /rewards has a 'reads_context' that is not a list of reward names")
        return names, reads_context

    # ------------------------------------------------------------------------------------ scoring

    def __call__(self, batch: RewardInput) -> Tensor:
        n = len(batch)
        scores = torch.full((n,), math.nan, dtype=torch.float64)
        if n == 0:
            return scores
        finite = torch.ones(n, dtype=torch.bool)
        payload: dict[str, Any] = {}
        images = videos = None
        if self.images is not None:
            images = read_images(batch, self.images, "remote")
            finite &= images.finite
        if self.videos is not None:
            videos = read_videos(batch, self.videos, "remote")
            finite &= videos.finite
        extra = {name: _read_extra(batch, name) for name in self.extra_images}
        for more in extra.values():
            finite &= more.finite
        keep = finite.nonzero().flatten().tolist()

        def png(image: Tensor) -> str:  # uint8 [3, H, W]
            return base64.b64encode(encode_png(image)).decode("ascii")

        if images is not None:
            payload[self.images] = {"png": [png(images.images[i]) for i in keep]}
        for name, more in extra.items():
            if isinstance(more, VideoBatch):  # several images per sample: each sample's K images, in order
                payload[name] = {"png_sets": [[png(image) for image in more.videos[i].unbind(1)] for i in keep]}
            else:
                payload[name] = {"png": [png(more.images[i]) for i in keep]}
        if videos is not None:
            payload[self.videos] = {"png_frames": [[png(frame) for frame in videos.videos[i].unbind(1)]
                                                   for i in keep]}
        if not keep:
            return scores
        for name in self.outputs:
            value = batch.output(name)
            if isinstance(value, (Tensor, np.ndarray, list, tuple)) and len(value) == n:
                value = [value[i] for i in keep]
            payload[name] = {"json": to_json_value(value, f"payload[{name!r}]")}
        rows = []
        for i in keep:
            row = batch.rows[i]
            if self.fields is not None:
                missing = [f for f in self.fields if f not in row]
                if missing:
                    raise RewardError(f"reward 'remote': dataset row {i} has no field {missing[0]!r} (fields "
                                      f"option: {self.fields})")
                row = {f: row[f] for f in self.fields}
            rows.append(to_json_value(dict(row), f"row {i}"))
        group_ids = batch.group_ids.tolist() if batch.group_ids.numel() else [0] * n
        reward = self.reward if self.reward is not None else self._resolve(self.served())
        body = self._score_body(reward, rows, [int(group_ids[i]) for i in keep], payload)
        values = self._with_retries("POST", "/score", body, self._parse_scores, expected=len(keep))
        scores[keep] = torch.tensor(values, dtype=torch.float64)
        return scores

    def _score_body(self, reward: str, rows: list[Any], group_ids: list[int], payload: dict[str, Any]) -> bytes:
        return json.dumps({"protocol": PROTOCOL, "reward": reward, "context": self.context, "rows": rows,
                           "group_ids": group_ids, "payload": payload}).encode("utf-8")

    @staticmethod
    def _parse_scores(data: Any, expected: int) -> list[float]:
        if not isinstance(data, dict) or "scores" not in data:
            raise _Attempt("answer has no 'scores' entry")
        values = data["scores"]
        if not isinstance(values, list):
            raise _Attempt(f"'scores' is a {type(values).__name__}, not a list")
        if len(values) != expected:
            raise _Attempt(f"answer has {len(values)} scores for {expected} samples")
        result = []
        for index, value in enumerate(values):
            if value is None:
                result.append(math.nan)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                result.append(float(value))
            else:
                raise _Attempt(f"score {index} is {value!r}, not a number or null")
        return result

    # ------------------------------------------------------------------------------------ HTTP

    def _with_retries(self, method: str, path: str, body: bytes | None, parse: Any, expected: int = 0) -> Any:
        attempts = self.retries + 1
        last = ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff * (2 ** (attempt - 1)))
            try:
                return parse(self._request(method, path, body), expected)
            except _Attempt as failure:
                last = str(failure)
                if failure.final:
                    raise RewardError(f"reward 'remote': {method} {self.url}{path} failed: {last}") from None
        raise RewardError(f"reward 'remote': {method} {self.url}{path} failed {attempts} times in a row (last error: "
                          f"{last}); check that `mmrl serve-rewards` runs there and answers within {self.timeout}s")

    def _request(self, method: str, path: str, body: bytes | None) -> Any:
        """One attempt: the decoded JSON answer; every failure raises :class:`_Attempt` (``final``: not retried)."""
        deadline = time.monotonic() + self.timeout
        headers = {"Accept": "application/json", "Connection": "close"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        connection_class = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        connection = connection_class(self._host, self._port, timeout=self.timeout)
        response = None
        try:
            connection.connect()  # the connect (and TLS handshake) timeout is `timeout` itself
            connection.sock = _DeadlineSocket(connection.sock, deadline)
            connection.request(method, self._base_path + path, body=body, headers=headers)
            response = connection.getresponse()
            raw = response.read(MAX_RESPONSE_BYTES + 1)
            status, reason = response.status, response.reason
        except TimeoutError:
            raise _Attempt(f"timed out: no complete answer within {self.timeout}s") from None
        except (OSError, http.client.HTTPException) as error:
            raise _Attempt(f"{type(error).__name__}: {error}") from None
        finally:
            if response is not None:
                response.close()
            connection.close()
        if len(raw) > MAX_RESPONSE_BYTES:
            raise _Attempt(f"answer is larger than {MAX_RESPONSE_BYTES} bytes")
        if not 200 <= status < 300:
            final = status < 500 and status not in _RETRY_STATUS
            raise _Attempt(f"HTTP {status}: {_error_message(raw, reason)}", final=final)
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            shown = raw[:60].decode("utf-8", "replace")
            raise _Attempt(f"answer is not JSON (starts with {shown!r})") from None


def _error_message(raw: bytes, reason: str) -> str:
    """The server's one-line ``{"error": ...}`` message, else the HTTP reason phrase."""
    try:
        data = json.loads(raw[:65536].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return reason
    if isinstance(data, dict) and isinstance(data.get("error"), str):
        return data["error"].splitlines()[0] if data["error"] else reason
    return reason


def _read_extra(batch: RewardInput, name: str) -> Any:
    """An ``extra_images`` entry as 8-bit images: an :class:`~mmrl.rewards.images.ImageBatch`, or for several images
    per sample (a tensor ``[N, K, C, H, W]``) a :class:`~mmrl.rewards.videos.VideoBatch` whose "frames" are each
    sample's K images (``[3, K, H, W]``), converted exactly as image rewards convert images."""
    value = batch.output(name)
    if isinstance(value, Tensor) and value.dim() == 5:
        sets = RewardInput(rows=batch.rows, payload={name: value.transpose(1, 2)}, group_ids=batch.group_ids)
        return read_videos(sets, name, "remote")
    return read_images(batch, name, "remote")
