"""Shared pieces of the Minecraft suite tests: a real chat-completions server on localhost, MineStudio's own
recorded frames, MinecraftSim-shaped raw infos and episodes built by ``rollout.step_record``."""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from histeve_jax.envs import noop_action
from histeve_jax.envs.minestudio import info_from_sim
from histeve_jax.eval.rollout import Decision, EpisodeResult, step_record
from histeve_jax.eval.suites import minecraft_tasks as mt
from histeve_jax.eval.suites import vlm_judge as vj

BENCH = mt.minestudio_benchmark_dir()


class ChatServer:
    """A real HTTP server speaking OpenAI's chat-completions API on localhost: it answers each POST to
    ``/v1/chat/completions`` with the next canned ``(status, content, delay_s)`` and keeps the requests."""

    def __init__(self, replies):
        self.replies, self.requests = list(replies), []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"path": self.path, "body": body,
                                       "headers": {k.lower(): v for k, v in self.headers.items()}})
                status, content, delay = outer.replies.pop(0) if outer.replies else (500, "no reply left", 0)
                time.sleep(delay)
                if status == 200:
                    payload = {"id": f"c{len(outer.requests)}", "object": "chat.completion", "created": 0,
                               "model": body["model"],
                               "choices": [{"index": 0, "finish_reason": "stop",
                                            "message": {"role": "assistant", "content": content}}],
                               "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
                else:
                    payload = {"error": {"message": content, "type": "server_error"}}
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


def recorded_frames(n=60):
    """The first ``n`` frames of MineStudio's own recorded build_gate episode (640x360, the render size)."""
    import av

    with av.open(str(BENCH / "auto_eval/eval_video/build_gate/build_gate_5.mp4")) as c:
        frames = []
        for f in c.decode(video=0):
            frames.append(f.to_ndarray(format="rgb24"))
            if len(frames) == n:
                break
    return frames


CRITERIA = ["Task Progress", "Action Control", "Error Recognition and Correction", "Creative Attempts",
            "Task Completion Efficiency", "Material Selection and Usage"]


def rating(**override):
    d = {vj.criterion_key(c): {"evidence": f"saw {c}", "score": i + 2} for i, c in enumerate(CRITERIA)}
    d.update(override)
    return json.dumps(d)


def raw_info(counts):
    """MinecraftSim's raw info (ObserveFromFullStats: defaultdicts of 0-d arrays) with event counts."""
    info = {"inventory": {}, "player_pos": {"x": 0.0, "y": 64.0, "z": 0.0, "pitch": 0.0, "yaw": 0.0},
            "is_gui_open": False, "health": 20.0}
    for event in ("mine_block", "craft_item", "pickup", "use_item"):
        d = defaultdict(lambda: np.zeros((), float))
        for (e, item), n in counts.items():
            if e == event:
                d[item] = np.array(float(n))
        info[event] = d
    return info


def episode_result(task, frames, counts_at):
    """An EpisodeResult of records built by rollout.step_record from backend-shaped infos (info_from_sim):
    frame t with the event counts ``counts_at(t)``."""
    records = []
    for t, frame in enumerate(frames):
        info = info_from_sim(raw_info(counts_at(t)), cursor=None, held_slot=1)
        info.update(task=task.name, success=task.is_success(info), steps=t)
        last = t == len(frames) - 1
        records.append(step_record(task, f"{task.name}-5-x", t, {"image": frame}, info,
                                   Decision(action={**noop_action(), "forward": int(not last)}), reward=0.0,
                                   done=last,
                                   kind="eval", seed=5, backend="minestudio"))
    return EpisodeResult(task=task.name, seed=5, agent="random", episode_id=f"{task.name}-5-x",
                         success=records[-1].completed == 1, steps=len(records) - 1, interrupted=False,
                         error="", progress=0.0, records=records, seconds=1.0)
