"""`megatron-rl plot`: curves from metrics.jsonl (val curves beside the training ones), and
one clear error for bad run dirs."""

import json
import struct

import pytest

from megatron_rl.cli import main as cli_main
from megatron_rl.trainer.plot import PlotError, load_series, plot_run, read_rows, val_panels


def _write(run_dir, rows):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


ROWS = [
    {"step": 1, "reward/mean": 0.1, "response_length/mean": 10.0},  # a critic warm-up step: no entropy
    {"step": 2, "reward/mean": 0.25, "response_length/mean": 9.0, "actor/entropy": 1.5},
    {"step": 3, "reward/mean": 0.5, "response_length/mean": 8.5, "actor/entropy": None},
]


def test_series_skip_steps_without_the_key(tmp_path):
    _write(tmp_path / "run", ROWS)
    series = load_series(tmp_path / "run" / "metrics.jsonl", ["reward/mean", "actor/entropy"])
    assert series["reward/mean"] == ([1, 2, 3], [0.1, 0.25, 0.5])
    assert series["actor/entropy"] == ([2], [1.5])


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])  # IHDR width, height


def test_cli_writes_a_png_with_one_panel_per_key(tmp_path, capsys):
    _write(tmp_path / "run", ROWS)
    assert cli_main(["plot", str(tmp_path / "run")]) == 0
    out = tmp_path / "run" / "curves.png"
    assert capsys.readouterr().out.strip() == str(out)
    width, three_panels = _png_size(out)
    assert cli_main(["plot", str(tmp_path / "run"), "--keys", "reward/mean", "--out", str(tmp_path / "r.png")]) == 0
    assert _png_size(tmp_path / "r.png")[1] < three_panels  # one panel is shorter than three
    assert not list(tmp_path.rglob("*.tmp"))


def test_bad_inputs_name_what_is_wrong(tmp_path, capsys):
    with pytest.raises(PlotError, match="not a directory"):
        plot_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PlotError, match="no metrics.jsonl"):
        plot_run(tmp_path / "empty")
    _write(tmp_path / "run", ROWS)
    with (tmp_path / "run" / "metrics.jsonl").open("a") as f:
        f.write("{not json\n")
    with pytest.raises(PlotError, match=r"metrics.jsonl:4: not a JSON object"):
        plot_run(tmp_path / "run")
    _write(tmp_path / "ok", ROWS)
    assert cli_main(["plot", str(tmp_path / "ok"), "--keys", "critic/value_loss"]) == 2
    err = capsys.readouterr().err
    assert "'critic/value_loss'" in err and "reward/mean" in err  # names the key and lists what is there


EVAL_ROWS = [  # a run that evaluates: the starting weights as a step-0 row with no training keys
    {"step": 0, "val/held_out/accuracy": 0.1, "val/held_out/pass@1": 0.1, "val/held_out/pass@4": 0.3},
    *ROWS[:2],
    {**ROWS[2], "val/held_out/accuracy": 0.4, "val/held_out/pass@1": 0.4, "val/held_out/pass@4": 0.7},
]


def test_val_curves_go_beside_the_training_ones(tmp_path):
    _write(tmp_path / "plain", ROWS)
    _write(tmp_path / "evaluated", [{**r, "val/held_out/response_length": 3.0} for r in EVAL_ROWS])
    panels = val_panels(read_rows(tmp_path / "evaluated" / "metrics.jsonl"))
    assert list(panels) == ["held_out"]  # one panel per set: its accuracy and pass@k, not its length
    assert panels["held_out"] == {
        "val/held_out/accuracy": ([0, 3], [0.1, 0.4]),
        "val/held_out/pass@1": ([0, 3], [0.1, 0.4]),
        "val/held_out/pass@4": ([0, 3], [0.3, 0.7]),
    }
    plain = _png_size(plot_run(tmp_path / "plain"))
    evaluated = _png_size(plot_run(tmp_path / "evaluated"))
    assert evaluated[0] > 1.8 * plain[0] and evaluated[1] == plain[1]  # a second column, as tall
    assert _png_size(plot_run(tmp_path / "evaluated", ["reward/mean"], tmp_path / "one.png"))[0] == evaluated[0]
