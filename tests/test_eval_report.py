"""eval.report: the per-episode HTML report, opened in a real browser (Debian's chromium through playwright).

The browser tests skip when chromium or playwright is missing, except under ``CI=true``, where they fail.
"""

import base64
import io
import json
import os
import re

import numpy as np
import pytest

from histeve_jax.data.records import StepRecord, encode_frame
from histeve_jax.eval import report

CHROMIUM = "/usr/bin/chromium"
N = 40  # steps: 2 s of video at 20 fps
GUI_STEPS = range(15, 25)
SUBTASK_CHANGE = 20
SUCCESS_FROM = 30
EVENT_STEP = 10
XSS = "<script>window.pwned = 1</script><img src=x onerror='window.pwned = 2'>"


def _action(i: int) -> dict:
    a = {k: 0 for k in report.BUTTONS}
    a["camera"] = [0.0, 0.0]
    if i % 3 == 0:
        a["forward"] = 1
    if i % 4 == 1:
        a["attack"] = 1
    if i % 5 == 2:
        a["camera"] = np.array([-2.0, 5.5])
    return a


def episode(n: int = N, size: tuple[int, int] = (64, 96), episode_id: str = "ep0") -> list[StepRecord]:
    """Steps of real JPEG frames with a GUI stretch, a subtask change and the success check turning on."""
    h, w = size
    recs = []
    for i in range(n):
        im = np.zeros((h, w, 3), np.uint8)
        im[:, : (i * w) // n + 1, 0] = 220  # a red bar growing with the step
        im[: (i * h) // n + 1, :, 2] = 160
        meta = {"action_text": f"{XSS} tokens"} if i == 5 else {}
        recs.append(StepRecord(
            episode_id=episode_id, step=i, task_id="craft_planks", kind="rl",
            instruction=f"craft planks {XSS}", frame=encode_frame(im), action=_action(i),
            is_gui_open=i in GUI_STEPS,
            subtask="chop log" if i < SUBTASK_CHANGE else "craft planks",
            completed=1 if i >= SUCCESS_FROM else 0, metadata=meta))
    return recs


def detector_series(n: int = N, k: int = 4) -> list:
    """Queried every k steps, None in between, and shorter than the episode."""
    return [((i / n) if i % k == 0 else None) for i in range(n - 3)]


EVENTS = [{"step": EVENT_STEP, "kind": "planner", "title": f"plan {XSS}",
           "payload": {"subtasks": ["chop log", "craft planks"], "note": XSS}},
          {"step": SUCCESS_FROM, "kind": "memory", "title": "snapshot", "payload": [1, 2.5, None]}]


def expected_action_text(r: StepRecord) -> str:
    return r.metadata.get("action_text") or report.action_text(r.action)


# ------------------------------------------------------------------------------------------- action_text


def test_action_text_lists_pressed_keys_then_camera():
    assert report.action_text({}) == "noop"
    assert report.action_text(_action(11)) == "noop"
    assert report.action_text({"forward": 1, "attack": 1, "camera": [-2.0, 5.5]}) == \
        "attack forward camera=(-2.0,+5.5)"
    assert report.action_text({"hotbar.3": np.int64(1), "camera": np.array([0.0, -0.25])}) == \
        "hotbar.3 camera=(+0.0,-0.2)"
    assert report.action_text({"ESC": 1, "use": 0, "camera": [0, 0]}) == "ESC"  # extra keys are kept


# ------------------------------------------------------------------------------------------- bad inputs


def test_no_records_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no records"):
        report.write_report([], tmp_path / "r.html")


def test_records_of_two_episodes_are_an_error(tmp_path):
    recs = episode(4) + episode(4, episode_id="ep1")
    with pytest.raises(ValueError, match="more than one episode.*ep0.*ep1"):
        report.write_report(recs, tmp_path / "r.html")


def test_steps_out_of_order_are_an_error(tmp_path):
    recs = episode(4)
    recs[2], recs[3] = recs[3], recs[2]
    with pytest.raises(ValueError, match="record 2 has step 3"):
        report.write_report(recs, tmp_path / "r.html")


def test_series_longer_than_the_episode_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="'detector_prob' has 5 values, longer than the episode's 4"):
        report.write_report(episode(4), tmp_path / "r.html", series={"detector_prob": [0.1] * 5})
    with pytest.raises(ValueError, match="'p' step 1"):
        report.write_report(episode(4), tmp_path / "r.html", series={"p": [0.1, "high"]})
    with pytest.raises(ValueError, match="threshold for 'q'"):
        report.write_report(episode(4), tmp_path / "r.html", series={"p": [0.1]}, thresholds={"q": 0.5})


@pytest.mark.parametrize("step", [-1, 4, 2.0, True])
def test_event_outside_the_episode_is_an_error(tmp_path, step):
    ev = {"step": step, "kind": "planner", "title": "t", "payload": None}
    with pytest.raises(ValueError, match=r"event 0 \('planner'\) is at step"):
        report.write_report(episode(4), tmp_path / "r.html", events=[ev])


def test_event_with_a_non_json_payload_is_an_error(tmp_path):
    ev = {"step": 0, "kind": "memory", "title": "t", "payload": {"x": object()}}
    with pytest.raises(ValueError, match="payload is not JSON"):
        report.write_report(episode(4), tmp_path / "r.html", events=[ev])
    with pytest.raises(ValueError, match=r"event 0 lacks \['title'\]"):
        report.write_report(episode(4), tmp_path / "r.html", events=[{"step": 0, "kind": "k"}])


def test_a_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    path = tmp_path / "r.html"
    report.write_report(episode(4), path, title="first")
    before = path.read_bytes()

    def crashing_page(*args, **kw):
        yield "<!DOCTYPE html><html>half a page"
        raise RuntimeError("crash while writing")

    monkeypatch.setattr(report, "_page", crashing_page)
    with pytest.raises(RuntimeError, match="crash while writing"):
        report.write_report(episode(4), path, title="second")
    assert path.read_bytes() == before  # the earlier report is untouched
    assert not os.path.exists(str(path) + ".tmp")
    fresh = tmp_path / "fresh.html"
    with pytest.raises(RuntimeError):
        report.write_report(episode(4), fresh)
    assert os.listdir(tmp_path) == ["r.html"]


# ------------------------------------------------------------------------------------------- the file itself


def _video_bytes(text: str) -> tuple[str, bytes]:
    m = re.search(r'<video[^>]*src="data:(video/[a-z0-9]+);base64,([A-Za-z0-9+/=]+)"', text)
    assert m, "no embedded video"
    return m.group(1), base64.b64decode(m.group(2))


def test_video_has_one_frame_per_step_at_20_fps_and_even_size(tmp_path):
    import av

    path = report.write_report(episode(N, size=(63, 95)), tmp_path / "odd.html")
    mime, data = _video_bytes(open(path, encoding="utf-8").read())
    assert mime == "video/mp4"  # this PyAV wheel has libx264
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.video[0]
        assert stream.codec_context.name == "h264" and stream.average_rate == report.FPS == 20
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(stream)]
    assert len(frames) == N and frames[0].shape == (64, 96, 3)  # odd sizes padded to even
    assert frames[-1][10, 90, 0] > 150 and frames[0][10, 90, 0] < 80  # the bar has grown: frames in order


def test_vp9_webm_is_the_fallback_without_libx264(tmp_path, monkeypatch):
    import av

    monkeypatch.setattr(report, "_video_codec", lambda: ("libvpx-vp9", "webm", "video/webm"))
    path = report.write_report(episode(), tmp_path / "r.html")
    mime, data = _video_bytes(open(path, encoding="utf-8").read())
    assert mime == "video/webm"
    with av.open(io.BytesIO(data)) as c:
        assert c.streams.video[0].codec_context.name == "vp9"
        assert sum(1 for _ in c.decode(video=0)) == N


def test_page_is_self_contained_and_escapes_data(tmp_path):
    path = report.write_report(episode(), tmp_path / "r.html", summary={"agent": XSS}, events=EVENTS,
                               series={"detector_prob": detector_series()})
    text = open(path, encoding="utf-8").read()
    refs = re.findall(r'<[a-zA-Z][^<>]*?\s(?:src|href)\s*=\s*"?([^" >]*)', text)  # attributes of real tags
    assert refs and all(r.startswith("data:") for r in refs), refs
    assert "http://" not in text and "https://" not in text
    assert "<script>" in text and text.count("<script>") == 1  # ours; the data's scripts are escaped
    assert "<img" not in text and "&lt;script&gt;window.pwned" in text


# ------------------------------------------------------------------------------------------- in the browser


def browser_or_skip() -> None:
    """Skip when playwright or chromium is missing; under CI=true fail instead, naming what is missing."""
    missing = []
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the playwright Python package (pip install playwright)")
    if not os.access(CHROMIUM, os.X_OK):
        missing.append(f"{CHROMIUM} (apt-get install chromium)")
    if missing:
        msg = "browser test needs " + " and ".join(missing)
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must test the report in a browser: {msg}")
        pytest.skip(msg)


@pytest.fixture(scope="module")
def browser_page(tmp_path_factory):
    """(page, records, outside requests, page errors) for the test episode's report opened in chromium."""
    browser_or_skip()
    from playwright.sync_api import sync_playwright

    recs = episode()
    path = report.write_report(recs, tmp_path_factory.mktemp("report") / "ep0.html", title="craft planks",
                               summary={"seed": 0, "agent": "tiny", "success": True, "steps": N},
                               series={"detector_prob": detector_series()}, thresholds={"detector_prob": 0.6},
                               events=EVENTS)
    outside, errors = [], []

    def only_local(route):
        url = route.request.url
        if url.startswith(("data:", "file:")):
            route.continue_()
        else:
            outside.append(url)
            route.abort()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM,
                                    args=["--no-sandbox", "--autoplay-policy=no-user-gesture-required"])
        try:
            page = browser.new_page()
            page.route("**/*", only_local)
            page.on("request", lambda r: r.url.startswith(("data:", "file:")) or outside.append(r.url))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto("file://" + os.path.abspath(path))
            page.wait_for_function("document.getElementById('video').readyState >= 2", timeout=15000)
            yield page, recs, outside, errors
        finally:
            browser.close()


def current_row(page) -> int:
    return page.evaluate("+document.querySelector('#timeline tr.current').dataset.step")


def seek(page, t: float) -> None:
    page.evaluate("""t => new Promise(ok => { const v = document.getElementById('video');
        v.addEventListener('seeked', () => requestAnimationFrame(ok), {once: true});
        v.currentTime = t; })""", t)


def test_video_plays_for_steps_over_20_seconds(browser_page):
    page, recs, _, _ = browser_page
    duration = page.evaluate("document.getElementById('video').duration")
    assert duration == pytest.approx(len(recs) / 20, abs=0.06)
    page.evaluate("document.getElementById('video').play()")
    page.wait_for_function("document.getElementById('video').currentTime > 0.3", timeout=10000)
    page.evaluate("document.getElementById('video').pause()")
    assert page.evaluate("document.getElementById('video').error") is None
    assert current_row(page) >= 5  # the highlight moved with playback


def test_timeline_has_one_row_per_step(browser_page):
    page, recs, _, _ = browser_page
    rows = page.evaluate("""Array.from(document.querySelectorAll('#timeline tbody tr')).map(r => [
        +r.dataset.step, r.querySelector('.subtask').textContent, r.querySelector('.regime').textContent,
        r.querySelector('.check').textContent, r.querySelector('.action').textContent])""")
    assert len(rows) == len(recs)
    for (step, subtask, regime, check, action), r in zip(rows, recs, strict=True):
        assert step == r.step and subtask == r.subtask
        assert regime == ("GUI" if r.is_gui_open else "NG")
        assert check == ("yes" if r.completed == 1 else "no")
        assert action == expected_action_text(r)
    assert rows[5][4] == f"{XSS} tokens"  # metadata's action_text wins, shown as text
    assert rows[2][4] == "camera=(-2.0,+5.5)" and rows[11][4] == "noop"
    assert page.evaluate("window.pwned") is None  # nothing from the data ran


def test_highlighted_row_follows_the_video_time(browser_page):
    page, _, _, _ = browser_page
    for t, step in [(1.23, 24), (0.6, 12), (0.0, 0), (1.99, 39)]:
        seek(page, t)
        assert current_row(page) == step, t
        assert page.evaluate("document.querySelectorAll('#timeline tr.current').length") == 1
    page.click("#timeline tr[data-step='33'] td.step")
    page.wait_for_function("!document.getElementById('video').seeking")
    assert page.evaluate("document.getElementById('video').currentTime") == pytest.approx(33.5 / 20, abs=0.01)
    assert current_row(page) == 33


def test_series_chart_has_a_point_per_value_and_the_threshold(browser_page):
    page, _, _, _ = browser_page
    values = [v for v in detector_series() if v is not None]
    chart = page.evaluate("""(() => {
        const s = document.querySelector('figure.series[data-series=detector_prob] svg');
        const b = s.getBoundingClientRect();
        return {points: s.querySelector('polyline').points.numberOfItems,
                dots: s.querySelectorAll('circle.pt').length,
                thresholds: s.querySelectorAll('line.threshold').length,
                width: b.width, height: b.height,
                ys: Array.from(s.querySelectorAll('circle.pt')).map(c => +c.getAttribute('cy'))}; })()""")
    assert chart["points"] == chart["dots"] == len(values) == 10
    assert chart["thresholds"] == 1 and chart["width"] > 100 and chart["height"] > 10
    assert chart["ys"] == sorted(chart["ys"], reverse=True)  # rising values draw higher (smaller y)
    cells = page.evaluate("Array.from(document.querySelectorAll('#timeline tbody td.value'))"
                          ".map(c => c.textContent)")
    assert cells[0] == "0" and cells[1] == "" and cells[4] == "0.1" and cells[-1] == ""


def test_events_are_expandable_at_their_step(browser_page):
    page, _, _, _ = browser_page
    sel = f"#timeline tr[data-step='{EVENT_STEP}'] details.event[data-kind=planner]"
    assert page.eval_on_selector(sel, "d => d.open") is False
    assert page.eval_on_selector(sel + " summary", "s => s.textContent") == f"planner: plan {XSS}"
    page.click(sel + " summary")
    assert page.eval_on_selector(sel, "d => d.open") is True
    payload = json.loads(page.eval_on_selector(sel + " pre", "p => p.textContent"))
    assert payload == EVENTS[0]["payload"]
    other = f"#timeline tr[data-step='{SUCCESS_FROM}'] details.event[data-kind=memory]"
    assert page.eval_on_selector(other + " summary", "s => s.textContent") == "memory: snapshot"


def test_page_makes_no_network_request(browser_page):
    page, _, outside, errors = browser_page
    page.evaluate("document.getElementById('video').play()")
    page.wait_for_timeout(300)
    assert outside == [] and errors == []
    assert page.evaluate("performance.getEntriesByType('resource').map(e => e.name)"
                         ".filter(u => !u.startsWith('data:') && !u.startsWith('file:'))") == []
