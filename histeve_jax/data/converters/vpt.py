"""OpenAI VPT contractor data (``<name>.mp4`` + ``<name>.jsonl`` per segment) into record shards.

The json-to-action rules follow VPT's ``data_loader.py`` / ``run_inverse_dynamics_model.py`` (as MineStudio
ships them in ``minestudio/data/minecraft/tools/``):
- keys through ``KEYBOARD_BUTTON_MAPPING``; mouse buttons 0/1/2 are attack/use/pickItem;
- camera = ``[dy, dx] * CAMERA_SCALER`` degrees (0.15 degrees per recorded pixel), kept as floats as
  MineStudio's data tools (``process_action_openai.py``) keep them; its ``vpt_lib`` and IDM translators
  write them into an integer array, truncating toward zero (a 1-pixel move is 0 degrees there): a
  deliberate deviation, recorded in ``tests/test_converters.py``;
- the attack-stuck fix: if the first step reports ``newButtons == [0]`` attack is held from the start of the
  recording, and it is ignored until the player presses attack again;
- a hotbar change (scroll wheel, not recorded as a key) sets the ``hotbar.N`` key of the new slot;
- null actions (no mapped key, no mouse motion, no button) are dropped, but their frame is still read so the
  video stays aligned with the json;
- while a GUI is open the cursor image is drawn onto the frame at ``mouse.x/y * height / 720``.
Keys our action space does not have (ESC, swapHands, pickItem) are dropped after the null test, as VPT does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from histeve_jax.data import records as R
from histeve_jax.data.converters import ConversionStats

KEYBOARD_BUTTON_MAPPING = {
    "key.keyboard.escape": "ESC",
    "key.keyboard.s": "back",
    "key.keyboard.q": "drop",
    "key.keyboard.w": "forward",
    **{f"key.keyboard.{i}": f"hotbar.{i}" for i in range(1, 10)},
    "key.keyboard.e": "inventory",
    "key.keyboard.space": "jump",
    "key.keyboard.a": "left",
    "key.keyboard.d": "right",
    "key.keyboard.left.shift": "sneak",
    "key.keyboard.left.control": "sprint",
    "key.keyboard.f": "swapHands",
}
CAMERA_SCALER = 360.0 / 2400.0
MINEREC_ORIGINAL_HEIGHT_PX = 720


def json_action_to_env_action(step: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """One jsonl line -> (env-format action over ``BINARY_KEYS`` + camera, is_null_action), as VPT does."""
    action: dict[str, Any] = {k: 0 for k in R.BINARY_KEYS}
    is_null = True
    for key in step["keyboard"]["keys"]:
        if key in KEYBOARD_BUTTON_MAPPING:
            name = KEYBOARD_BUTTON_MAPPING[key]
            if name in action:
                action[name] = 1
            is_null = False  # ESC / swapHands count as input in VPT even though we drop them
    mouse = step["mouse"]
    camera = [mouse["dy"] * CAMERA_SCALER, mouse["dx"] * CAMERA_SCALER]
    if mouse["dx"] != 0 or mouse["dy"] != 0:
        is_null = False
    else:
        camera = [0.0 if abs(c) > 180 else c for c in camera]
    buttons = mouse["buttons"]
    if 0 in buttons:
        action["attack"] = 1
        is_null = False
    if 1 in buttons:
        action["use"] = 1
        is_null = False
    if 2 in buttons:  # pickItem: not in our action space, but not a null action either
        is_null = False
    action["camera"] = [float(camera[0]), float(camera[1])]
    return action, is_null


def _cursor_sprite() -> tuple[np.ndarray, np.ndarray]:
    """The 16x16 white cursor VPT draws (RGB, alpha in [0, 1]); MineStudio ships the png."""
    path = None
    try:
        import minestudio.data.minecraft.tools as tools_pkg

        path = os.path.join(os.path.dirname(tools_pkg.__file__), "cursors", "mouse_cursor_white_16x16.png")
    except ImportError:
        pass
    if path and os.path.exists(path):
        from PIL import Image

        rgba = np.asarray(Image.open(path).convert("RGBA"))[:16, :16]
        return rgba[..., :3], rgba[..., 3:] / 255.0
    # Without MineStudio: a plain white arrow with a dark outline, same size and anchor (top left).
    yy, xx = np.mgrid[0:16, 0:16]
    inside = (xx <= yy) & (yy < 12)
    alpha = inside.astype(np.float64)[..., None]
    rgb = np.where(inside[..., None], 255, 0).astype(np.uint8).repeat(3, -1)
    return rgb, alpha


def composite_cursor(frame: np.ndarray, x: int, y: int, sprite: tuple[np.ndarray, np.ndarray]) -> None:
    """Alpha-blend the cursor onto ``frame`` (in place) with its top-left corner at (x, y), as VPT does."""
    image, alpha = sprite
    ch = max(0, min(frame.shape[0] - y, image.shape[0]))
    cw = max(0, min(frame.shape[1] - x, image.shape[1]))
    if ch == 0 or cw == 0:
        return
    a = alpha[:ch, :cw]
    frame[y:y + ch, x:x + cw, :] = (frame[y:y + ch, x:x + cw, :] * (1 - a) + image[:ch, :cw, :] * a).astype(
        np.uint8)


def read_video_frames(path: str) -> Iterator[np.ndarray]:
    """Decode an mp4 to HxWx3 uint8 RGB frames."""
    import av

    with av.open(path) as container:
        for frame in container.decode(video=0):
            yield frame.to_ndarray(format="rgb24")


def segment_paths(input_dir: str | os.PathLike) -> list[tuple[str, str, str]]:
    """(name, mp4, jsonl) for every segment in ``input_dir`` that has both files, in name order."""
    d = os.fspath(input_dir)
    if not os.path.isdir(d):
        raise FileNotFoundError(f"VPT input directory {d} does not exist")
    names = sorted(f[:-len(".jsonl")] for f in os.listdir(d) if f.endswith(".jsonl"))
    return [(n, os.path.join(d, n + ".mp4"), os.path.join(d, n + ".jsonl"))
            for n in names if os.path.exists(os.path.join(d, n + ".mp4"))]


def convert_segment(name: str, mp4_path: str, jsonl_path: str, *, instruction: str, task_id: str,
                    frame_format: str = "jpeg", resize: Sequence[int] | None = None,
                    stats: ConversionStats | None = None) -> list[R.StepRecord]:
    """One contractor segment -> the records of one episode (null actions dropped). Raises RecordError.

    ``resize`` is (W, H), as the command line's ``WxH``; the GUI cursor is scaled with the frame.
    """
    with open(jsonl_path) as f:
        try:
            steps = [json.loads(line) for line in f if line.strip()]
        except json.JSONDecodeError as e:
            raise R.RecordError(f"{jsonl_path}: broken jsonl line: {e}") from e
    sprite = _cursor_sprite()
    frames = read_video_frames(mp4_path)
    out: list[R.StepRecord] = []
    attack_stuck = False
    last_hotbar = 0
    for i, step in enumerate(steps):
        try:
            mouse = step["mouse"]
            if i == 0:
                attack_stuck = mouse.get("newButtons") == [0]
            elif attack_stuck and 0 in mouse.get("newButtons", []):
                attack_stuck = False
            if attack_stuck:
                mouse = {**mouse, "buttons": [b for b in mouse["buttons"] if b != 0]}
                step = {**step, "mouse": mouse}
            action, is_null = json_action_to_env_action(step)
            hotbar = step["hotbar"]
            if hotbar != last_hotbar:
                action[f"hotbar.{hotbar + 1}"] = 1
            last_hotbar = hotbar
            gui = bool(step["isGuiOpen"])
        except (KeyError, TypeError) as e:
            raise R.RecordError(f"{jsonl_path} line {i + 1}: missing or malformed field {e}") from e
        frame = next(frames, None)  # read even for null actions so the video stays aligned
        if frame is None:
            raise R.RecordError(f"{mp4_path}: video has fewer frames than {jsonl_path} has lines ({i})")
        if is_null:
            if stats is not None:
                stats.filtered_steps += 1
            continue
        cursor = None
        if gui:
            scale = frame.shape[0] / MINEREC_ORIGINAL_HEIGHT_PX
            cx, cy = int(mouse["x"] * scale), int(mouse["y"] * scale)
            frame = frame.copy()
            composite_cursor(frame, cx, cy, sprite)
            cursor = [float(cx), float(cy)]
        if resize is not None:
            from PIL import Image

            w, h = int(resize[0]), int(resize[1])
            if cursor is not None:
                cursor = [cursor[0] * w / frame.shape[1], cursor[1] * h / frame.shape[0]]
            frame = np.asarray(Image.fromarray(frame).resize((w, h), Image.BILINEAR))
        out.append(R.StepRecord(
            episode_id=name, step=len(out), task_id=task_id, kind="demo", instruction=instruction,
            frame=R.encode_frame(frame, frame_format), frame_format=frame_format, action=action,
            is_gui_open=gui, cursor=cursor,
            metadata={"source": "vpt", "source_frame": i, "yaw": step.get("yaw"), "pitch": step.get("pitch"),
                      "hotbar": hotbar}))
    if out:
        out[-1].done = True
    return out


def convert_directory(input_dir: str | os.PathLike, output_dir: str | os.PathLike, *,
                      instruction: str = "", task_id: str = "vpt", frame_format: str = "jpeg",
                      resize: Sequence[int] | None = None, records_per_shard: int = 2048,
                      prefix: str = "vpt") -> ConversionStats:
    """Convert every segment of a contractor directory; a broken segment is skipped and counted."""
    stats = ConversionStats()
    with R.ShardWriter(output_dir, prefix=prefix, records_per_shard=records_per_shard) as writer:
        for name, mp4, jsonl in segment_paths(input_dir):
            try:
                recs = convert_segment(name, mp4, jsonl, instruction=instruction, task_id=task_id,
                                       frame_format=frame_format, resize=resize, stats=stats)
            except R.RecordError as e:
                stats.skip(f"segment: {e}")
                continue
            except Exception as e:  # av raises its own error types on corrupt video
                stats.skip(f"segment {name}: {type(e).__name__}: {e}")
                continue
            if not recs:
                stats.skip("segment with only null actions")
                continue
            writer.write_episode(recs)
            stats.episodes += 1
            stats.records += len(recs)
    stats.shards = list(writer.paths)
    return stats


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m histeve_jax.data.converters.vpt INPUT_DIR OUTPUT_DIR [--instruction ...]``."""
    import argparse

    ap = argparse.ArgumentParser(description="VPT contractor segments (.mp4 + .jsonl) -> record shards")
    ap.add_argument("input_dir")
    ap.add_argument("output_dir")
    ap.add_argument("--instruction", default="", help="the instruction of every episode (e.g. the task)")
    ap.add_argument("--task-id", default="vpt")
    ap.add_argument("--resize", default="", help="WxH to store frames at, e.g. 448x252")
    ap.add_argument("--frame-format", default="jpeg", choices=R.FRAME_FORMATS)
    a = ap.parse_args(argv)
    resize = tuple(int(v) for v in a.resize.lower().split("x")) if a.resize else None
    stats = convert_directory(a.input_dir, a.output_dir, instruction=a.instruction, task_id=a.task_id,
                              frame_format=a.frame_format, resize=resize)
    print(f"episodes={stats.episodes} records={stats.records} null_actions_dropped={stats.filtered_steps} "
          f"skipped={dict(stats.skipped)} shards={len(stats.shards)}")


if __name__ == "__main__":
    main()
