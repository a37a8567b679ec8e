"""The run's reward context over the remote path: the client sends it, the server resolves its rewards against it.

Every case runs a real server on loopback. The box numbers are issue 19's (tests/rewards/test_perception.py): a
perfect Qwen2-VL answer scores 1 read in the Qwen2-VL frame and about 0.1815 read as Qwen2.5-VL pixels.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mmrl.config import RewardsConfig, from_dict
from mmrl.reward import Reward, RewardError, RewardInput, RewardScorer, build_reward
from mmrl.rewards import reward_functions
from mmrl.rewards.remote import RemoteReward
from mmrl.rewards.server import RewardServer, ServedReward, build_rewards
from mmrl.rewards.server_requests import MAX_CONTEXT_CHARS, MAX_CONTEXT_DEPTH, context_problem

from .test_perception import QWEN2_VL_ANSWER, issue_batch, qwen2_5_vl_reading_of_the_issue_answer
from .test_remote import post, urlopen_json

FAST = {"timeout": 5.0, "retries": 2, "backoff": 0.01}
TEXT = {"images": None, "outputs": ["completions"], **FAST}  # the box rewards read completions, not images
QWEN2 = {"box_convention": "qwen2_vl"}
QWEN25 = {"box_convention": "qwen2_5_vl"}
QWEN25_ANSWER = '<answer>{"bbox_2d": [64.4, 47.6, 322, 238]}</answer>'  # the same box in the 644x476 input's pixels


def serve(functions: list[dict]) -> RewardServer:
    return RewardServer(build_rewards({"rewards": {"functions": functions}}), port=0).start()


@pytest.fixture
def box_server():
    server = serve([{"name": "iou"}, {"name": "giou", "args": {"convention": "qwen2_5_vl"}}, {"name": "exact_match"}])
    yield server
    server.close()


def score_body(reward: str, rows: list[dict], completions: list[str], **extra) -> bytes:
    """A POST /score body as an old client sends it (no context unless ``extra`` has one)."""
    return json.dumps({"protocol": 1, "reward": reward, "rows": rows, "group_ids": [0] * len(rows),
                       "payload": {"completions": {"json": completions}}, **extra}).encode()


def issue_rows() -> list[dict]:
    return [dict(row, image_size=list(row["image_size"]), resized_size=list(row["resized_size"]))
            for row in issue_batch(QWEN2_VL_ANSWER).rows]


# ------------------------------------------------------------------------------------------------ resolution


def test_server_reward_without_convention_scores_in_each_runs_convention(box_server):
    served = box_server.rewards["iou"]
    assert served.builds == 0 and "no box convention" in served.deferred  # started without building iou
    with urlopen_json(box_server.url + "/rewards") as answer:
        assert answer == {"rewards": ["exact_match", "giou", "iou"], "reads_context": ["giou", "iou"]}
    qwen2 = RemoteReward(url=box_server.url, reward="iou", context=QWEN2, **TEXT)
    assert served.builds == 1  # the client's start-up check built the run's variant
    qwen25 = RemoteReward(url=box_server.url, reward="iou", context=QWEN25, **TEXT)
    assert served.builds == 2
    reading = qwen2_5_vl_reading_of_the_issue_answer()  # ≈ 0.1815, from the hand formula
    for _ in range(2):  # interleaved runs keep their own frames
        assert qwen2(issue_batch(QWEN2_VL_ANSWER)).tolist() == [pytest.approx(1.0)]
        assert qwen25(issue_batch(QWEN2_VL_ANSWER)).tolist() == [pytest.approx(reading)]
        assert qwen25(issue_batch(QWEN25_ANSWER)).tolist() == [pytest.approx(1.0)]
    for context in (QWEN2, QWEN25):  # exactly what the reward scores in the run's own process
        local = build_reward("iou", {}, context=context)(issue_batch(QWEN2_VL_ANSWER))
        remote = RemoteReward(url=box_server.url, reward="iou", context=context, **TEXT)
        assert remote(issue_batch(QWEN2_VL_ANSWER)).tolist() == local
    # The context travels with every request, not only with the start-up check; a context with more facts that
    # resolves to the same options shares the instance.
    unchecked = RemoteReward(url=box_server.url, reward="iou", context={**QWEN2, "other_fact": [1, 2]},
                             check_server=False, **TEXT)
    assert unchecked(issue_batch(QWEN2_VL_ANSWER)).tolist() == [pytest.approx(1.0)]
    assert served.builds == 2


def test_named_convention_that_differs_stops_the_client_at_start_up(box_server):
    with pytest.raises(RewardError) as caught:
        RemoteReward(url=box_server.url, reward="giou", context=QWEN2, **TEXT)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"reward 'remote': POST {box_server.url}/score failed: HTTP 409: reward 'giou' of this "
                              "server's config refuses the request's reward context {\"box_convention\": "
                              "\"qwen2_vl\"}: option convention 'qwen2_5_vl' differs from 'qwen2_vl'"), message
    assert "allow_convention_mismatch" in message  # not retried: "failed:", not "failed 3 times"
    unchecked = RemoteReward(url=box_server.url, reward="giou", context=QWEN2, check_server=False, **TEXT)
    with pytest.raises(RewardError, match=r"HTTP 409: reward 'giou' of this server's config refuses"):
        unchecked(issue_batch(QWEN25_ANSWER))
    # The run that agrees scores; so does an old client, which sends no context: the named convention applies.
    agreeing = RemoteReward(url=box_server.url, reward="giou", context=QWEN25, **TEXT)
    assert agreeing(issue_batch(QWEN25_ANSWER)).tolist() == [pytest.approx(1.0)]
    status, answer = post(box_server.url, score_body("giou", issue_rows(), [QWEN25_ANSWER]))
    assert (status, answer["scores"]) == (200, [pytest.approx(1.0)])
    assert box_server.rewards["giou"].builds == 1  # built at start-up; every accepted context resolves to it


def test_allow_convention_mismatch_on_the_server():
    server = serve([{"name": "iou", "args": {"convention": "qwen2_5_vl", "allow_convention_mismatch": True}}])
    try:
        remote = RemoteReward(url=server.url, context=QWEN2, **TEXT)  # accepted: read as Qwen2.5-VL pixels
        reading = qwen2_5_vl_reading_of_the_issue_answer()
        assert remote(issue_batch(QWEN2_VL_ANSWER)).tolist() == [pytest.approx(reading)]
    finally:
        server.close()


def test_no_convention_and_no_context_is_an_error_naming_what_is_missing(box_server):
    status, answer = post(box_server.url, score_body("iou", issue_rows(), [QWEN2_VL_ANSWER]))  # an old client
    assert status == 409
    assert answer["error"].startswith("reward 'iou' of this server's config needs the run's reward context, and the "
                                      "request carries none (its 'context' field"), answer
    assert "no box convention: set the option convention" in answer["error"]
    status, answer = post(box_server.url, score_body("iou", issue_rows(), [QWEN2_VL_ANSWER], context=None))
    assert status == 409 and "carries none" in answer["error"]
    with pytest.raises(RewardError, match=r"HTTP 409: reward 'iou' of this server's config refuses the request's "
                                          r"reward context \{\}: no box convention"):
        RemoteReward(url=box_server.url, reward="iou", **TEXT)  # outside a run: the context is empty
    assert box_server.rewards["iou"].builds == 0


def test_rewards_that_do_not_read_the_context_ignore_it(box_server):
    remote = RemoteReward(url=box_server.url, reward="exact_match", fields=["solution"], context=QWEN2, **TEXT)
    batch = RewardInput(rows=[{"solution": "4"}, {"solution": "5"}], payload={"completions": ["4", "4"]})
    assert remote(batch).tolist() == [1.0, 0.0]
    status, answer = post(box_server.url, score_body("exact_match", [{"solution": "4"}], ["4"]))  # an old client
    assert (status, answer) == (200, {"scores": [1.0]})


# ------------------------------------------------------------------------------------------------ validation


def nested(depth: int) -> dict:
    """A context whose objects nest ``depth`` levels (the context itself is level 1)."""
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def test_context_bounds():
    assert context_problem(nested(MAX_CONTEXT_DEPTH)) is None
    assert "deeper than 4 levels" in context_problem(nested(MAX_CONTEXT_DEPTH + 1))
    assert "deeper than 4 levels" in context_problem({"a": [[[[]]]]})  # arrays count as levels too
    # '{"a":"' + k characters + '"}' is k + 8 characters of canonical JSON.
    assert context_problem({"a": "x" * (MAX_CONTEXT_CHARS - 8)}) is None
    assert context_problem({"a": "x" * (MAX_CONTEXT_CHARS - 7)}) == "has 4097 characters as JSON, more than 4096"
    assert context_problem(["qwen2_vl"]) == "is a list, not a JSON object"
    assert context_problem({"a": {1: "x"}}) == "has a key that is not a string"


@pytest.mark.parametrize(("context", "problem"), [
    (["qwen2_vl"], "is a list, not a JSON object"),
    ("qwen2_vl", "is a str, not a JSON object"),
    (nested(MAX_CONTEXT_DEPTH + 1), "nests objects or arrays deeper than 4 levels"),
    ({"a": "x" * MAX_CONTEXT_CHARS}, "has 4104 characters as JSON, more than 4096"),
])
def test_bad_contexts_are_refused_by_server_and_client(box_server, context, problem):
    status, answer = post(box_server.url, score_body("exact_match", [{"solution": "4"}], ["4"], context=context))
    assert status == 400
    assert answer["error"] == (f"'context' (the run's reward context) {problem}; it must be a JSON object with string "
                               "keys, at most 4 levels deep and 4096 characters")
    with pytest.raises(RewardError, match=r"^reward 'remote': (a reward context must be a dict|the run's reward "
                                          r"context " + problem + ")"):
        RemoteReward(url=box_server.url, reward="exact_match", context=context, check_server=False, **TEXT)
    good = score_body("exact_match", [{"solution": "4"}], ["4"], context=nested(MAX_CONTEXT_DEPTH))
    assert post(box_server.url, good) == (200, {"scores": [1.0]})


def test_the_config_cannot_set_the_context_and_the_run_hands_it_over(box_server):
    args = {"url": box_server.url, "reward": "iou", **TEXT}
    config = from_dict(RewardsConfig, {"functions": [{"name": "remote", "args": args}]}, "rewards")
    scorer = RewardScorer.from_config(config, context=QWEN2)  # what the trainer does with plugin.reward_context()
    assert scorer.functions[0].context == QWEN2
    assert scorer.raw_scores(issue_batch(QWEN2_VL_ANSWER)).tolist() == [[pytest.approx(1.0)]]
    config = from_dict(RewardsConfig, {"functions": [{"name": "remote", "args": {**args, "context": QWEN25}}]},
                       "rewards")
    with pytest.raises(RewardError, match=r"^reward 'remote': option context is the training run's reward context"):
        RewardScorer.from_config(config, context=QWEN2)


# ------------------------------------------------------------------------------------------------ old servers


class OldServer(BaseHTTPRequestHandler):
    """A server older than the context: its GET /rewards has no reads_context; it records each POST body."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._reply({"rewards": ["iou"]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        self._reply({"scores": [0.5] * len(body["rows"])})

    def _reply(self, answer):
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def old_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), OldServer)
    httpd.bodies = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_server_older_than_the_context_is_refused_when_there_is_one(old_server):
    httpd, url = old_server
    with pytest.raises(RewardError, match=rf"^reward 'remote': {url} does not read reward contexts \(its mmrl "
                                          r"predates them\), so it would score 'iou' without this run's "
                                          r"\{\"box_convention\": \"qwen2_vl\"\}; update mmrl on the server"):
        RemoteReward(url=url, context=QWEN2, **TEXT)
    assert httpd.bodies == []  # refused before any score request
    remote = RemoteReward(url=url, **TEXT)  # no context to lose: the old server is fine (no check request either)
    assert httpd.bodies == []
    assert remote(issue_batch(QWEN2_VL_ANSWER)).tolist() == [0.5]
    forced = RemoteReward(url=url, context=QWEN2, check_server=False, **TEXT)
    forced(issue_batch(QWEN2_VL_ANSWER))
    assert [body["context"] for body in httpd.bodies] == [{}, QWEN2]  # sent with every request


# ------------------------------------------------------------------------------------------------ variants


class Offset(Reward):
    """Scores every sample ``offset``, which it reads from the run's context; counts its instances and calls."""

    instances = 0
    calls = 0

    @staticmethod
    def resolve_args(args, context):
        return {**args, "offset": context.get("offset", args.get("offset", 0.0))}

    def __init__(self, offset: float = 0.0):
        """Args:
            offset: The score.
        """
        if offset < 0:
            raise ValueError(f"offset {offset} < 0 cannot be loaded")
        type(self).instances += 1
        self.offset = offset

    def __call__(self, batch):
        type(self).calls += 1
        return [self.offset] * len(batch)


reward_functions.register("test_remote_context_offset", Offset)


def test_variants_are_shared_by_equal_options_and_bounded():
    Offset.instances = Offset.calls = 0
    served = ServedReward("test_remote_context_offset", {}, max_variants=2)  # built at start-up for offset 0
    server = RewardServer({"test_remote_context_offset": served}, port=0).start()
    try:
        batch = RewardInput(rows=[{"prompt": "a"}, {"prompt": "b"}], payload={})
        options = {"images": None, **FAST}

        def score(context):
            return RemoteReward(url=server.url, context=context, **options)(batch).tolist()

        built = []
        for context in ({"offset": 1.0}, {}, {"offset": 0.0, "unrelated": "x"}, {"offset": 2.0}, {"offset": 1.0},
                        {"offset": 2.0}, {"offset": 1.0, "unrelated": "y"}):
            assert score(context) == [context.get("offset", 0.0)] * 2
            built.append(Offset.instances)
        # Kept (least recently used first): [0] → [0, 1] → [1, 0] → [1, 0] → [0, 2] (1 dropped) → [2, 1] (rebuilt,
        # 0 dropped) → [1, 2] → [2, 1].
        assert built == [2, 2, 2, 3, 4, 4, 4]
        assert served.builds == 4 and len(served._variants) == 2
        assert Offset.calls == 7  # the start-up checks (requests without rows) never call the reward
        with pytest.raises(RewardError, match=r"failed 1 times in a row \(last error: HTTP 500: reward "
                                              r"'test_remote_context_offset' could not be built with the options "
                                              r"\{\"offset\": -1.0\}: ValueError: offset -1.0 < 0 cannot be loaded\)"):
            RemoteReward(url=server.url, context={"offset": -1.0}, **{**options, "retries": 0})
    finally:
        server.close()


def test_a_constructor_failure_at_start_up_stops_the_server():
    with pytest.raises(RewardError, match=r"^reward 'test_remote_context_offset' could not be built: ValueError: "
                                          r"offset -2.0 < 0 cannot be loaded$"):
        ServedReward("test_remote_context_offset", {"offset": -2.0})
    served = ServedReward("exact_match", {}, function=lambda batch: [1.0] * len(batch))  # a built callable
    assert not served.reads_context and served.instance_for(QWEN2)(RewardInput(rows=[{}], payload={})) == [1.0]
    assert served.builds == 0
