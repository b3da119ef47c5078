"""The GUI mouse pointer drawn into observations, as a person sees it on screen.

Screen captures do not hold the pointer: the X server (Luanti under Xvfb) and Minecraft's framebuffer both
draw it outside the frame that is grabbed. A policy that moves the cursor between inventory slots must see
where it is, so ``LuantiEnv`` pastes this arrow at ``info["cursor"]`` into every GUI frame before resizing,
as VPT's data loader does for its contractor frames (a 16x16 arrow at the 640x360 render).

A policy's frames are the render shrunk 3-6 times, so the arrow comes out a few pixels across, inside one
vision patch of a frame whose other patches do not change while it moves, and a tiny policy trained from
scratch did not learn to read it (README "The GUI": a loss plateau that a full batch leaves and minibatches
of 8 do not). ``lines`` adds guide lines through the tip, one horizontal and one vertical across the whole
frame (magenta, a colour the game's GUI does not use), so every row and column of visual tokens that the
pointer's row and column cross changes with it, as a screen magnifier's cross-hair cursor does for a person
who cannot see a small pointer; ``gap`` keeps them off the slot under the tip, whose item the policy must
see. The env draws the 16 px arrow (``cursor_scale=1``) over 7 px lines that stop 14 px from the tip.

``previous`` draws the same lines, cyan, through where the tip was a step before, under the current ones: a
pointer that did not move hides them, one that moved shows both crosses. A click changes a few dozen pixels
of a 112x196 frame (a stack under the pointer and one held at it look alike), so what tells a policy that it
has already clicked on a slot is that the pointer arrived there a step ago and has not moved since; across
two frames a tiny policy learnt that in one run of the main job and not in the next (README "The GUI"),
while in one frame it is the cyan cross being there or not.
"""

from __future__ import annotations

import numpy as np

# A 16x16 arrow, tip at (0, 0): 'X' black outline, 'o' white fill (the system pointer's look).
_ARROW = (
    "X...............",
    "XX..............",
    "XoX.............",
    "XooX............",
    "XoooX...........",
    "XooooX..........",
    "XoooooX.........",
    "XooooooX........",
    "XoooooooX.......",
    "XooooooooX......",
    "XoooooXXXXX.....",
    "XooXooX.........",
    "XoX.XooX........",
    "XX..XooX........",
    "X....XooX.......",
    ".....XXXX.......",
)
_OUTLINE = np.array([[c == "X" for c in row] for row in _ARROW])
_FILL = np.array([[c == "o" for c in row] for row in _ARROW])


LINE_RGB = (255, 0, 255)
PREVIOUS_RGB = (0, 255, 255)  # lines through last step's tip (cyan: not a colour of the game's GUI either)


def draw_cursor(
    frame: np.ndarray, cursor: tuple[float, float] | None, scale: int = 1, lines: int = 0, gap: int = 0,
    previous: tuple[float, float] | None = None,
) -> np.ndarray:
    """A copy of ``frame`` (HxWx3 uint8, render pixels) with the arrow's tip at ``cursor`` (x, y), each
    sprite pixel drawn as ``scale`` x ``scale``, over guide lines ``lines`` pixels wide through the tip
    across the frame (0: none) that leave out the ``gap`` px on each side of the tip, so that what lies under
    the pointer stays visible, and over the same lines in ``PREVIOUS_RGB`` through ``previous`` (the tip a
    step before; None: none); the frame itself when ``cursor`` is None. Parts of the arrow and lines off the
    screen are clipped."""
    if cursor is None:
        return frame
    if lines < 0 or gap < 0:
        raise ValueError(f"draw_cursor: lines and gap must be >= 0, got lines={lines} gap={gap}")
    outline, fill = _sprite(scale)
    h, w = frame.shape[:2]
    x0, y0 = int(round(cursor[0])), int(round(cursor[1]))
    sh, sw = outline.shape
    ys, xs = slice(max(y0, 0), min(y0 + sh, h)), slice(max(x0, 0), min(x0 + sw, w))
    if ys.start >= ys.stop or xs.start >= xs.stop:
        return frame
    out = frame.copy()
    if lines and previous is not None:
        _lines(out, int(round(previous[0])), int(round(previous[1])), lines, gap, PREVIOUS_RGB)
    if lines:
        _lines(out, x0, y0, lines, gap, LINE_RGB)
    sy, sx = slice(ys.start - y0, ys.stop - y0), slice(xs.start - x0, xs.stop - x0)
    patch = out[ys, xs]
    patch[outline[sy, sx]] = 0
    patch[fill[sy, sx]] = 255
    return out


def _lines(out: np.ndarray, x0: int, y0: int, lines: int, gap: int, rgb: tuple[int, int, int]) -> None:
    """Guide lines through (x0, y0) in place: centred on it, clipped to the screen like the arrow."""
    h, w = out.shape[:2]
    top, left = y0 - lines // 2, x0 - lines // 2
    rows = slice(max(top, 0), max(min(top + lines, h), 0))
    cols = slice(max(left, 0), max(min(left + lines, w), 0))
    out[rows, : max(x0 - gap, 0)] = rgb
    out[rows, max(x0 + gap + 1, 0):] = rgb
    out[: max(y0 - gap, 0), cols] = rgb
    out[max(y0 + gap + 1, 0):, cols] = rgb


def _sprite(scale: int) -> tuple[np.ndarray, np.ndarray]:
    if scale < 1:
        raise ValueError(f"draw_cursor: scale must be >= 1, got {scale}")
    block = np.ones((scale, scale), bool)
    return np.kron(_OUTLINE, block), np.kron(_FILL, block)
