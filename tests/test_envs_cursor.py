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


def test_guide_lines_cross_the_whole_frame_at_the_tip_under_the_arrow():
    frame = np.full((360, 640, 3), 90, np.uint8)
    out = draw_cursor(frame, (100, 50), lines=7)
    magenta = (out == (255, 0, 255)).all(axis=-1)
    # Full rows and columns but where the 11x16 arrow covers them.
    rows = np.flatnonzero(magenta.sum(axis=1) >= 640 - 11)
    cols = np.flatnonzero(magenta.sum(axis=0) >= 360 - 16)
    assert rows.tolist() == list(range(47, 54)) and cols.tolist() == list(range(97, 104))  # centred, 7 wide
    # Away from both lines nothing changed; at the tip the arrow is drawn over the lines.
    assert (out[200:, 200:] == 90).all() and (out[50, 100] == 0).all() and (out[55, 101] == 255).all()
    assert (out[0, 100] == (255, 0, 255)).all() and (out[359, 100] == (255, 0, 255)).all()
    assert (out[50, 0] == (255, 0, 255)).all() and (out[50, 639] == (255, 0, 255)).all()
    with pytest.raises(ValueError, match="lines"):
        draw_cursor(frame, (0, 0), lines=-1)


@pytest.mark.parametrize("xy", [(1, 1), (639, 359), (-2, 5)])
def test_guide_lines_are_clipped_at_the_screen_edge(xy):
    frame = np.full((360, 640, 3), 90, np.uint8)
    out = draw_cursor(frame, xy, lines=7)
    magenta = (out == (255, 0, 255)).all(axis=-1)
    x, y = xy
    want_rows = [r for r in range(y - 3, y + 4) if 0 <= r < 360]
    want_cols = [c for c in range(x - 3, x + 4) if 0 <= c < 640]
    assert np.flatnonzero(magenta.sum(axis=1) >= 640 - 11).tolist() == want_rows  # the arrow covers <= 11
    assert np.flatnonzero(magenta.sum(axis=0) >= 360 - 16).tolist() == want_cols


def test_guide_lines_leave_the_slot_under_the_tip_visible():
    frame = np.full((360, 640, 3), 90, np.uint8)
    out = draw_cursor(frame, (300, 200), lines=7, gap=14)
    magenta = (out == (255, 0, 255)).all(axis=-1)
    assert not magenta[186:215, 286:315].any()  # nothing within 14 px of the tip
    assert magenta[200, :286].all() and magenta[200, 315:].all()  # the row's line on both sides of the gap
    assert magenta[:186, 300].all() and magenta[215:, 300].all()  # and the column's
    assert (out[186:215, 286:300] == 90).all()  # left of the tip: the frame (the arrow goes right and down)
    with pytest.raises(ValueError, match="gap"):
        draw_cursor(frame, (0, 0), lines=7, gap=-1)


def test_lines_through_the_previous_pointer_show_only_when_it_moved():
    """``previous`` draws cyan lines through last step's tip under the current magenta ones: a pointer that
    moved shows both crosses (the cyan one across the whole frame, gap and all); one that stayed shows exactly
    the frame it would without ``previous``."""
    frame = np.full((360, 640, 3), 90, np.uint8)
    still = draw_cursor(frame, (300, 200), lines=7, gap=14, previous=(300.2, 199.8))
    assert np.array_equal(still, draw_cursor(frame, (300, 200), lines=7, gap=14))
    moved = draw_cursor(frame, (300, 200), lines=7, gap=14, previous=(100, 50))
    cyan = (moved == (0, 255, 255)).all(axis=-1)
    magenta = (moved == (255, 0, 255)).all(axis=-1)
    assert cyan[50, :86].all() and cyan[50, 115:290].all()  # the previous row, up to the current column
    assert cyan[:36, 100].all() and cyan[65:190, 100].all()
    assert not cyan[36:65, 86:115].any()  # the previous tip's slot is left visible too
    assert magenta[200, :286].all() and magenta[:186, 300].all()  # the current lines drawn over the cyan ones
    assert not (cyan & magenta).any() and (moved[220:, 320:] == 90).all()
    assert np.array_equal(draw_cursor(frame, (300, 200), previous=(100, 50)), draw_cursor(frame, (300, 200)))
