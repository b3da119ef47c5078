"""Converters: VPT contractor segments, MineStudio LMDB chunks and world-knowledge JSON(L) into records.

Every test writes small files in the source format, converts them, and reads the shards back.
"""

import io
import json
import os
import pickle

import numpy as np
import pytest

from histeve_jax.data import records as R
from histeve_jax.data.converters import minestudio_lmdb, vpt, world_knowledge

H, W = 72, 128  # VPT scales the cursor by height / 720, so 72 px high gives a scale of exactly 0.1


def _mp4_bytes(frames: list[np.ndarray], fps: int = 20) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("h264", rate=fps)
        s.width, s.height, s.pix_fmt = frames[0].shape[1], frames[0].shape[0], "yuv420p"
        for fr in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(fr, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def _line(keys=(), dx=0.0, dy=0.0, buttons=(), new_buttons=(), hotbar=0, gui=False, x=0.0, y=0.0):
    return {"mouse": {"x": x, "y": y, "dx": dx, "dy": dy, "buttons": list(buttons),
                      "newButtons": list(new_buttons), "dwheel": 0},
            "keyboard": {"keys": [f"key.keyboard.{k}" for k in keys], "newKeys": [], "chars": ""},
            "isGuiOpen": gui, "hotbar": hotbar, "yaw": 1.0, "pitch": 2.0, "tick": 0}


def _write_vpt_segment(d, name, lines, n_frames=None):
    frames = [np.full((H, W, 3), 30, np.uint8) for _ in range(n_frames or len(lines))]
    with open(os.path.join(d, name + ".mp4"), "wb") as f:
        f.write(_mp4_bytes(frames))
    with open(os.path.join(d, name + ".jsonl"), "w") as f:
        f.write("\n".join(json.dumps(line) for line in lines) + "\n")


def _noop(**over):
    a = {k: 0 for k in R.BINARY_KEYS}
    a["camera"] = [0.0, 0.0]
    a.update(over)
    return a


def test_vpt_actions_follow_vpt_data_loader(tmp_path):
    src = tmp_path / "vpt"
    src.mkdir()
    lines = [
        _line(buttons=[0], new_buttons=[0], keys=["w"]),  # attack held from the start: stuck, ignored
        _line(buttons=[0]),                               # still stuck and nothing else: a null action
        _line(keys=["w", "left.control"], dx=10, dy=-4),  # camera = [dy, dx] * 0.15
        _line(buttons=[0], new_buttons=[0]),              # attack pressed again: no longer stuck
        _line(keys=["space"], hotbar=2),                  # scroll to slot 3: hotbar.3
        _line(keys=["e"], hotbar=2, gui=True, x=300, y=200, dx=3),  # GUI open: cursor drawn at (30, 20)
        _line(keys=["escape"], hotbar=2),                 # ESC is input (not null) but not in our space
        _line(buttons=[2], hotbar=2),                     # pickItem, likewise
    ]
    _write_vpt_segment(src, "seg-1", lines)
    out = tmp_path / "shards"
    stats = vpt.convert_directory(src, out, instruction="chop a tree", task_id="mine_log", frame_format="png")
    assert (stats.episodes, stats.records, stats.filtered_steps) == (1, 7, 1)
    recs = list(R.read_shard(stats.shards[0]))
    assert [r.step for r in recs] == list(range(7))
    assert [r.metadata["source_frame"] for r in recs] == [0, 2, 3, 4, 5, 6, 7]
    assert recs[0].action == _noop(forward=1)
    assert recs[1].action == _noop(forward=1, sprint=1, camera=[-4 * 0.15, 10 * 0.15])
    assert recs[2].action == _noop(attack=1)
    assert recs[3].action == _noop(jump=1, **{"hotbar.3": 1})
    assert recs[4].action == _noop(inventory=1, camera=[0.0, 3 * 0.15])
    assert recs[5].action == _noop() and recs[6].action == _noop()
    assert [r.is_gui_open for r in recs] == [False, False, False, False, True, False, False]
    assert recs[4].cursor == [30.0, 20.0] and recs[3].cursor is None
    assert recs[-1].done and not recs[0].done
    assert recs[0].instruction == "chop a tree" and recs[0].task_id == "mine_log"
    # the white cursor is drawn at (30, 20) on the GUI frame only
    gui_frame, plain = R.decode_frame(recs[4].frame), R.decode_frame(recs[3].frame)
    assert gui_frame[20:26, 30:33].mean() > 150 and plain[20:26, 30:33].mean() < 60
    assert np.abs(gui_frame[50:, 80:].astype(int) - plain[50:, 80:]).max() <= 2  # nothing else changed


def _minestudio_json_to_action(module: str, integer_camera: bool):
    """MineStudio's own ``json_action_to_env_action`` from ``module`` (a file under its package), compiled out
    of its source with the module's tables: the data tools import cv2 and lightning, absent here."""
    import ast
    import importlib.util
    from pathlib import Path

    path = Path(importlib.util.find_spec("minestudio").submodule_search_locations[0]) / module
    src = path.read_text()
    tree = ast.parse(src)
    fn_node = next(n for n in tree.body
                   if isinstance(n, ast.FunctionDef) and n.name == "json_action_to_env_action")
    tables = [n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") in
              ("KEYBOARD_BUTTON_MAPPING", "NOOP_ACTION", "CAMERA_SCALER")]
    fn_src = ast.get_source_segment(src, fn_node)
    # The two families differ exactly here: the array the degrees are written into.
    assert ("np.array([0, 0])" if integer_camera else "np.array([0., 0.])") in fn_src
    code = "import numpy as np\n" + "\n".join(ast.get_source_segment(src, n) for n in tables) + "\n" + fn_src
    scope: dict = {}
    exec(compile(code, str(path), "exec"), scope)
    fn = scope["json_action_to_env_action"]

    def camera(line):
        out = fn(line)  # (action, is_null) in the data tools, the action alone in vpt_lib
        return (out[0] if isinstance(out, tuple) else out)["camera"]

    return camera


def test_vpt_camera_keeps_float_degrees_where_minestudios_idm_translator_truncates():
    """A deliberate deviation: our converter keeps camera = [dy, dx] * 0.15 as floats, as MineStudio's data
    tools do (process_action_openai.py); its IDM/VPT-lib translators write the degrees into an integer
    array, which truncates them toward zero (a 1-pixel move becomes 0 degrees)."""
    lines = [_line(dx=1, dy=0), _line(dx=7, dy=-3), _line(dx=-13, dy=20), _line(keys=["w"], dx=0.5, dy=-0.25)]
    ours = np.asarray([vpt.json_action_to_env_action(line)[0]["camera"] for line in lines])
    data_tools = _minestudio_json_to_action("data/minecraft/tools/process_action_openai.py", False)
    truncating = [_minestudio_json_to_action(m, True) for m in (
        "utils/vpt_lib/action_translator.py", "data/minecraft/tools/idm_lib/run_inverse_dynamics_model.py")]
    np.testing.assert_array_equal(ours, [data_tools(line) for line in lines])
    for translate in truncating:
        theirs = np.asarray([translate(line) for line in lines])
        np.testing.assert_array_equal(theirs, np.trunc(ours))  # the recorded deviation, element by element
    np.testing.assert_allclose(ours[:3], [[0.0, 0.15], [-0.45, 1.05], [3.0, -1.95]])
    assert (np.trunc(ours[:3]) == [[0, 0], [0, 1], [3, -1]]).all()


def test_vpt_resize_is_width_by_height_and_scales_the_cursor(tmp_path):
    src = tmp_path / "vpt"
    src.mkdir()
    _write_vpt_segment(src, "seg", [_line(keys=["e"], gui=True, x=300, y=200)])  # cursor at (30, 20)
    stats = vpt.convert_directory(src, tmp_path / "out", resize=(64, 36), frame_format="png")
    (rec,) = list(R.read_shard(stats.shards[0]))
    assert R.decode_frame(rec.frame).shape == (36, 64, 3)
    assert rec.cursor == [15.0, 10.0]


def test_vpt_skips_broken_segments_and_counts_them(tmp_path):
    src = tmp_path / "vpt"
    src.mkdir()
    _write_vpt_segment(src, "good", [_line(keys=["w"])] * 3)
    _write_vpt_segment(src, "short_video", [_line(keys=["w"])] * 4, n_frames=2)
    _write_vpt_segment(src, "no_mouse", [{"keyboard": {"keys": []}, "isGuiOpen": False, "hotbar": 0}])
    (src / "bad_json.jsonl").write_text("{not json\n")
    (src / "bad_json.mp4").write_bytes(b"")
    stats = vpt.convert_directory(src, tmp_path / "out")
    assert stats.episodes == 1 and stats.records == 3
    assert sum(stats.skipped.values()) == 3
    assert any("fewer frames" in k for k in stats.skipped)
    assert any("mouse" in k for k in stats.skipped)


def _write_minestudio_lmdb(root, episodes, chunk_size=4, part="part-1"):
    """Write the layout MineStudio's tools/convertion.py produces: <modality>/part-1 LMDB environments."""
    import lmdb

    for modality in ("image", "action", "meta_info"):
        (root / modality / part).mkdir(parents=True)
        env = lmdb.open(str(root / modality / part), map_size=1 << 26)
        infos = []
        with env.begin(write=True) as txn:
            for idx, (name, frames, actions, metas) in enumerate(episodes):
                n = len(frames)
                for start in range(0, n, chunk_size):
                    sl = slice(start, start + chunk_size)
                    if modality == "image":
                        val = _mp4_bytes(frames[sl])
                    elif modality == "action":
                        val = pickle.dumps({k: v[sl] for k, v in actions.items()})
                    else:
                        val = pickle.dumps(metas[sl])
                    txn.put(str((idx, start)).encode(), val)
                infos.append({"episode": name, "episode_idx": idx, "num_frames": n})
            meta = {"__chunk_size__": chunk_size, "__chunk_infos__": infos, "__num_episodes__": len(infos),
                    "__num_total_frames__": sum(i["num_frames"] for i in infos)}
            for k, v in meta.items():
                txn.put(k.encode(), pickle.dumps(v))
        env.close()


def _minestudio_episode(name, n, seed):
    rng = np.random.default_rng(seed)
    frames = [np.full((H, W, 3), 20 + 20 * t, np.uint8) for t in range(n)]
    actions = {k: rng.integers(0, 2, n).astype(np.int64) for k in R.BINARY_KEYS}
    actions.update({"ESC": np.zeros(n, np.int64), "swapHands": np.zeros(n, np.int64),
                    "pickItem": np.zeros(n, np.int64)})
    actions["camera"] = rng.uniform(-10, 10, (n, 2)).astype(np.float32)
    metas = [{"isGuiOpen": t >= n // 2, "cursor_x": 10 + t, "cursor_y": 5, "yaw": 0.5 * t, "pitch": 0.0,
              "isGuiInventory": t >= n // 2} for t in range(n)]
    return name, frames, actions, metas


def test_minestudio_lmdb_round_trip(tmp_path):
    eps = [_minestudio_episode("ep_a", 8, 0), _minestudio_episode("ep_b", 4, 1)]
    _write_minestudio_lmdb(tmp_path / "ds", eps)
    stats = minestudio_lmdb.convert_dataset(tmp_path / "ds", tmp_path / "out", instruction="craft a table",
                                            frame_format="png")
    assert (stats.episodes, stats.records) == (2, 12)
    recs = [r for p in stats.shards for r in R.read_shard(p)]
    by_ep = {}
    for r in recs:
        by_ep.setdefault(r.episode_id, []).append(r)
    for name, frames, actions, metas in eps:
        got = by_ep[name]
        assert [r.step for r in got] == list(range(len(frames)))
        for t, r in enumerate(got):
            assert all(r.action[k] == int(actions[k][t]) for k in R.BINARY_KEYS)
            np.testing.assert_allclose(r.action["camera"], actions["camera"][t], rtol=1e-6)
            assert r.is_gui_open == metas[t]["isGuiOpen"]
            assert r.cursor == ([10.0 + t, 5.0] if metas[t]["isGuiOpen"] else None)
            assert abs(float(R.decode_frame(r.frame).mean()) - (20 + 20 * t)) < 3  # right frame, in order
            assert r.metadata["yaw"] == 0.5 * t
        assert got[-1].done and not got[0].done


def test_minestudio_lmdb_parts_with_different_chunk_sizes(tmp_path):
    eps_a, eps_b = [_minestudio_episode("ep_a", 8, 0)], [_minestudio_episode("ep_b", 6, 1)]
    _write_minestudio_lmdb(tmp_path / "ds", eps_a, chunk_size=4, part="part-1")
    _write_minestudio_lmdb(tmp_path / "ds", eps_b, chunk_size=3, part="part-2")
    stats = minestudio_lmdb.convert_dataset(tmp_path / "ds", tmp_path / "out")
    assert (stats.episodes, stats.records) == (2, 14) and not stats.skipped
    recs = [r for p in stats.shards for r in R.read_shard(p)]
    for name, frames, actions, _ in eps_a + eps_b:
        got = [r for r in recs if r.episode_id == name]
        assert [r.step for r in got] == list(range(len(frames)))
        np.testing.assert_allclose([r.action["camera"] for r in got], actions["camera"], rtol=1e-6)


def test_minestudio_lmdb_skips_episode_with_missing_action_key(tmp_path):
    good = _minestudio_episode("good", 4, 0)
    bad = _minestudio_episode("bad", 4, 1)
    del bad[2]["sneak"]
    _write_minestudio_lmdb(tmp_path / "ds", [good, bad])
    stats = minestudio_lmdb.convert_dataset(tmp_path / "ds", tmp_path / "out")
    assert stats.episodes == 1
    assert any("sneak" in k for k in stats.skipped)


def test_minestudio_lmdb_missing_modality_is_a_clear_error(tmp_path):
    (tmp_path / "ds" / "image").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="action"):
        minestudio_lmdb.convert_dataset(tmp_path / "ds", tmp_path / "out")


def test_world_knowledge_all_three_shapes(tmp_path):
    from PIL import Image

    (tmp_path / "imgs").mkdir()
    img = np.random.default_rng(0).integers(0, 255, (16, 24, 3), dtype=np.uint8)
    Image.fromarray(img).save(tmp_path / "imgs" / "1.png")
    Image.fromarray(img).save(tmp_path / "imgs" / "2.jpg", quality=90)
    Image.fromarray(img).save(tmp_path / "imgs" / "3.bmp")
    (tmp_path / "imgs" / "broken.jpg").write_bytes(b"\xff\xd8\xff garbage")
    samples = [
        {"image": "imgs/1.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat block is this?"}, {"from": "gpt", "value": "Oak log."},
            {"from": "human", "value": "What does it drop?"}, {"from": "gpt", "value": "Itself."}]},
        {"image": "imgs/2.jpg", "question": "Is it night?", "answer": "No."},
        {"image": "imgs/3.bmp", "caption": "A forest."},
        {"image": "imgs/missing.png", "caption": "x"},
        {"image": "imgs/broken.jpg", "caption": "x"},
        {"image": "imgs/1.png"},
    ]
    malformed = [  # wrong types are skipped and counted, not a crash of the whole file
        {"image": "imgs/1.png", "caption": 3},
        {"image": "imgs/1.png", "conversations": ["hi", "there"]},
        {"image": "imgs/1.png", "conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]},
        {"image": 7, "caption": "x"},
    ]
    path = tmp_path / "mc_vqa.jsonl"
    path.write_text("\n".join(json.dumps(s) for s in samples + malformed) + "\nnot json\n")
    stats = world_knowledge.convert_file(path, tmp_path / "out")
    assert stats.records == 4 and sum(stats.skipped.values()) == 4 + len(malformed)
    recs = [r for p in stats.shards for r in R.read_shard(p)]
    assert [(r.instruction, r.response) for r in recs] == [
        ("What block is this?", "Oak log."), ("What does it drop?", "Itself."), ("Is it night?", "No."),
        (world_knowledge.CAPTION_PROMPT, "A forest.")]
    assert all(r.kind == "world_knowledge" and r.step == 0 and r.task_id == "mc_vqa" for r in recs)
    assert [r.frame_format for r in recs] == ["png", "png", "jpeg", "png"]
    np.testing.assert_array_equal(R.decode_frame(recs[0].frame), img)  # png kept lossless
    np.testing.assert_array_equal(R.decode_frame(recs[3].frame), img)  # bmp re-encoded as png
    # a .json list works the same way
    (tmp_path / "list.json").write_text(json.dumps(samples[1:3]))
    assert world_knowledge.convert_file(tmp_path / "list.json", tmp_path / "out2").records == 2
    (tmp_path / "bad.json").write_text("[{")
    with pytest.raises(R.RecordError, match="bad.json: not valid JSON"):
        world_knowledge.convert_file(tmp_path / "bad.json", tmp_path / "out3")
