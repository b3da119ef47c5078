"""Acting with an exported HiSTEVE policy in PyTorch: observation -> prompt -> constrained decoding -> action.

This file is copied into every exported directory; it needs torch, transformers, numpy and PIL, not JAX::

    import sys; sys.path.insert(0, export_dir)
    from histeve_action import HiSteveActor
    actor = HiSteveActor(export_dir)
    history = actor.frame_history()                                          # per episode
    frames = history.push(obs["image"], info["is_gui_open"])
    actions = actor.act([(frames, "chop a tree")], [info["is_gui_open"]])   # one env action per row

* The prompt is the training prompt: one user turn with the frames (oldest first, each through the codec
  of the policy's training frames, ``observation.frame_codec``: a JPEG-trained policy sees each frame's
  PIL JPEG round trip at the run's quality, as in training; then resized to the policy's size with PIL
  bicubic) then the instruction, rendered by the directory's chat template,
  each ``<|image_pad|>`` expanded to its grid's tokens; tiny models' ids go through ``id_map.npy``.
* ``ActionGrammarProcessor``: the action automaton (``action_grammar.npz``) as a ``LogitsProcessor``;
  each row starts in its regime's state and may only produce that regime's well-formed action.
* Decoding runs in ``model.generate`` (KV-cached), greedy or sampled, stopping at the action's END.
* ``decode_action``: token ids -> (env action: every button 0/1, ``camera`` [dpitch, dyaw] degrees,
  regime), a lookup in ``histeve_actions.json`` (the port of ``histeve_jax.actions.tokens.decode``).
"""

from __future__ import annotations

import io
import json
import os
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import (
    AutoImageProcessor,
    AutoModelForImageTextToText,
    AutoTokenizer,
    LogitsProcessor,
    LogitsProcessorList,
)

ACTIONS_FILE = "histeve_actions.json"
IMAGE_TOKEN = "<|image_pad|>"
PAD_TOKEN = "<|endoftext|>"

Observation = tuple[Sequence[np.ndarray], str]  # frames (oldest first, HxWx3 uint8), instruction


def regime_of(source: Any) -> int:
    """0 (NG) or 1 (GUI) from an env ``info`` (``is_gui_open``/``isGuiOpen``), a bool, 0/1 or a name."""
    if isinstance(source, Mapping):
        for key in ("is_gui_open", "isGuiOpen"):
            if key in source:
                return regime_of(source[key])
        raise ValueError(f"regime: mapping has neither 'is_gui_open' nor 'isGuiOpen' (keys {sorted(source)})")
    if isinstance(source, str):
        names = {"NG": 0, "GUI": 1}
        if source.upper() not in names:
            raise ValueError(f"regime: unknown name {source!r}; expected 'NG' or 'GUI'")
        return names[source.upper()]
    value = int(np.asarray(source))
    if value not in (0, 1):
        raise ValueError(f"regime: expected a bool or 0/1, got {source!r}")
    return value


class ActionGrammarProcessor(LogitsProcessor):
    """Masks every token the action automaton forbids; the state is replayed from the prompt's end."""

    def __init__(self, allowed: torch.Tensor, next_state: torch.Tensor, regime: torch.Tensor,
                 prompt_len: int):
        self.allowed, self.next_state = allowed, next_state  # [S, V] bool, [S, V] long
        self.regime, self.prompt_len = regime, prompt_len

    def state(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B] automaton state after the tokens generated so far."""
        s = self.regime.to(input_ids.device)
        if s.shape[0] != input_ids.shape[0]:  # num_return_sequences copies rows next to each other
            s = s.repeat_interleave(input_ids.shape[0] // s.shape[0])
        for t in range(self.prompt_len, input_ids.shape[1]):
            s = self.next_state[s, input_ids[:, t]]
        return s

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if scores.shape[-1] != self.allowed.shape[-1]:
            raise ValueError(f"the grammar covers {self.allowed.shape[-1]} tokens, the model "
                             f"{scores.shape[-1]}")
        ok = self.allowed[self.state(input_ids)]
        return scores.masked_fill(~ok, -float("inf"))


def decode_action(table: Mapping[str, Any], ids: Sequence[int]) -> tuple[dict[str, Any], int]:
    """One action's model token ids (``TYPE ... END``) -> (env-format action, regime), else ValueError.
    ``table``: the loaded ``histeve_actions.json``."""
    by_id = table.get("_by_model_id") or {t["model_id"]: t for t in table["tokens"]}
    ids = [int(i) for i in ids]
    entries = [by_id.get(i) for i in ids]
    if len(ids) < 2 or entries[0] is None or entries[0]["kind"] != "type":
        raise ValueError(f"decode: an action starts with a type token, got ids {ids}")
    if entries[-1] is None or entries[-1]["kind"] != "end" or any(e is None or e["kind"] in ("type", "end")
                                                                   for e in entries[1:-1]):
        raise ValueError(f"decode: not one action (TYPE ... END) of action tokens: ids {ids}")
    regime = entries[0]["regime"]
    action: dict[str, Any] = {k: 0 for k in table["env_keys"] if k != "camera"}
    camera = np.zeros(2, np.float64)  # the null bin decodes to 0 degrees
    last = -1  # groups, then the mouse axes, each at most once and in that order; inventory stands alone
    for e in entries[1:-1]:
        if e["kind"] == "inventory" and len(ids) != 3 or e.get("order", len(ids)) <= last:
            raise ValueError(f"decode: token {e['string']} out of order or repeated: ids {ids}")
        last = e.get("order", last)
        if e["kind"] == "button":
            action[e["key"]] = 1
        elif e["kind"] == "inventory":
            action["inventory"] = 1
        elif e["regime"] != regime:
            raise ValueError(f"decode: a {table['regimes'][e['regime']]} mouse token in a "
                             f"{table['regimes'][regime]} action: ids {ids}")
        else:
            camera[e["axis"]] = e["degrees"]
    action["camera"] = camera
    return action, regime


class FrameHistory:
    """The frames of one training window: ``history`` frames ``stride`` steps apart, then the current one;
    steps before the episode's first repeat it (as training windows clamp), and with ``in_regime``
    (``observation.history_in_regime``) steps before the first since the GUI last opened or closed."""

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
        n = len(self._frames)
        return [self._frames[max(n - 1 - k * self.stride, 0)] for k in range(self.history, -1, -1)]


def _rgb(frame: Any, name: str) -> np.ndarray:
    a = np.asarray(frame.convert("RGB")) if isinstance(frame, Image.Image) else np.asarray(frame)
    if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3:
        raise ValueError(f"{name}: expected an [H, W, 3] uint8 image, got {a.dtype} {a.shape}")
    return a


class HiSteveActor:
    """An exported policy ready to act: ``act(observations, regimes)`` -> one env-format action per row."""

    def __init__(self, path: str, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
        self.path = path
        with open(os.path.join(path, ACTIONS_FILE)) as f:
            self.table = json.load(f)
        self.table["_by_model_id"] = {t["model_id"]: t for t in self.table["tokens"]}
        g = np.load(os.path.join(path, self.table["grammar"]["file"]))
        self.device = torch.device(device)
        self.allowed = torch.from_numpy(g["allowed"]).to(self.device)
        self.next_state = torch.from_numpy(g["next_state"].astype(np.int64)).to(self.device)
        id_map = self.table["id_map"]
        self.id_map = None if id_map is None else np.load(os.path.join(path, id_map))
        kw = {} if dtype is None else {"dtype": dtype}
        self.model = AutoModelForImageTextToText.from_pretrained(path, trust_remote_code=True, **kw)
        self.model.to(self.device).eval()
        # trust_remote_code: the tokenizer reads config.json, whose auto_map names the modeling file.
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
        self.image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=True)
        obs = self.table["observation"]
        self.history_frames, self.stride = obs["history_frames"], obs["stride"]
        self.history_in_regime = bool(obs.get("history_in_regime", False))  # older directories: across
        self.image_size = tuple(obs["image_size"])
        # directories exported before the codec was recorded: frames as they come
        self.frame_codec = obs.get("frame_codec", {"format": "png", "quality": 95})
        self.end = self.table["end_model_id"]
        self.max_len = self.table["max_action_tokens"]

    def frame_history(self) -> FrameHistory:
        """An episode's frame history in this policy's training layout (push each frame with its regime)."""
        return FrameHistory(self.history_frames, self.stride, self.history_in_regime)

    def _model_ids(self, ids: np.ndarray) -> np.ndarray:
        return ids if self.id_map is None else self.id_map[ids]

    def through_codec(self, frame: np.ndarray) -> np.ndarray:
        """``frame`` as the policy's training frames were stored (JPEG round trip, or as it is)."""
        if self.frame_codec["format"] != "jpeg":
            return frame
        buf = io.BytesIO()
        Image.fromarray(frame).save(buf, format="JPEG", quality=int(self.frame_codec["quality"]))
        with Image.open(io.BytesIO(buf.getvalue())) as im:
            return np.asarray(im.convert("RGB"))

    def inputs(self, observations: Sequence[Observation]) -> dict[str, torch.Tensor]:
        """Left-padded model inputs for (frames, instruction) rows, as the policy saw them in training."""
        h, w = self.image_size
        frames, prompts = [], []
        for i, (row_frames, instruction) in enumerate(observations):
            if len(row_frames) != self.history_frames + 1:
                raise ValueError(f"observation {i}: {len(row_frames)} frames, the policy takes "
                                 f"{self.history_frames + 1}")
            for j, f in enumerate(row_frames):
                a = self.through_codec(_rgb(f, f"observation {i} frame {j}"))
                if a.shape[:2] != (h, w):
                    a = np.asarray(Image.fromarray(a).resize((w, h), resample=Image.BICUBIC))
                frames.append(a)
            content = [{"type": "image"} for _ in row_frames] + [{"type": "text", "text": instruction}]
            prompts.append(self.tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True))
        vision = self.image_processor(images=frames, return_tensors="np")
        grid = np.asarray(vision["image_grid_thw"], np.int64)
        merge = int(self.image_processor.merge_size)
        image_pad = self.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        rows, k = [], 0
        for text in prompts:
            ids = np.asarray(self.tokenizer.encode(text, add_special_tokens=False), np.int64)
            pads = np.flatnonzero(ids == image_pad)
            repeats = np.ones(len(ids), np.int64)
            repeats[pads] = grid[k:k + len(pads)].prod(axis=1) // merge**2
            k += len(pads)
            rows.append(self._model_ids(np.repeat(ids, repeats)))
        T = max(len(r) for r in rows)
        pad = int(self._model_ids(np.asarray([self.tokenizer.convert_tokens_to_ids(PAD_TOKEN)]))[0])
        ids = np.full((len(rows), T), pad, np.int64)
        mask = np.zeros((len(rows), T), np.int64)
        for b, r in enumerate(rows):
            ids[b, T - len(r):], mask[b, T - len(r):] = r, 1
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)
        return {"input_ids": t(ids), "attention_mask": t(mask),
                "mm_token_type_ids": t((ids == self.model.config.image_token_id).astype(np.int64)),
                "pixel_values": t(vision["pixel_values"]).to(self.model.dtype), "image_grid_thw": t(grid)}

    @torch.no_grad()
    def act_tokens(self, observations: Sequence[Observation], regimes: Sequence[Any], *, greedy: bool = True,
                   temperature: float = 1.0, top_p: float = 1.0) -> np.ndarray:
        """[B, max_action_tokens] model token ids of one action per row, END-padded after each row's END."""
        inputs = self.inputs(observations)
        regime = torch.tensor([regime_of(r) for r in regimes], dtype=torch.long, device=self.device)
        if regime.shape[0] != inputs["input_ids"].shape[0]:
            raise ValueError(f"{len(regimes)} regimes for {inputs['input_ids'].shape[0]} observations")
        T = inputs["input_ids"].shape[1]
        grammar = ActionGrammarProcessor(self.allowed, self.next_state, regime, T)
        sampling = {} if greedy else {"temperature": temperature, "top_p": top_p, "top_k": 0}
        out = self.model.generate(
            **inputs, regime=regime, max_new_tokens=self.max_len, do_sample=not greedy, eos_token_id=self.end,
            pad_token_id=self.end, logits_processor=LogitsProcessorList([grammar]), **sampling)
        tokens = np.full((out.shape[0], self.max_len), self.end, np.int64)
        new = out[:, T:].cpu().numpy()
        tokens[:, :new.shape[1]] = new
        return tokens

    def act(self, observations: Sequence[Observation], regimes: Sequence[Any],
            **kw: Any) -> list[dict[str, Any]]:
        """One env-format action per (frames, instruction) row in that row's regime (``act_tokens`` kw)."""
        actions = []
        for row in self.act_tokens(observations, regimes, **kw):
            n = int(np.flatnonzero(row == self.end)[0]) + 1
            actions.append(decode_action(self.table, row[:n])[0])
        return actions
