"""The endpoint planner through the real openai client against a real local HTTP server: malformed replies are
validated, retried with the error and never executed; a server that is down, slow or failing, or a reply
over the token budget, is one clear error or a counted retry, and the episode's record survives."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from histeve_jax.envs.tasks import load_task
from histeve_jax.harness.controller import HarnessAgent, HarnessSpec
from histeve_jax.harness.executors import ExpertExecutor
from histeve_jax.harness.planners.base import PlanError, PlanningContext, validate_reply
from histeve_jax.harness.planners.openai import EndpointPlanner, EndpointSpec
from histeve_jax.harness.schemas import evaluate_condition, load_schemas

SCHEMAS = load_schemas()
TASK = load_task("wooden_pickaxe")
GOOD = json.dumps({"subtask": {"name": "mine_log", "parameters": {"count": 2}}})


class ChatServer:
    """A real HTTP server speaking the chat-completions API on localhost: each POST gets the next canned
    ``(status, content, delay_s, finish_reason)``; the requests are kept."""

    def __init__(self, replies):
        self.replies, self.requests = list(replies), []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                status, content, delay, finish = (outer.replies.pop(0) if outer.replies
                                                  else (500, "no reply left", 0, "stop"))
                time.sleep(delay)
                payload = ({"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                            "choices": [{"index": 0, "finish_reason": finish,
                                         "message": {"role": "assistant", "content": content}}],
                            "usage": {"prompt_tokens": 100 + len(outer.requests),
                                      "completion_tokens": len(content), "total_tokens": 0}}
                           if status == 200 else {"error": {"message": content, "type": "server_error"}})
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads, self.httpd.block_on_close = True, False
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _info(**over):
    info = {"inventory": {}, "pickup": {}, "craft_item": {}, "place_block": {}, "mine_block": {},
            "nearby": [("default:tree", (0, 9, 3))], "pos": (0.0, 8.5, 0.0), "yaw": 0.0, "pitch": 0.0,
            "is_gui_open": False, "cursor": None, "subgoals_done": []}
    info.update(over)
    return info


def _ctx(info=None):
    info = info or _info()
    adm = {n: s for n, s in SCHEMAS.items() if evaluate_condition(s.applicable, info)}
    frame = np.full((56, 56, 3), 90, np.uint8)
    return PlanningContext(TASK.text, TASK.success, TASK.subgoals, [frame], info, {"objective": TASK.text},
                           adm, {"episodic": []}, SCHEMAS)


def _planner(server, **kw):
    return EndpointPlanner(EndpointSpec(base_url=server.url, model="planner-test", api_key="k",
                                        connection_retries=0, **kw))


def test_validate_reply_names_what_is_wrong():
    adm = _ctx().admissible
    assert validate_reply(GOOD, adm).label == "mine_log(count=2)"
    for text, msg in [("{not json", "not valid JSON"), ("[1]", "must be a JSON object"),
                      ('{"subtask": {"name": "fly"}}', "'fly' is not a known subtask"),
                      ('{"subtask": {"name": "craft_furnace", "parameters": {}}}', "not applicable"),
                      ('{"subtask": {"name": "mine_log", "parameters": {"count": 99}}}', r"count: must be"),
                      ('{"subtask": {"name": "mine_log", "parameters": {"colour": 1}}}',
                       "unknown parameter")]:
        with pytest.raises(PlanError, match=msg):
            validate_reply(text, adm, SCHEMAS)


def test_malformed_replies_are_retried_with_the_error_and_never_executed():
    bad = ['{"subtask": ', '{"subtask": {"name": "craft_furnace", "parameters": {}}}',
           '{"subtask": {"name": "mine_log", "parameters": {"count": "two"}}}']
    server = ChatServer([(200, b, 0, "stop") for b in bad] + [(200, GOOD, 0, "stop")])
    try:
        r = _planner(server, max_attempts=4).plan(_ctx())
        assert r.subtask.label == "mine_log(count=2)" and r.attempts == 4 and r.replies[:3] == bad
        # The server's usage of every attempt, summed into the result (and the report's planner event).
        assert (r.prompt_tokens, r.completion_tokens) == (101 + 102 + 103 + 104, sum(map(len, bad + [GOOD])))
        assert r.event()["prompt_tokens"] == r.prompt_tokens
        req = server.requests
        fmt = req[0]["response_format"]  # a strict JSON schema over the admissible subtasks
        names = [c["properties"]["name"]["enum"][0]
                 for c in fmt["json_schema"]["schema"]["properties"]["subtask"]["anyOf"]]
        assert fmt["json_schema"]["strict"] and names == sorted(_ctx().admissible)
        assert req[0]["max_tokens"] == 128 and req[0]["messages"][1]["content"][1]["type"] == "image_url"
        assert "not valid JSON" in req[1]["messages"][-1]["content"]  # the error goes back to the planner
        assert "not applicable" in req[2]["messages"][-1]["content"]
        assert "count: must be an integer" in req[3]["messages"][-1]["content"]
    finally:
        server.close()


def test_a_planner_that_never_replies_well_executes_nothing_and_the_episode_ends_cleanly():
    server = ChatServer([(200, '{"subtask": {"name": "fly", "parameters": {}}}', 0, "stop")] * 6)
    try:
        agent = HarnessAgent(_planner(server, max_attempts=2), ExpertExecutor(), SCHEMAS,
                             HarnessSpec(max_planner_failures=3))
        obs, info = {"image": np.zeros((56, 56, 3), np.uint8)}, _info()
        agent.reset(TASK, obs, info, 0)
        with pytest.raises(RuntimeError, match="no executable subtask 3 times in a row"):
            agent.act(obs, info)  # run_episode records this as the agent giving up, records kept
        assert agent.invocations == 0 and agent.t == 0  # nothing reached the executor
        planner_events = [e for e in agent.events if e["kind"] == "planner"]
        assert len(planner_events) == 3 and all(e["payload"]["attempts"] == 2 for e in planner_events)
        assert agent.summary()["planner_retries"] == 3 and json.dumps(agent.memory.to_json())
    finally:
        server.close()


def test_down_slow_failing_endpoints_and_the_token_budget(monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = EndpointPlanner(EndpointSpec(base_url=f"http://127.0.0.1:{port}/v1", api_key="k",
                                        connection_retries=0)).plan(_ctx())
    assert down.subtask is None and "unreachable" in down.error and down.attempts == 1
    server = ChatServer([(200, GOOD, 3.0, "stop"), (500, "overloaded", 0, "stop"),
                         (200, '{"subtask": {"na', 0, "length"), (200, '{"subtask": {"na', 0, "length")])
    try:
        slow = _planner(server, timeout_s=0.5).plan(_ctx())
        assert slow.subtask is None and "timed out after 0.5 s" in slow.error
        failing = _planner(server).plan(_ctx())
        assert "answered HTTP 500" in failing.error and "overloaded" in failing.error
        cut = _planner(server, max_attempts=2, max_tokens=8).plan(_ctx())  # a counted retry, then one error
        assert cut.subtask is None and cut.attempts == 2 and "token budget of 8 tokens" in cut.error
    finally:
        server.close()
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ValueError, match="no planner endpoint key"):
        EndpointPlanner(EndpointSpec(base_url="http://127.0.0.1:1/v1", api_key=""))
