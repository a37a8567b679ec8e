"""The ``remote`` reward: score samples with a reward served over HTTP by ``mmrl serve-rewards``.

Protocol (version 1, JSON only, never pickle)::

    POST /score   Content-Type: application/json
    {"protocol": 1, "reward": "pickscore",
     "rows": [{"prompt": "a cat"}, ...],                  # dataset rows (the fields the reward reads)
     "group_ids": [0, 0, 1, ...],
     "payload": {"images": {"png": ["<base64 PNG>", ...]},   # 8-bit RGB images, lossless
                 "completions": {"json": ["...", ...]}}}     # any other payload entry, as JSON
    → 200 {"scores": [0.81, null, ...]}                   # null = no score (NaN; rewards.on_nonfinite decides)
    → 4xx/5xx {"error": "one line"}

    GET /health   → {"status": "ok", "protocol": 1, "rewards": ["pickscore", ...]}
    GET /rewards  → {"rewards": ["pickscore", ...]}

Images are converted to 8-bit RGB exactly as local image rewards do (:mod:`mmrl.rewards.images`), so a remote
reward scores what the same reward would score in-process. Samples whose images have non-finite pixels are not
sent; they score NaN locally.

Each request is tried ``retries + 1`` times: connection failures, timeouts, HTTP 5xx/408/429 and unusable answers
(not JSON, wrong length, non-numbers) are retried after ``backoff · 2^k`` seconds; after the last failed attempt
the run stops with a :class:`~mmrl.reward.RewardError` naming the URL and the last error. Other 4xx answers (the
server could not score this request, e.g. a missing dataset field) stop at once with the server's message.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import time
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mmrl.reward import Reward, RewardError, RewardInput
from mmrl.rewards.images import encode_png, read_images

PROTOCOL = 1
MAX_RESPONSE_BYTES = 16 << 20
_RETRY_STATUS = frozenset({408, 429})


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

    def __init__(self, url: str = "http://127.0.0.1:8000", reward: str | None = None, images: str | None = "images",
                 outputs: list[str] | None = None, fields: list[str] | None = None, timeout: float = 60.0,
                 retries: int = 3, backoff: float = 1.0, check_server: bool = True):
        """Options (the config's ``args``).

        Args:
            url: Base URL of the server, e.g. http://gpu-box:8000.
            reward: Name of the reward on the server (null: the server must serve exactly one).
            images: Payload entry sent as PNG images (null: send no images).
            outputs: Other payload entries sent as JSON, e.g. [completions].
            fields: Dataset row fields sent (null: all; their values must be JSON data).
            timeout: Seconds to wait for one answer.
            retries: Retries after a failed attempt; the run stops after retries + 1 consecutive failures.
            backoff: Seconds before the first retry; doubles with each further retry.
            check_server: At start, check (with the same retries) that the server serves this reward.
        """
        if not url.startswith(("http://", "https://")):
            raise RewardError(f"reward 'remote': url {url!r} must start with http:// or https://")
        if not timeout > 0:
            raise RewardError(f"reward 'remote': timeout must be > 0 seconds, got {timeout!r}")
        if retries < 0 or backoff < 0:
            raise RewardError(f"reward 'remote': retries and backoff must be >= 0, got {retries!r} and {backoff!r}")
        self.url = url.rstrip("/")
        self.reward = reward
        self.images = images
        self.outputs = list(outputs or [])
        self.fields = None if fields is None else list(fields)
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        if check_server:
            served = self.served()
            self.reward = self._resolve(served)

    # ------------------------------------------------------------------------------------ server queries

    def served(self) -> list[str]:
        """Names of the rewards the server serves (GET /rewards, with retries)."""
        answer = self._with_retries("GET", "/rewards", None, self._parse_rewards)
        return answer

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
    def _parse_rewards(data: Any, expected: int) -> list[str]:
        names = data.get("rewards") if isinstance(data, dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise _Attempt("answer to GET /rewards has no list of reward names")
        return names

    # ------------------------------------------------------------------------------------ scoring

    def __call__(self, batch: RewardInput) -> Tensor:
        n = len(batch)
        scores = torch.full((n,), math.nan, dtype=torch.float64)
        if n == 0:
            return scores
        keep = list(range(n))
        payload: dict[str, Any] = {}
        if self.images is not None:
            images = read_images(batch, self.images, "remote")
            keep = images.finite.nonzero().flatten().tolist()
            payload[self.images] = {"png": [base64.b64encode(encode_png(images.images[i])).decode("ascii")
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
        body = json.dumps({"protocol": PROTOCOL, "reward": reward, "rows": rows,
                           "group_ids": [int(group_ids[i]) for i in keep], "payload": payload}).encode("utf-8")
        values = self._with_retries("POST", "/score", body, self._parse_scores, expected=len(keep))
        scores[keep] = torch.tensor(values, dtype=torch.float64)
        return scores

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
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.url + path, data=body, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310 — http(s) only
                raw = response.read(MAX_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as error:
            message = _error_message(error)
            final = 400 <= error.code < 500 and error.code not in _RETRY_STATUS
            raise _Attempt(f"HTTP {error.code}: {message}", final=final) from None
        except (OSError, http.client.HTTPException) as error:
            reason = getattr(error, "reason", None)
            cause = reason if isinstance(reason, BaseException) else error
            raise _Attempt(f"{type(cause).__name__}: {reason if reason is not None else error}") from None
        if len(raw) > MAX_RESPONSE_BYTES:
            raise _Attempt(f"answer is larger than {MAX_RESPONSE_BYTES} bytes")
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            shown = raw[:60].decode("utf-8", "replace")
            raise _Attempt(f"answer is not JSON (starts with {shown!r})") from None


def _error_message(error: urllib.error.HTTPError) -> str:
    try:
        data = json.loads(error.read(65536).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, http.client.HTTPException):
        return str(error.reason)
    if isinstance(data, dict) and isinstance(data.get("error"), str):
        return data["error"]
    return str(error.reason)
