"""The learning-curve picture is written from metrics.jsonl."""

from __future__ import annotations

import json

from masgraph.cli import main
from masgraph.rundir.plot import plot_run


def test_plot_writes_a_png(tmp_path):
    rows = [{"step": 0, "accuracy/test": 0.1}] + [{"step": s, "reward/mean": s / 10} for s in range(1, 6)] + \
        [{"step": 5, "accuracy/test": 0.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = plot_run(tmp_path)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_plot_of_a_non_training_dir_is_a_clean_error(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_plot_of_a_killed_run_skips_the_cut_line(tmp_path, capsys):
    rows = [{"step": s, "reward/mean": s / 10, "note": "a\u2028b"} for s in range(1, 4)]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows) + '{"step": 4, "rew'
    (tmp_path / "metrics.jsonl").write_text(text, encoding="utf-8")
    assert main(["plot", str(tmp_path)]) == 0  # HEAD: JSONDecodeError traceback
    assert capsys.readouterr().out.strip() == str(tmp_path / "learning_curve.png")
