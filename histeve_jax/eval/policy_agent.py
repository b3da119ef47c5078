"""A trained policy in the game: loaded from a run's workdir, fed the training layout, served in batches.

* ``load_run(workdir, step=None)``: the run's policy (its ``config.json`` and latest or given checkpoint)
  with everything acting needs (``LoadedPolicy``: the sampler, the prompt processor, the tiny models' id
  remap, the frame history layout). A workdir with no checkpoint, or one whose tree does not match its
  config, is one ``ValueError``/``FileNotFoundError`` naming it.
* ``FrameHistory``: the frames of the training windows (``data.pipeline.WindowSource``): ``history`` frames
  ``stride`` steps apart before the current one, clamped to the episode's first frame early on (and, with
  ``data.history_in_regime``, to the first frame since the GUI last opened or closed); ``FrameLayout`` is
  what a game-side agent needs to build one (``LoadedPolicy.layout``, ``PolicyServer.layout``).
* ``PolicyServer`` (a Ray actor): one compiled batched call for the requests of all game instances that
  arrive together; rows are padded to a fixed batch and prompts to a length bucket so a handful of shapes
  ever compile. ``PolicyAgent`` is the game-side ``Agent`` that asks it, built by ``PolicyAgentFactory``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from histeve_jax.data import records as records_lib
from histeve_jax.data.pipeline import load_tokenizer_with_actions
from histeve_jax.eval.report import action_text
from histeve_jax.eval.rollout import Decision
from histeve_jax.parallel import axes
from histeve_jax.parallel import mesh as mesh_lib
from histeve_jax.policy import (
    ActionSampler,
    Policy,
    decode_actions,
    observation_inputs,
    policy_processor,
    regime_array,
)
from histeve_jax.policy.observations import Observation
from histeve_jax.policy.sampling import SampledAction
from histeve_jax.train import optimizer as optimizer_lib
from histeve_jax.train import setup
from histeve_jax.train import state as state_lib
from histeve_jax.train.checkpoint import Checkpointer
from histeve_jax.train.specs import RunSpec

PROMPT_BUCKET = 32  # prompts are left-padded to a multiple of this many tokens


@dataclasses.dataclass
class LoadedPolicy:
    """A run's policy ready to act: ``sample(observations, regimes, rng)`` -> ``SampledAction`` per row."""

    workdir: str
    step: int
    policy: Policy
    sampler: ActionSampler
    processor: Any
    id_map: np.ndarray | None
    history: int
    stride: int
    frame_format: str  # the run's training frames' codec (``data.frame_format``): jpeg, or png (lossless)
    jpeg_quality: int
    history_in_regime: bool = False  # the run's ``data.history_in_regime`` (``FrameHistory``)

    @property
    def config(self) -> Any:
        return self.policy.config

    @property
    def layout(self) -> FrameLayout:
        return FrameLayout(self.history, self.stride, self.history_in_regime)

    def through_codec(self, frame: np.ndarray) -> np.ndarray:
        """``frame`` as the run's training frames were stored: a JPEG run acts on the JPEG round trip of
        each live frame (on the raw frame one of its craft moves flipped, p 0.001 -> 0.999)."""
        if self.frame_format == "jpeg":
            return records_lib.decode_frame(records_lib.encode_frame(np.asarray(frame), "jpeg",
                                                                     self.jpeg_quality))
        return frame

    def inputs(self, observations: Sequence[Observation], batch: int | None = None) -> dict[str, np.ndarray]:
        """Prompt inputs (each frame through the run's codec), rows padded to ``batch`` (repeating the last)
        and length to a bucket."""
        observations = [([self.through_codec(f) for f in frames], text) for frames, text in observations]
        inputs = observation_inputs(self.config, self.processor, observations, id_map=self.id_map)
        ids, mask, pv = inputs["input_ids"], inputs["attention_mask"], inputs["pixel_values"]
        T = -(-ids.shape[1] // PROMPT_BUCKET) * PROMPT_BUCKET
        pad = T - ids.shape[1]
        ids = np.pad(ids, ((0, 0), (pad, 0)))
        mask = np.pad(mask, ((0, 0), (pad, 0)))
        n = ids.shape[0]
        if batch is not None and batch > n:
            rows = np.r_[np.arange(n), np.full(batch - n, n - 1)]
            per_row = pv.shape[0] // n
            ids, mask = ids[rows], mask[rows]
            pv = pv.reshape(n, per_row, -1)[rows].reshape(-1, pv.shape[-1])
        return {"input_ids": ids, "attention_mask": mask, "pixel_values": pv}

    def sample(self, observations: Sequence[Observation], regimes: Sequence[Any], rng: jax.Array, *,
               temperature: float = 1.0, greedy: bool = False, top_p: float = 1.0,
               batch: int | None = None) -> list[SampledAction]:
        """One ``SampledAction`` per observation; ``batch`` pads the rows to a fixed count (one shape)."""
        n = len(observations)
        inputs = self.inputs(observations, batch)
        reg = regime_array(regimes)
        if batch is not None and batch > n:
            reg = np.r_[reg, np.full(batch - n, reg[-1])]
        out = self.sampler(inputs["input_ids"], inputs["attention_mask"], inputs["pixel_values"], reg, rng,
                           temperature=temperature, greedy=greedy, top_p=top_p)
        end = self.sampler.end
        rows = []
        for (action, regime), toks, lps in zip(decode_actions(self.config, out.tokens[:n]), out.tokens[:n],
                                               out.logprobs[:n], strict=True):
            k = int(np.flatnonzero(toks == end)[0]) + 1
            rows.append(SampledAction(action, regime, toks[:k].tolist(), lps[:k].astype(float).tolist()))
        return rows


def _run_config(workdir: str) -> Any:
    import ml_collections

    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{workdir}: no config.json (not a run's workdir)")
    with open(path) as f:
        return ml_collections.ConfigDict(json.load(f))


def frame_codec(workdir: str) -> tuple[str, int]:
    """(frame format, JPEG quality) of a run's training frames: the codec its policy acts through."""
    data = RunSpec.from_config(_run_config(workdir), workdir).data  # DataSpec's defaults for older runs
    return data.frame_format, data.jpeg_quality


def load_run(workdir: str, step: int | None = None) -> LoadedPolicy:
    """The policy of a run's workdir at its latest checkpoint (or ``step``), ready to act."""
    spec = RunSpec.from_config(_run_config(workdir), workdir)
    stage = setup.policy_stage(spec)
    ckpt_dir = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"{workdir}: no checkpoint (no {ckpt_dir})")
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), mesh_lib.AXES)
    with Checkpointer(ckpt_dir, async_save=False) as ck:
        step = ck.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{workdir}: no checkpoint under {ckpt_dir}")
        # The whole train state is the checkpoint's tree; its optimizer moments are read and dropped.
        tx, _ = optimizer_lib.make_optimizer(spec.optimizer)
        abstract, _ = state_lib.abstract_train_state(stage.init_model, tx, mesh, axes.RULES)
        try:
            state, _, _ = ck.restore(abstract, step=step)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{workdir}: no checkpoint step {step} ({e})") from e
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{workdir}: checkpoint step {step} does not match the run's config.json "
                             f"(the policy it describes): {str(e).splitlines()[0][:300]}") from e
    policy = state.model()
    tok, _ = load_tokenizer_with_actions(stage.features)
    cv = stage.features.compact_vocab
    return LoadedPolicy(
        workdir=workdir, step=int(step), policy=policy, sampler=ActionSampler(policy),
        processor=policy_processor(policy.config, tok),
        id_map=None if cv is None else cv.table(len(policy.config.vocab.ids)),
        history=policy.config.history_frames, stride=spec.data.stride,
        frame_format=spec.data.frame_format, jpeg_quality=spec.data.jpeg_quality,
        history_in_regime=spec.data.history_in_regime)


@dataclasses.dataclass(frozen=True)
class FrameLayout:
    """How a run's policy windows its frames (its ``data.history``, ``data.stride``, and
    ``data.history_in_regime``): what a game-side agent needs to give it the training windows."""

    history: int
    stride: int
    in_regime: bool = False

    def frame_history(self) -> FrameHistory:
        return FrameHistory(self.history, self.stride, self.in_regime)


class FrameHistory:
    """The frames of one training window: ``history`` frames ``stride`` steps apart, then the current one;
    steps before the episode's first repeat it (as ``WindowSource`` clamps), and with ``in_regime`` steps
    before the current GUI-open or GUI-closed run's first (``data.history_in_regime``)."""

    def __init__(self, history: int, stride: int, in_regime: bool = False):
        self.history, self.stride, self.in_regime = history, stride, bool(in_regime)
        self._frames: deque[np.ndarray] = deque(maxlen=history * stride + 1)
        self._regime: int | None = None

    def reset(self) -> None:
        self._frames.clear()
        self._regime = None

    def push(self, frame: np.ndarray, regime: int | None = None) -> list[np.ndarray]:
        """Add the current frame (``regime``: 1 with a GUI open, else 0; needed with ``in_regime``);
        returns the window's frames, oldest first."""
        if self.in_regime:
            if regime is None:
                raise ValueError("FrameHistory(in_regime=True).push: the frame's regime is needed")
            if regime != self._regime:
                self._frames.clear()
            self._regime = int(regime)
        self._frames.append(frame)
        n = len(self._frames)  # while n < maxlen, index 0 is the episode's first frame: the clamp
        return [self._frames[max(n - 1 - k * self.stride, 0)] for k in range(self.history, -1, -1)]


class PolicyServer:
    """Batched acting for several game instances (run it as a Ray actor: ``ray.remote(PolicyServer)``).

    Requests that arrive within ``max_wait_s`` of the first one, up to ``max_batch``, run as one compiled
    call padded to ``max_batch`` rows. Sampling keys are folded from ``seed`` and a call counter.
    """

    def __init__(self, workdir: str, step: int | None = None, *, max_batch: int = 1,
                 max_wait_s: float = 0.004, temperature: float = 1.0, greedy: bool = False, seed: int = 0,
                 top_p: float = 1.0):
        self.loaded = load_run(workdir, step)
        self.max_batch, self.max_wait_s = int(max_batch), float(max_wait_s)
        self.temperature, self.greedy, self.top_p = float(temperature), bool(greedy), float(top_p)
        self._key = jax.random.key(seed)
        self._calls = 0
        self._queue: list[tuple[Observation, int, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self.batch_sizes: list[int] = []
        self.arrivals: list[float] = []  # monotonic time of each request (its callers' step rate)

    def layout(self) -> tuple[FrameLayout, str]:
        """(the policy's frame layout, the run's workdir and step) for the game-side agents."""
        return self.loaded.layout, f"{self.loaded.workdir}@{self.loaded.step}"

    def stats(self) -> dict[str, float]:
        """Calls served and the mean rows per compiled call."""
        n = len(self.batch_sizes)
        return {"calls": n, "mean_batch": float(np.mean(self.batch_sizes)) if n else 0.0}

    def request_times(self) -> list[float]:
        """The arrival time (``time.monotonic``) of every request so far."""
        return list(self.arrivals)

    async def act(self, frames: list[np.ndarray], instruction: str, regime: int) -> dict[str, Any]:
        """One row's action: {"action", "tokens", "logprobs", "regime"}."""
        loop = asyncio.get_running_loop()
        self.arrivals.append(time.monotonic())
        future = loop.create_future()
        self._queue.append(((frames, instruction), int(regime), future))
        if len(self._queue) >= self.max_batch:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.max_wait_s, self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
        if not batch:
            return
        key = jax.random.fold_in(self._key, self._calls)
        self._calls += 1
        try:
            rows = self.loaded.sample([b[0] for b in batch], [b[1] for b in batch], key,
                                      temperature=self.temperature, greedy=self.greedy, top_p=self.top_p,
                                      batch=self.max_batch)
        except Exception as e:  # every waiting row gets the error, none waits forever
            for *_, fut in batch:
                fut.set_exception(e)
            return
        self.batch_sizes.append(len(batch))
        for (*_, fut), row in zip(batch, rows, strict=True):
            fut.set_result({"action": row.action, "tokens": row.tokens, "logprobs": row.logprobs,
                            "regime": int(row.regime)})
        if self._queue:
            self._flush()


class PolicyAgent:
    """The game-side agent of a served policy: keeps the frame history, asks the server for each step."""

    def __init__(self, server: Any, layout: FrameLayout, name: str = "policy"):
        self.server, self.name = server, name
        self.frames = layout.frame_history()
        self.instruction = ""

    def reset(self, task: Any, obs: dict, info: dict, seed: int) -> None:
        self.frames.reset()
        self.instruction = task.instruction(info)

    def act(self, obs: dict, info: dict) -> Decision:
        import ray

        regime = int(bool(info["is_gui_open"]))
        frames = self.frames.push(np.asarray(obs["image"]), regime)
        out = ray.get(self.server.act.remote(frames, self.instruction, regime))
        return Decision(action=out["action"], tokens=out["tokens"], logprobs=out["logprobs"],
                        text=action_text(out["action"]))


@dataclasses.dataclass
class PolicyAgentFactory:
    """``make_agent(task_name, seed)`` for the fleet: carries the server's handle, not the weights."""

    server: Any
    layout: FrameLayout
    name: str = "policy"

    def __call__(self, task_name: str, seed: int) -> PolicyAgent:
        return PolicyAgent(self.server, self.layout, self.name)
