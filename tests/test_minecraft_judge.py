"""The MineStudio Bench VLM judge against a real HTTP server on localhost speaking OpenAI's chat-completions
API to the real ``openai`` client, on frames of MineStudio's own recorded build_gate episode; the prompt and
criteria are checked against the installed package's files read directly."""

from __future__ import annotations

import base64
import json
import socket
import time
from pathlib import Path

import numpy as np
import pytest
from minecraft_suite_helpers import BENCH, CRITERIA, ChatServer, episode_result, rating, recorded_frames

from histeve_jax.data.records import decode_frame, read_shard, shard_paths
from histeve_jax.eval.suites import minecraft_tasks as mt
from histeve_jax.eval.suites import vlm_judge as vj
from histeve_jax.eval.suites.minecraft import SuiteSpec, finish_episode


@pytest.fixture
def chat_server():
    servers = []

    def start(replies):
        servers.append(ChatServer(replies))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


@pytest.fixture(scope="module")
def episode_frames():
    return recorded_frames(60)


def judge(url, **kw):
    return vj.VLMJudge(vj.JudgeSpec(base_url=url, api_key="sk-test", model="judge-model", max_images=8,
                                    timeout_s=kw.pop("timeout_s", 30.0), connection_retries=0, **kw))


def test_criteria_come_from_the_installed_prompt():
    prompt = (BENCH / "auto_eval/prompts/single_rating_prompt.txt").read_text(encoding="utf-8")
    assert vj.rating_prompt() == prompt
    assert vj.rating_criteria(prompt) == CRITERIA
    schema = vj.response_format(CRITERIA)["json_schema"]["schema"]
    assert schema["required"] == ["task_progress", "action_control", "error_recognition_and_correction",
                                  "creative_attempts", "task_completion_efficiency",
                                  "material_selection_and_usage"]
    assert vj.sample_indices(601, 16) == list(range(0, 601, 40)) and vj.sample_indices(3, 16) == [0, 1, 2]


def test_judge_request_carries_the_package_prompt_criteria_and_frames(chat_server, episode_frames):
    server = chat_server([(200, rating(), 0)])
    j = judge(server.url).rate("build_gate", episode_frames)
    assert j.ok and j.attempts == 1 and not j.error
    assert j.scores == {c: i + 2 for i, c in enumerate(CRITERIA)} and j.score == pytest.approx(4.5)
    assert j.evidence["Creative Attempts"] == "saw Creative Attempts"
    (req,) = server.requests
    assert req["path"] == "/v1/chat/completions" and req["headers"]["authorization"] == "Bearer sk-test"
    body = req["body"]
    assert body["model"] == "judge-model" and body["temperature"] == 0.5
    assert body["response_format"]["type"] == "json_schema"
    assert body["response_format"]["json_schema"]["schema"]["required"][0] == "task_progress"
    system, user, images = body["messages"]
    assert system == {"role": "system", "content": vj.rating_prompt()}
    criteria = (BENCH / "auto_eval/criteria_files/build_gate.txt").read_text(encoding="utf-8")
    assert user["role"] == "user" and "The task name is build_gate" in user["content"]
    assert criteria in user["content"]
    parts = images["content"]
    assert len(parts) == 8 and all(p["type"] == "image_url" for p in parts)
    want = [episode_frames[i] for i in vj.sample_indices(60, 8)]
    for p, frame in zip(parts, want, strict=True):
        head, data = p["image_url"]["url"].split(",", 1)
        assert head == "data:image/jpeg;base64"
        got = decode_frame(base64.b64decode(data))
        assert got.shape == frame.shape == (360, 640, 3)
        assert np.abs(got.astype(int) - frame).mean() < 4  # the same frame, JPEG-compressed


def test_judge_retries_malformed_replies_with_the_validation_error(chat_server, episode_frames):
    bad_score = rating(task_progress={"evidence": "x", "score": 11})
    server = chat_server([(200, "Task Progress: 7", 0), (200, bad_score, 0), (200, rating(), 0)])
    j = judge(server.url, max_attempts=3).rate("build_gate", episode_frames[:5])
    assert j.ok and j.attempts == 3
    second, third = server.requests[1]["body"]["messages"], server.requests[2]["body"]["messages"]
    assert second[-2] == {"role": "assistant", "content": "Task Progress: 7"}
    assert "not valid JSON" in second[-1]["content"]
    assert third[-2]["content"] == bad_score
    assert "task_progress.score: must be an integer in [0, 10], got 11" in third[-1]["content"]


@pytest.mark.parametrize("reply, why", [
    ("{not json", "not valid JSON"),
    (rating(task_progress={"evidence": "x", "score": -1}), "task_progress.score"),
    (rating(action_control={"evidence": "x", "score": True}), "action_control.score"),
    (json.dumps({"task_progress": {"evidence": "x", "score": 3}}), "action_control: missing"),
    ("[1, 2]", "must be a JSON object"),
])
def test_a_judge_that_never_replies_validly_is_a_counted_failure(chat_server, episode_frames, reply, why):
    server = chat_server([(200, reply, 0)] * 2)
    j = judge(server.url, max_attempts=2).rate("build_gate", episode_frames[:3])
    assert not j.ok and j.attempts == 2 and j.score is None and len(server.requests) == 2
    assert j.error.startswith("no valid rating after 2 replies; last: ") and why in j.error


def _closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_judge_endpoint_down_slow_or_failing_is_a_counted_error(chat_server, episode_frames):
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    j = judge(url).rate("build_gate", episode_frames[:3])
    assert not j.ok and j.error.startswith(f"judge at {url} is unreachable")
    slow = chat_server([(200, rating(), 3.0)])
    t0 = time.monotonic()
    j = judge(slow.url, timeout_s=0.5).rate("build_gate", episode_frames[:3])
    assert not j.ok and j.error == f"judge at {slow.url} timed out after 0.5 s"
    assert time.monotonic() - t0 < 2.5
    failing = chat_server([(500, "model overloaded", 0)])
    j = judge(failing.url).rate("build_gate", episode_frames[:3])
    assert not j.ok and "answered HTTP 500" in j.error and "model overloaded" in j.error
    j = judge(failing.url).rate("no_such_task", episode_frames[:3])
    assert not j.ok and "grading criteria of 'no_such_task'" in j.error and j.attempts == 0


def test_judge_configuration_from_env_or_config(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    assert vj.JudgeSpec().missing().startswith("no VLM judge configured: set OPENAI_API_KEY")
    with pytest.raises(ValueError, match="no VLM judge configured"):
        vj.VLMJudge(vj.JudgeSpec())
    monkeypatch.setenv("OPENAI_API_KEY", "k")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    assert vj.JudgeSpec().missing() == ""
    r = vj.JudgeSpec().resolved()
    assert (r.api_key, r.base_url) == ("k", "http://127.0.0.1:9/v1")
    assert vj.JudgeSpec(api_key="c", base_url="http://x/v1").resolved().api_key == "c"


def test_finish_episode_judges_and_writes_records_and_report(chat_server, episode_frames, tmp_path):
    task = mt.load_bench_task("simple/build_gate")
    frames = [np.ascontiguousarray(f[::2, ::2]) for f in episode_frames[:12]]  # 180x320
    result = episode_result(task, frames, lambda t: {})
    server = chat_server([(200, rating(), 0)])
    spec = SuiteSpec("minestudio_bench", out_dir=str(tmp_path))
    ep = finish_episode(spec, task, result, judge(server.url))
    assert ep.task == "simple/build_gate" and not ep.success and ep.steps == 11
    assert ep.judgement.ok and ep.judgement.score == pytest.approx(4.5)
    assert len(server.requests[0]["body"]["messages"][2]["content"]) == 8  # max_images of 12 frames
    (shard,) = shard_paths(tmp_path / "records" / "simple" / "build_gate")
    back = list(read_shard(shard))
    assert [r.step for r in back] == list(range(12)) and back[0].instruction == task.text
    assert back[3].kind == "eval" and decode_frame(back[3].frame).shape == (180, 320, 3)
    page = Path(ep.report).read_text()
    assert ep.report.startswith(str(tmp_path / "reports" / "simple" / "build_gate"))
    assert "VLM rating 4.50" in page and "saw Task Progress" in page
    json.dumps(ep.as_dict())  # the summary's form
