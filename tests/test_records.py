"""The record schema: round trips, the layout rules readers rely on, and clear errors."""

import os

import numpy as np
import pytest

from histeve_jax.data import records as R


def _episode(eid: str, n: int, gui_from: int = 10**9) -> list[R.StepRecord]:
    rng = np.random.default_rng(0)
    out = []
    for t in range(n):
        img = rng.integers(0, 255, size=(8, 12, 3), dtype=np.uint8)
        action = {k: int(k == "forward") for k in R.BINARY_KEYS}
        action["camera"] = [0.5 * t, -1.0]
        out.append(R.StepRecord(
            episode_id=eid, step=t, task_id="mine_log", kind="demo", instruction="chop a tree",
            frame=R.encode_frame(img, "png"), frame_format="png", action=action, is_gui_open=t >= gui_from,
            cursor=[1.0, 2.0] if t >= gui_from else None, events={"mine_block": {"default:tree": t}},
            done=t == n - 1, metadata={"seed": 3}))
    return out


def test_round_trip_keeps_every_field(tmp_path):
    ep = _episode("e0", 3, gui_from=1)
    paths = R.write_episodes(tmp_path, [ep])
    got = list(R.read_shard(paths[0]))
    assert got == ep
    assert np.array_equal(R.decode_frame(got[2].frame).shape, (8, 12, 3))


def test_png_frames_are_lossless():
    img = np.random.default_rng(1).integers(0, 255, size=(36, 64, 3), dtype=np.uint8)
    assert np.array_equal(R.decode_frame(R.encode_frame(img, "png")), img)


def test_episodes_never_span_shards_and_history_is_contiguous(tmp_path):
    eps = [_episode(f"e{i}", n) for i, n in enumerate([5, 3, 7, 2])]
    paths = R.write_episodes(tmp_path, eps, records_per_shard=6)
    per_shard = [list(R.read_shard(p)) for p in paths]
    assert [len(s) for s in per_shard] == [8, 7, 2]  # a shard closes only between episodes
    flat = [r for s in per_shard for r in s]
    for j, r in enumerate(flat):  # the history rule: j - step .. j is the same episode, in order
        window = flat[j - r.step: j + 1]
        assert [w.episode_id for w in window] == [r.episode_id] * (r.step + 1)
        assert [w.step for w in window] == list(range(r.step + 1))


def test_crashed_writer_leaves_no_shard_under_a_final_name(tmp_path):
    w = R.ShardWriter(tmp_path, records_per_shard=4)
    w.write_episode(_episode("a", 4))
    w.write_episode(_episode("b", 2))  # closes shard 0, opens shard 1
    # no close(): the process "dies" here
    assert [os.path.basename(p) for p in R.shard_paths(tmp_path)] == ["data-00000.array_record"]
    assert len(list(R.read_shard(R.shard_paths(tmp_path)[0]))) == 4


def test_appending_writer_keeps_earlier_shards(tmp_path):
    first = R.write_episodes(tmp_path, [_episode("a", 2)])
    second = R.write_episodes(tmp_path, [_episode("b", 2)])
    assert first != second
    assert [len(list(R.read_shard(p))) for p in R.shard_paths(tmp_path)] == [2, 2]


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.pop("instruction"), "instruction"),
    (lambda d: d.update(kind="movie"), "kind"),
    (lambda d: d.update(extra=1), "extra"),
    (lambda d: d.update(step=-1), "step"),
    (lambda d: d.update(action={**d["action"], "camera": 1.0}), "action"),
])
def test_bad_records_name_the_field(mutate, field):
    d = _episode("e", 1)[0].__dict__.copy()
    mutate(d)
    with pytest.raises(R.RecordError, match=field):
        R.serialize(d)


def test_garbage_bytes_and_bad_frames_raise_record_error():
    with pytest.raises(R.RecordError):
        R.deserialize(b"\xc1\x00garbage")
    with pytest.raises(R.RecordError, match="decode"):
        R.decode_frame(b"not an image")


def test_write_episode_rejects_out_of_order_steps(tmp_path):
    ep = _episode("e", 3)
    ep[1], ep[2] = ep[2], ep[1]
    with pytest.raises(R.RecordError, match="steps"):
        R.write_episodes(tmp_path, [ep])


def test_appending_after_a_gap_never_replaces_a_closed_shard(tmp_path):
    R.write_episodes(tmp_path, [_episode("a", 2)], records_per_shard=2)
    R.write_episodes(tmp_path, [_episode("b", 3)], records_per_shard=2)
    os.remove(tmp_path / "data-00000.array_record")  # a gap: one shard left, at index 1
    R.write_episodes(tmp_path, [_episode("c", 1)])
    names = [os.path.basename(p) for p in R.shard_paths(tmp_path)]
    assert names == ["data-00001.array_record", "data-00002.array_record"]
    assert [[r.episode_id for r in R.read_shard(p)][0] for p in R.shard_paths(tmp_path)] == ["b", "c"]
