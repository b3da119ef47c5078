"""The pointer drawn into GUI observations: its tip at the cursor, its size, clipping at the screen edge."""

from __future__ import annotations

import numpy as np
import pytest

from histeve_jax.envs.cursor import draw_cursor


def test_the_arrow_tip_is_at_the_cursor_and_the_frame_is_left_alone():
    frame = np.full((360, 640, 3), 90, np.uint8)
    out = draw_cursor(frame, (100, 50))
    assert (frame == 90).all() and out is not frame
    changed = np.argwhere((out != 90).any(axis=-1))
    assert changed.min(axis=0).tolist() == [50, 100]  # the tip is the top-left of the arrow
    assert changed.max(axis=0).tolist() == [65, 110]  # 16 rows, 11 columns
    assert (out[55, 101] == 255).all() and (out[50, 100] == 0).all()  # white fill, black outline
    assert draw_cursor(frame, None) is frame


def test_a_scaled_arrow_is_the_sprite_with_each_pixel_a_block():
    frame = np.zeros((360, 640, 3), np.uint8)
    one = (draw_cursor(frame + 90, (0, 0)) != 90).any(-1)[:16, :16]
    two = (draw_cursor(frame + 90, (0, 0), scale=2) != 90).any(-1)[:32, :32]
    assert np.array_equal(two, np.kron(one, np.ones((2, 2), bool)))
    with pytest.raises(ValueError, match="scale"):
        draw_cursor(frame, (0, 0), scale=0)


@pytest.mark.parametrize("xy", [(635, 355), (-5, -5), (700, 10)])
def test_the_arrow_is_clipped_at_the_screen_edge(xy):
    frame = np.full((360, 640, 3), 90, np.uint8)
    out = draw_cursor(frame, xy)
    visible = xy[0] < 640 and xy[1] < 360
    assert ((out != 90).any() == visible) and out.shape == frame.shape
