from __future__ import annotations

import gzip
import json

import pytest

from vpipe_lab.jupyter.live_view import STATIC, LiveView, plotly_bundle


def test_the_module_is_small_and_plotly_travels_gzipped_once_per_display() -> None:
    view = LiveView()
    try:
        # anywidget gives the module 2 s to load and initialize: it must stay small (plotly.js is not in it).
        assert (STATIC / "live.js").stat().st_size < 64_000
        data, key = plotly_bundle()
        assert view._plotly == data and view._plotly_key == key and len(key) == 16
        source = gzip.decompress(data).decode()
        assert len(data) < 600_000 < len(source)  # ~0.4 MB on the wire for ~1.2 MB of plotly.js
        assert "export" in source and "react" in source
        state = view.get_state()
        assert set(state) >= {"_esm", "_plotly", "_plotly_key", "header", "timeline", "memory", "series", "frame"}
    finally:
        view.close()


def test_show_replaces_whole_panels_in_one_message_and_counts_frames() -> None:
    view = LiveView()
    sent: list[dict] = []  # type: ignore[type-arg]
    view.comm.send = lambda data=None, metadata=None, buffers=None: sent.append(data)  # type: ignore[union-attr]
    try:
        fig = {"data": [{"type": "scatter", "x": [1], "y": [2]}], "layout": {"title": {"text": "t"}}}
        assert view.show(header={"state": "running", "text": "x"}, timeline=fig, memory=fig) == 1
        assert view.show(series=fig) == 2 and view.frame == 2 and view.timeline == fig
        updates = [m["state"] for m in sent if m and m.get("method") == "update"]
        assert len(updates) == 2 and set(updates[0]) == {"header", "timeline", "memory", "frame"}
        assert set(updates[1]) == {"series", "frame"}  # unchanged panels are not sent again
        json.dumps(updates, allow_nan=False)
        # sent_bytes counts what changed, about as many bytes as the updates carried (the frame counter aside)
        carried = sum(len(json.dumps(v, separators=(",", ":"))) for u in updates for k, v in u.items() if k != "frame")
        assert view.sent_bytes == carried
        view.show(timeline=fig)  # the same figure again: nothing goes, nothing counted
        assert view.sent_bytes == carried
        with pytest.raises(ValueError, match="no panel named"):
            view.show(loss=fig)
        assert view.frame == 3
    finally:
        view.close()


def test_the_synced_traits_are_the_declared_ones_and_hold_what_they_declare() -> None:
    """The live view's traits as extension/src/traits.ts declares them (the browser's types come from there)."""
    import json

    import jsonschema

    from vpipe_lab.jupyter.live_view import STATIC

    schema = json.loads((STATIC / "widget_traits.schema.json").read_text())["$defs"]["LiveView"]
    assert set(LiveView.class_own_traits(sync=True)) == set(schema["properties"])
    view = LiveView()
    view.show(header={"state": "running", "text": "iteration 3"}, timeline={"data": [], "layout": {"height": 200}})
    state = {name: getattr(view, name) for name in schema["properties"]}
    assert isinstance(state.pop("_plotly"), bytes)  # bytes: JSON schema cannot say it
    jsonschema.validate({**state, "_plotly": None}, schema)
