"""The local planner: JSON-schema-constrained decoding over a finite reply language, a tiny random Qwen2.5-VL
served by the real uvicorn on 127.0.0.1 and asked by the real openai client over HTTP (the endpoint
planner's code path), and the same model in process."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from histeve_jax.data.tokenizer import IM_END_ID, load_qwen_tokenizer
from histeve_jax.harness.json_constraint import UnsupportedSchema, enumerate_json, schema_constraint
from histeve_jax.harness.planners.base import plan_messages, validate_reply
from histeve_jax.harness.planners.openai import EndpointPlanner, EndpointSpec
from histeve_jax.harness.schemas import load_schemas, reply_schema

SCHEMAS = load_schemas()


def _ctx():
    from test_harness_planners import _ctx as ctx  # the same planning context as the endpoint tests

    # text only: the vision tower stays out of the compiled program (the endpoint tests send frames)
    return dataclasses.replace(ctx(), frames=[])


def test_enumerate_json_lists_the_finite_language_and_names_what_it_cannot():
    schema = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
              "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": "integer", "minimum": 1, "maximum": 2}}}
    assert enumerate_json(schema) == [{"a": "x", "b": 1}, {"a": "x", "b": 2}, {"a": "y", "b": 1},
                                      {"a": "y", "b": 2}]
    assert enumerate_json({"anyOf": [{"const": 3}, {"type": "boolean"}]}) == [3, False, True]
    for bad, where in [({"type": "string"}, r"\$: type 'string'"),
                       ({"type": "object", "properties": {"a": {"type": "number"}}, "required": ["a"]},
                        r"\$\.a: type 'number'"),
                       ({"type": "object", "properties": {"a": {"const": 1}}, "required": []}, "required"),
                       ({"type": "integer", "minimum": 0}, "minimum <= maximum")]:
        with pytest.raises(UnsupportedSchema, match=where):
            enumerate_json(bad)
    n = sum(len(s.parameters["count"].values()) if s.parameters else 1 for s in SCHEMAS.values())
    assert len(enumerate_json(reply_schema(SCHEMAS))) == n


def test_the_automaton_admits_exactly_the_canonical_replies():
    tok = load_qwen_tokenizer()
    c = schema_constraint(reply_schema(SCHEMAS), tok, IM_END_ID, 151936)
    good = tok.encode(json.dumps({"subtask": {"name": "mine_log", "parameters": {"count": 2}}}),
                      add_special_tokens=False) + [IM_END_ID]
    state = c.init(1)
    for t in good:
        assert bool(c.mask(state)[0, t]), tok.decode([t])
        state = c.update(state, jnp.asarray([t]))
    assert int(state[0]) == c.sink and np.flatnonzero(np.asarray(c.mask(state)[0])).tolist() == [IM_END_ID]
    # an inadmissible name cannot start: after '{"subtask": {"name": "' only admissible names follow
    prefix = tok.encode('{"subtask": {"name": "', add_special_tokens=False)
    state = c.init(1)
    for t in prefix:
        state = c.update(state, jnp.asarray([t]))
    allowed = {tok.decode([t]) for t in np.flatnonzero(np.asarray(c.mask(state)[0]))}
    assert allowed and all(any(n.startswith(a) for n in SCHEMAS) for a in allowed)
    assert not any(a.startswith("fly") for a in allowed)


@pytest.fixture(scope="module")
def planner_model(tmp_path_factory):
    """A tiny random Qwen2.5-VL with the real tokenizer's vocabulary and special-token ids."""
    from conftest import qwen_tiny_hf

    from histeve_jax.harness.planners.local import LocalModel
    from histeve_jax.models.qwen2_5_vl import tiny

    cfg = tiny()
    cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, vocab_size=151936),
                              image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                              vision_end_token_id=151653, tie_word_embeddings=True)
    d = tmp_path_factory.mktemp("planner_qwen")
    qwen_tiny_hf(cfg).save_pretrained(d)
    return LocalModel(str(d), name="tiny-planner")


@pytest.fixture(scope="module")
def served(planner_model):
    """The model behind the real uvicorn on 127.0.0.1 (experiments.serve's app), on a free port."""
    import uvicorn

    from histeve_jax.harness.server import make_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(planner_model), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def test_the_served_model_plans_through_the_openai_client(served, planner_model):
    from openai import OpenAI

    client = OpenAI(base_url=served, api_key="local")
    assert [m.id for m in client.models.list().data] == ["tiny-planner"]
    ctx = _ctx()
    planner = EndpointPlanner(EndpointSpec(base_url=served, model="tiny-planner", api_key="local",
                                           max_tokens=48, temperature=1.0))
    for _ in range(2):  # a random model, sampled: constrained decoding still gives an executable reply
        r = planner.plan(ctx)
        assert r.subtask is not None and r.attempts == 1, r.error
        assert r.subtask.name in ctx.admissible
    # in process: the server's code path, the same compiled program
    local = planner_model.chat(plan_messages(ctx), schema=reply_schema(ctx.admissible), max_tokens=48,
                               temperature=1.0, seed=7)
    assert local.finish_reason == "stop" and validate_reply(local.text, ctx.admissible).name in ctx.admissible


def test_over_budget_and_unsupported_requests_are_clear_errors(served):
    ctx = _ctx()
    cut = EndpointPlanner(EndpointSpec(base_url=served, model="tiny-planner", api_key="local", max_tokens=4,
                                       max_attempts=2)).plan(ctx)
    assert cut.subtask is None and cut.attempts == 2 and "token budget of 4 tokens" in cut.error
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=served, api_key="local", max_retries=0)
    with pytest.raises(BadRequestError, match="type 'string' is not supported"):
        client.chat.completions.create(
            model="tiny-planner", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "string"}}})
    with pytest.raises(BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="tiny-planner", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=100000)
