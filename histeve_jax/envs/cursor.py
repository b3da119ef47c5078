"""The GUI mouse pointer drawn into observations, as a person sees it on screen.

Screen captures do not hold the pointer: the X server (Luanti under Xvfb) and Minecraft's framebuffer both
draw it outside the frame that is grabbed. A policy that moves the cursor between inventory slots must see
where it is, so the backends paste this arrow at ``info["cursor"]`` into every GUI frame before resizing,
as VPT's data loader does for its contractor frames (a 16x16 arrow at the 640x360 render). The backends
draw it twice that size by default: a policy's frames are the render shrunk 3-6 times, and a 16 px arrow
comes out a few pixels across, inside one vision patch.
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


def draw_cursor(frame: np.ndarray, cursor: tuple[float, float] | None, scale: int = 1) -> np.ndarray:
    """A copy of ``frame`` (HxWx3 uint8, render pixels) with the arrow's tip at ``cursor`` (x, y), each
    sprite pixel drawn as ``scale`` x ``scale``; the frame itself when ``cursor`` is None. Parts of the
    arrow off the screen are clipped."""
    if cursor is None:
        return frame
    outline, fill = _sprite(scale)
    h, w = frame.shape[:2]
    x0, y0 = int(round(cursor[0])), int(round(cursor[1]))
    sh, sw = outline.shape
    ys, xs = slice(max(y0, 0), min(y0 + sh, h)), slice(max(x0, 0), min(x0 + sw, w))
    if ys.start >= ys.stop or xs.start >= xs.stop:
        return frame
    out = frame.copy()
    sy, sx = slice(ys.start - y0, ys.stop - y0), slice(xs.start - x0, xs.stop - x0)
    patch = out[ys, xs]
    patch[outline[sy, sx]] = 0
    patch[fill[sy, sx]] = 255
    return out


def _sprite(scale: int) -> tuple[np.ndarray, np.ndarray]:
    if scale < 1:
        raise ValueError(f"draw_cursor: scale must be >= 1, got {scale}")
    block = np.ones((scale, scale), bool)
    return np.kron(_OUTLINE, block), np.kron(_FILL, block)
