"""Per-episode HTML reports of closed-loop evaluation: one self-contained ``.html`` file per episode.

This module owns the page and nothing else: the episode's video (H.264 MP4, or VP9 WebM where the PyAV build
lacks libx264, embedded as a base64 data URI), a timeline with one row per step (subtask, regime, whether the
task's success check holds, the decoded action) that follows the video as it plays and seeks it when a row is
clicked, and two hooks for later issues: named per-step numeric series drawn as inline SVG line charts (with
an optional threshold line), and events (planner calls, memory snapshots...) shown at their step as
expandable ``<details>``. The page loads nothing: no CDN, no external files, CSS and JS inline.

Every string taken from the data (instructions, subtasks, action texts, event titles and payloads, summary
values) is HTML-escaped; the inline script reads only numbers. The report is written to ``path + ".tmp"``
and renamed, so a crash never leaves a half-written report under the final name.
"""

from __future__ import annotations

import base64
import fractions
import html
import io
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from histeve_jax.actions.codebook import BUTTONS, CAMERA
from histeve_jax.data.records import StepRecord, decode_frame
from histeve_jax.envs.base import STEP_SECONDS

FPS = round(1.0 / STEP_SECONDS)  # one video frame per control step: 20 fps at 20 Hz
_CHART_W, _CHART_H, _CHART_PAD = 640, 120, 6


def action_text(action: Mapping[str, Any]) -> str:
    """Compact text of an env-format action: pressed keys then the camera, e.g.
    ``"forward attack camera=(-2.0,+5.5)"``; ``"noop"`` when nothing is pressed and the camera is still."""
    known = [k for k in BUTTONS if k in action]
    extra = sorted(k for k in action if k not in BUTTONS and k != CAMERA)  # e.g. MineStudio's ESC
    words = [k for k in known + extra if np.any(np.asarray(action[k]) != 0)]
    if CAMERA in action:
        cam = np.asarray(action[CAMERA], dtype=np.float64).ravel()
        if cam.size != 2:
            raise ValueError(f"action text: camera must be [dpitch, dyaw], got {action[CAMERA]!r}")
        if np.any(cam != 0):
            words.append(f"camera=({cam[0]:+.1f},{cam[1]:+.1f})")
    return " ".join(words) or "noop"


def _esc(s: Any) -> str:
    return html.escape(str(s), quote=True)


# ---------------------------------------------------------------------------------------------- input checks


def _check_records(records: Sequence[StepRecord]) -> None:
    if len(records) == 0:
        raise ValueError("write_report: no records (an episode needs at least one step)")
    episodes = sorted({r.episode_id for r in records})
    if len(episodes) != 1:
        raise ValueError(f"write_report: records of more than one episode: {episodes[:5]}")
    steps = [r.step for r in records]
    if steps != list(range(len(records))):
        bad = next(i for i, s in enumerate(steps) if s != i)
        raise ValueError(f"write_report: steps must be 0..{len(records) - 1} in order; record {bad} has "
                         f"step {steps[bad]}")


def _check_series(series: Mapping[str, Sequence[float | None]], thresholds: Mapping[str, float],
                  n: int) -> dict[str, list[float | None]]:
    """Series as lists of float-or-None (NaN counts as None); raises ValueError naming a bad one."""
    out: dict[str, list[float | None]] = {}
    for name, values in series.items():
        if len(values) > n:
            raise ValueError(f"write_report: series {name!r} has {len(values)} values, longer than the "
                             f"episode's {n} steps")
        vals: list[float | None] = []
        for i, v in enumerate(values):
            try:
                f = None if v is None else float(v)
            except (TypeError, ValueError) as e:
                raise ValueError(f"write_report: series {name!r} step {i}: {v!r} is not a number") from e
            vals.append(None if f is None or not math.isfinite(f) else f)
        out[str(name)] = vals + [None] * (n - len(vals))
    for name, t in thresholds.items():
        if name not in out:
            raise ValueError(f"write_report: threshold for {name!r}, which is not among the series "
                             f"{sorted(out)}")
        if not math.isfinite(float(t)):
            raise ValueError(f"write_report: threshold for {name!r} is not finite: {t!r}")
    return out


def _check_events(events: Sequence[Mapping[str, Any]], n: int) -> list[dict[str, Any]]:
    """Events with their payload rendered as JSON text; raises ValueError naming a bad one."""
    out = []
    for i, ev in enumerate(events):
        missing = [k for k in ("step", "kind", "title") if k not in ev]
        if missing:
            raise ValueError(f"write_report: event {i} lacks {missing}")
        step = ev["step"]
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or not 0 <= step < n:
            raise ValueError(f"write_report: event {i} ({ev['kind']!r}) is at step {step!r}, outside the "
                             f"episode's steps 0..{n - 1}")
        try:
            payload = json.dumps(ev.get("payload"), indent=1, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"write_report: event {i} ({ev['kind']!r}) payload is not JSON: {e}") from e
        out.append({"step": int(step), "kind": str(ev["kind"]), "title": str(ev["title"]),
                    "payload": payload})
    return out


# ---------------------------------------------------------------------------------------------- video


def _video_codec() -> tuple[str, str, str]:
    """(encoder, container format, MIME type): H.264 MP4 if this PyAV build has libx264, else VP9 WebM."""
    import av

    if "libx264" in av.codecs_available:
        return "libx264", "mp4", "video/mp4"
    if "libvpx-vp9" in av.codecs_available:
        return "libvpx-vp9", "webm", "video/webm"
    raise RuntimeError("write_report: this PyAV build has neither libx264 nor libvpx-vp9")


def _frames(records: Sequence[StepRecord]) -> list[np.ndarray]:
    """Decoded frames, edge-padded to even height and width (yuv420p needs them)."""
    frames, size = [], None
    for r in records:
        try:
            im = decode_frame(r.frame)
        except ValueError as e:
            raise ValueError(f"write_report: step {r.step}: {e}") from e
        size = size or im.shape[:2]
        if im.shape[:2] != size:
            raise ValueError(f"write_report: step {r.step} frame is {im.shape[:2]}, the episode's first is "
                             f"{size}")
        frames.append(_even(im))
    return frames


def _even(im: np.ndarray) -> np.ndarray:
    h, w = im.shape[:2]
    return np.pad(im, ((0, h % 2), (0, w % 2), (0, 0)), mode="edge") if (h | w) % 2 else im


def encode_video(frames: Sequence[np.ndarray]) -> tuple[bytes, str]:
    """Encode HxWx3 uint8 frames (even H and W) at ``FPS``; returns (file bytes, MIME type)."""
    import av

    codec, fmt, mime = _video_codec()
    buf = io.BytesIO()
    h, w = frames[0].shape[:2]
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=FPS)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.codec_context.time_base = fractions.Fraction(1, FPS)
        # A keyframe every second keeps seeks from the timeline cheap.
        stream.codec_context.gop_size = FPS
        if codec == "libx264":
            stream.options = {"preset": "veryfast", "crf": "23"}
        for i, im in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(im), format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buf.getvalue(), mime


# ---------------------------------------------------------------------------------------------- page parts


def _chart(name: str, values: list[float | None], threshold: float | None) -> str:
    """One series as an inline SVG: a polyline through its defined values, a dot per value, a threshold."""
    n = len(values)
    pts = [(i, v) for i, v in enumerate(values) if v is not None]
    ys = [v for _, v in pts] + ([threshold] if threshold is not None else [])
    lo, hi = (min(ys), max(ys)) if ys else (0.0, 1.0)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    x = lambda i: _CHART_PAD + (_CHART_W - 2 * _CHART_PAD) * (i + 0.5) / n
    y = lambda v: _CHART_PAD + (_CHART_H - 2 * _CHART_PAD) * (hi - v) / (hi - lo)
    coords = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in pts)
    parts = [f'<figure class="series" data-series="{_esc(name)}"><figcaption>{_esc(name)} '
             f'<span class="range">[{lo:.4g}, {hi:.4g}]</span></figcaption>',
             f'<svg viewBox="0 0 {_CHART_W} {_CHART_H}" data-n="{n}" data-pad="{_CHART_PAD}">',
             f'<rect class="bg" width="{_CHART_W}" height="{_CHART_H}"/>']
    if threshold is not None:
        parts.append(f'<line class="threshold" x1="0" x2="{_CHART_W}" y1="{y(threshold):.1f}" '
                     f'y2="{y(threshold):.1f}"><title>threshold {threshold:.4g}</title></line>')
    parts.append(f'<polyline class="line" points="{coords}"/>')
    parts += [f'<circle class="pt" cx="{x(i):.1f}" cy="{y(v):.1f}" r="2"><title>step {i}: {v:.4g}</title>'
              f'</circle>' for i, v in pts]
    parts.append(f'<line class="cursor" x1="{x(0):.1f}" x2="{x(0):.1f}" y1="0" y2="{_CHART_H}"/>'
                 f'</svg></figure>')
    return "".join(parts)


def _completed_cell(c: int) -> str:
    return {1: '<td class="check yes">yes</td>', 0: '<td class="check no">no</td>'}.get(
        int(c), '<td class="check unknown">?</td>')


def _timeline(records: Sequence[StepRecord], series: dict[str, list[float | None]],
              events: list[dict[str, Any]]) -> str:
    head = "".join(f"<th>{_esc(k)}</th>" for k in series)
    rows = [f'<table id="timeline"><thead><tr><th>step</th><th>subtask</th><th>regime</th><th>success</th>'
            f'<th>action</th>{head}<th>events</th></tr></thead><tbody>']
    by_step: dict[int, list[dict[str, Any]]] = {}
    for ev in events:
        by_step.setdefault(ev["step"], []).append(ev)
    prev_subtask = None
    for i, r in enumerate(records):
        text = r.metadata.get("action_text") if isinstance(r.metadata, Mapping) else None
        text = action_text(r.action) if text is None else str(text)
        regime = "GUI" if r.is_gui_open else "NG"
        cls = ' class="subtask-start"' if r.subtask != prev_subtask else ""
        prev_subtask = r.subtask
        vals = "".join(f'<td class="value">{"" if v[i] is None else f"{v[i]:.4g}"}</td>'
                       for v in series.values())
        evs = "".join(f'<details class="event" data-kind="{_esc(e["kind"])}"><summary>{_esc(e["kind"])}: '
                      f'{_esc(e["title"])}</summary><pre>{_esc(e["payload"])}</pre></details>'
                      for e in by_step.get(i, []))
        rows.append(f'<tr data-step="{i}"{cls}><td class="step">{i}</td><td class="subtask">{_esc(r.subtask)}'
                    f'</td><td class="regime {regime.lower()}">{regime}</td>{_completed_cell(r.completed)}'
                    f'<td class="action">{_esc(text)}</td>{vals}<td class="events">{evs}</td></tr>')
    rows.append("</tbody></table>")
    return "".join(rows)


def _summary(records: Sequence[StepRecord], summary: Mapping[str, Any]) -> str:
    first = records[0]
    facts = {"episode": first.episode_id, "task": first.task_id, "instruction": first.instruction,
             "steps": len(records), **summary}
    cells = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(_fact(v))}</td></tr>" for k, v in facts.items())
    return f'<table id="summary">{cells}</table>'


def _fact(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, float):
        return f"{v:.4g}"
    try:
        return json.dumps(v, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(v)


_CSS = """
body{font:13px/1.35 system-ui,sans-serif;margin:12px;color:#222;background:#fafafa}
h1{font-size:18px;margin:0 0 8px}
#summary{border-collapse:collapse;margin-bottom:10px}
#summary th{text-align:left;padding:1px 10px 1px 0;color:#555;font-weight:600}
#summary td{white-space:pre-wrap}
main{display:grid;grid-template-columns:minmax(320px,640px) 1fr;gap:14px;align-items:start}
#left{position:sticky;top:8px}
video{width:100%;background:#000;image-rendering:pixelated}
#now{font-family:ui-monospace,monospace;margin:4px 0}
figure.series{margin:6px 0}figcaption{font-weight:600}.range{color:#888;font-weight:400}
svg{width:100%;height:auto;display:block;cursor:pointer}
svg .bg{fill:#fff;stroke:#ddd}svg .line{fill:none;stroke:#1f6feb;stroke-width:1.5}svg .pt{fill:#1f6feb}
svg .threshold{stroke:#d73a49;stroke-dasharray:5 3}svg .cursor{stroke:#444;stroke-width:1}
#tl{max-height:88vh;overflow:auto;border:1px solid #ddd;background:#fff}
#timeline{border-collapse:collapse;width:100%}
#timeline th{position:sticky;top:0;background:#eee;text-align:left;padding:2px 6px}
#timeline td{padding:1px 6px;border-top:1px solid #f0f0f0;vertical-align:top}
#timeline tr{cursor:pointer}#timeline tr.subtask-start td{border-top:2px solid #999}
#timeline tr.current{background:#fff3b0}
td.step,td.value{text-align:right;font-family:ui-monospace,monospace}
td.action{font-family:ui-monospace,monospace;min-width:22ch;max-width:42ch;overflow-wrap:anywhere}
td.subtask{max-width:24ch;overflow-wrap:anywhere}td.events{max-width:48ch;overflow-wrap:anywhere}
td.regime.gui{color:#8250df;font-weight:600}td.check.yes{color:#1a7f37;font-weight:600}
td.check.no{color:#999}td.check.unknown{color:#bbb}
details.event summary{color:#9a6700}details.event pre{margin:2px 0;white-space:pre-wrap}
"""

# Frame i is on screen during [i/FPS, (i+1)/FPS); a click seeks to the middle of its frame.
_JS = """
(function(){
const fps=__FPS__, n=__N__, video=document.getElementById('video'), box=document.getElementById('tl');
const rows=Array.from(document.querySelectorAll('#timeline tbody tr'));
const charts=Array.from(document.querySelectorAll('figure.series svg'));
const now=document.getElementById('now');
let cur=-1;
function stepAt(t){return Math.max(0,Math.min(n-1,Math.floor(t*fps+1e-6)));}
function show(i){
  if(i===cur)return;
  if(cur>=0)rows[cur].classList.remove('current');
  cur=i;const r=rows[i];r.classList.add('current');
  if(r.offsetTop<box.scrollTop+30||r.offsetTop+r.offsetHeight>box.scrollTop+box.clientHeight)
    box.scrollTop=r.offsetTop-box.clientHeight/3;
  now.textContent='step '+i+' / '+(n-1)+' · '+r.querySelector('.subtask').textContent+' · '+
    r.querySelector('.regime').textContent+' · '+r.querySelector('.action').textContent;
  for(const s of charts){const pad=+s.dataset.pad,w=s.viewBox.baseVal.width,
    x=(pad+(w-2*pad)*(i+0.5)/n).toFixed(1),c=s.querySelector('.cursor');
    c.setAttribute('x1',x);c.setAttribute('x2',x);}
}
function sync(){show(stepAt(video.currentTime));}
function seek(i){video.currentTime=(i+0.5)/fps;show(i);}
function loop(){sync();if(!video.paused&&!video.ended)requestAnimationFrame(loop);}
video.addEventListener('play',()=>requestAnimationFrame(loop));
for(const e of ['timeupdate','seeked','seeking','loadeddata'])video.addEventListener(e,sync);
rows.forEach((r,i)=>r.addEventListener('click',e=>{if(!e.target.closest('pre'))seek(i);}));
for(const s of charts)s.addEventListener('click',e=>{const b=s.getBoundingClientRect(),
  pad=+s.dataset.pad*b.width/s.viewBox.baseVal.width;
  seek(Math.max(0,Math.min(n-1,Math.floor((e.clientX-b.left-pad)/(b.width-2*pad)*n))));});
show(0);
})();
"""


def _page(records: Sequence[StepRecord], title: str, summary: Mapping[str, Any],
          series: dict[str, list[float | None]], thresholds: Mapping[str, float],
          events: list[dict[str, Any]], video: bytes, mime: str) -> Iterable[str]:
    """The page as chunks (the video's base64 is most of it)."""
    title = title or f"{records[0].task_id} · {records[0].episode_id}"
    charts = "".join(_chart(k, v, float(thresholds[k]) if k in thresholds else None)
                     for k, v in series.items())
    yield (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
           f'<meta name="viewport" content="width=device-width,initial-scale=1">'
           f"<title>{_esc(title)}</title><style>{_CSS}</style></head><body>"
           f"<h1>{_esc(title)}</h1>{_summary(records, summary)}<main><div id=\"left\">"
           f'<video id="video" controls muted playsinline preload="auto" src="data:{mime};base64,')
    yield base64.b64encode(video).decode("ascii")
    yield (f'"></video><div id="now"></div>{charts}</div><div id="tl">{_timeline(records, series, events)}'
           f"</div></main><script>{_JS.replace('__FPS__', str(FPS)).replace('__N__', str(len(records)))}"
           f"</script></body></html>\n")


def _write_atomic(path: str, chunks: Iterable[str]) -> None:
    """Write ``chunks`` to ``path + ".tmp"`` and rename it to ``path``; on any error the .tmp is removed and
    whatever was at ``path`` before is left as it was."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for c in chunks:
                f.write(c)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_report(records: Sequence[StepRecord], path: str | os.PathLike, *, title: str = "",
                 summary: Mapping[str, Any] | None = None,
                 series: Mapping[str, Sequence[float | None]] | None = None,
                 thresholds: Mapping[str, float] | None = None,
                 events: Sequence[Mapping[str, Any]] = ()) -> str:
    """Write one episode's self-contained HTML report to ``path``; returns the path written.

    ``records`` are steps 0..n-1 of one episode. ``series`` maps a name to per-step values (index = step;
    shorter than the episode, or None where there is no value, is fine), drawn under the video with the
    optional ``thresholds[name]`` line. ``events`` are ``{"step", "kind", "title", "payload"}`` dicts shown at
    their step. Raises ValueError naming any bad input.
    """
    path = os.fspath(path)
    _check_records(records)
    n = len(records)
    series_ = _check_series(series or {}, thresholds or {}, n)
    events_ = _check_events(events, n)
    video, mime = encode_video(_frames(records))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    _write_atomic(path, _page(records, title, summary or {}, series_, thresholds or {}, events_, video, mime))
    return path
