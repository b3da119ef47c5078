"""Keyboard and mouse input to one game window through XTest, over one persistent X connection."""

from __future__ import annotations

import time

from Xlib import XK, X, display
from Xlib.error import XError
from Xlib.ext import xtest

# env-format binary key -> X keysym name (minetest's default keymap; sprint is Aux1, bound to E in the
# config, attack/use are mouse buttons and handled separately).
KEYSYMS = {
    "forward": "w",
    "back": "s",
    "left": "a",
    "right": "d",
    "jump": "space",
    "sneak": "Shift_L",
    "sprint": "e",
    "drop": "q",
    "inventory": "i",
    **{f"hotbar.{i}": str(i) for i in range(1, 10)},
}
BUTTONS = {"attack": 1, "use": 3}


class XInput:
    """Sends key, button and relative pointer events to the game window on `display_name`."""

    def __init__(self, display_name: str):
        self.display_name = display_name
        self.d = display.Display(display_name)
        if not self.d.has_extension("XTEST"):
            raise RuntimeError(f"X display {display_name} has no XTEST extension")
        self.root = self.d.screen().root
        self.keycodes = {k: self.d.keysym_to_keycode(XK.string_to_keysym(s)) for k, s in KEYSYMS.items()}
        self.f2 = self.d.keysym_to_keycode(XK.string_to_keysym("F2"))
        for k, code in self.keycodes.items():
            if not code:
                raise RuntimeError(f"no X keycode for key {k!r} on {display_name}")
        self.window = None

    def find_window(self, timeout_s: float = 60.0, alive=None):
        """Wait for the minetest window, map it to the screen and give it input focus."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if alive is not None:
                alive()
            win = self._search(self.root)
            if win is not None:
                self.window = win
                self.focus()
                return win
            time.sleep(0.2)
        raise TimeoutError(f"no minetest window appeared on {self.display_name} within {timeout_s:.0f} s")

    def _search(self, win):
        try:
            name = win.get_wm_name()
            if isinstance(name, str) and ("Minetest" in name or "Luanti" in name):
                return win
            for child in win.query_tree().children:
                found = self._search(child)
                if found is not None:
                    return found
        except XError:
            return None
        return None

    def focus(self) -> None:
        """Give the game window input focus (without focus, minetest ignores key events)."""
        self.window.set_input_focus(X.RevertToParent, X.CurrentTime)
        self.d.sync()

    def key(self, name: str, down: bool) -> None:
        xtest.fake_input(self.d, X.KeyPress if down else X.KeyRelease, self.keycodes[name])

    def button(self, name: str, down: bool) -> None:
        xtest.fake_input(self.d, X.ButtonPress if down else X.ButtonRelease, BUTTONS[name])

    def tap_f2(self) -> None:
        xtest.fake_input(self.d, X.KeyPress, self.f2)
        self.d.sync()
        time.sleep(0.03)
        xtest.fake_input(self.d, X.KeyRelease, self.f2)
        self.d.sync()

    def move(self, dx: int, dy: int) -> None:
        """Relative pointer motion in pixels (one event; callers split large motions across frames)."""
        if dx or dy:
            xtest.fake_input(self.d, X.MotionNotify, detail=True, x=int(dx), y=int(dy))

    def pointer(self) -> tuple[int, int]:
        """Pointer position in screen pixels."""
        p = self.root.query_pointer()
        return int(p.root_x), int(p.root_y)

    def sync(self) -> None:
        self.d.sync()

    def close(self) -> None:
        try:
            self.d.close()
        except Exception:  # noqa: BLE001 (the X server may already be gone)
            pass
