"""bench/decode_front.py runs both paths to the end and counts every token once."""

from __future__ import annotations

from bench import decode_front
from splitserve.decode_service import decode_many


def test_both_paths_stream_every_token_and_the_setting_is_restored(tmp_path):
    was = decode_many.DIRECT
    results = decode_front.main(
        ["--streams", "6", "--steps", "12", "--rounds", "1", "--out", str(tmp_path / "f.json")]
    )
    assert [r["path"] for r in results["rows"]] == ["stream task", "direct"]
    assert all(r["tokens"] == 6 * 12 for r in results["rows"])
    assert (tmp_path / "f.json").exists()
    assert decode_many.DIRECT is was
