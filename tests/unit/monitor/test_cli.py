"""`python -m megatron_rl.monitor`: detect end to end, exit codes, config files."""

import argparse
import json

import numpy as np
import pytest

from megatron_rl.monitor.actions import read_exclude
from megatron_rl.monitor.cli import add_monitor_subcommands, main
from megatron_rl.monitor.trace import Trace, write_trace


def grid_to_csv(grid, path):
    k, i, t = np.nonzero(~np.isnan(grid.values))
    write_trace(
        Trace(
            t.astype(float),
            i.astype(np.int32),
            k.astype(np.int32),
            grid.values[k, i, t].astype(float),
            grid.machines,
            grid.metrics,
        ),
        path,
    )


def test_detect_finds_the_machine_and_writes_alerts(tmp_path, make_grid, capsys):
    trace = tmp_path / "trace.csv"
    grid_to_csv(make_grid(machines=8, duration=400, faults=[(6, "gpu_power", 50, 400, -9.0)]), trace)
    out, ex = tmp_path / "alerts.jsonl", tmp_path / "exclude.txt"
    rc = main(
        [
            "detect",
            "--trace",
            str(trace),
            "--out",
            str(out),
            "--model",
            "none",
            "--continuity-s",
            "120",
            "--threshold",
            "5",
            "--exclude-file",
            str(ex),
        ]
    )
    assert rc == 0
    alerts = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [(a["machine"], a["metric"]) for a in alerts] == [("node06", "gpu_power")]
    assert set(alerts[0]) == {"machine", "metric", "first_seen", "declared_at", "score"}
    assert read_exclude(ex) == ["node06"]
    printed = capsys.readouterr().out
    assert "8 machines" in printed and "node06" in printed


def test_detect_exits_0_when_nothing_is_found(tmp_path, make_grid):
    trace = tmp_path / "trace.csv"
    grid_to_csv(make_grid(machines=8, duration=300), trace)
    rc = main(["detect", "--trace", str(trace), "--out", str(tmp_path / "a.jsonl"), "--model", "none"])
    assert rc == 0 and (tmp_path / "a.jsonl").read_text() == ""


def test_bad_input_exits_2_with_the_reason(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("timestamp,machine,value\n0,a,1\n")
    assert main(["detect", "--trace", str(bad), "--model", "none"]) == 2
    assert "missing column(s) 'metric'" in capsys.readouterr().err
    cfg = tmp_path / "c.yaml"
    cfg.write_text("threshold: 4\nwindow: 8\n")
    good = tmp_path / "good.csv"
    good.write_text("timestamp,machine,metric,value\n0,a,cpu_util,1\n")
    assert main(["detect", "--trace", str(good), "--config", str(cfg), "--model", "none"]) == 2
    err = capsys.readouterr().err
    assert "unknown key(s) window" in err and "window_s" in err


def test_strict_turns_an_unknown_metric_into_exit_2_before_any_detection(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("timestamp,machine,metric,value\n0,a,cpu_util,1\n0,b,cpu_util,1\n0,a,cpu_utl,3\n")
    out = tmp_path / "a.jsonl"
    assert main(["detect", "--trace", str(trace), "--out", str(out), "--model", "none"]) == 0  # tolerated
    capsys.readouterr()
    out.unlink()
    assert main(["detect", "--trace", str(trace), "--out", str(out), "--model", "none", "--strict"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {trace}: unknown metric 'cpu_utl' (did you mean cpu_util?)")
    assert "\n" not in err and not out.exists()


def test_eval_takes_a_detect_config_and_refuses_an_unknown_key_in_one_line(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("crowd: 1\n")
    assert main(["eval", "--config", str(cfg), "--timing="]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {cfg}: unknown key(s) crowd; allowed:") and "continuity_s" in err
    assert "\n" not in err
    cfg.write_text("crowd_fraction: 1\n")  # a tuned constant (monitor/tuning.py), not a setting
    assert main(["eval", "--config", str(cfg), "--timing="]) == 2
    assert "unknown key(s) crowd_fraction" in capsys.readouterr().err


def test_eval_refuses_a_bad_duration_in_one_line_before_loading_a_model(capsys):
    assert main(["eval", "--generator", "coupled", "--duration-s", "100", "--timing=", "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: duration_s: 100; allowed: an integer from 300 to 86400"


def test_config_file_is_applied(tmp_path, make_grid):
    trace = tmp_path / "trace.csv"
    grid_to_csv(make_grid(machines=8, duration=400, faults=[(6, "gpu_power", 50, 400, -9.0)]), trace)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("detect:\n  threshold: 1000\n")  # nothing can pass this
    out = tmp_path / "a.jsonl"
    assert main(["detect", "--trace", str(trace), "--config", str(cfg), "--out", str(out), "--model", "none"]) == 0
    assert out.read_text() == ""


def test_subcommands_register_on_another_parser(tmp_path):
    parser = argparse.ArgumentParser(prog="megatron-rl")
    top = parser.add_subparsers(dest="cmd")
    add_monitor_subcommands(top.add_parser("monitor").add_subparsers(dest="monitor_cmd", required=True))
    args = parser.parse_args(["monitor", "detect", "--trace", "x.csv"])
    assert args.out == "alerts.jsonl" and args.func.__name__ == "cmd_detect"


def test_synth_writes_trace_and_labels(tmp_path):
    out = tmp_path / "s.csv"
    assert (
        main(
            [
                "synth",
                "--out",
                str(out),
                "--machines",
                "4",
                "--fault",
                "cpu_spike",
                "--duration-s",
                "120",
                "--seed",
                "3",
            ]
        )
        == 0
    )
    labels = json.loads((tmp_path / "s.labels.json").read_text())
    assert labels[0]["kind"] == "cpu_spike" and labels[0]["machine"].startswith("node")
    assert main(["synth", "--out", str(out), "--fault", "meteor"]) == 2


def test_the_installed_monitor_subcommands_are_listed_and_run(capsys):
    """eval, synth and train-synthetic are the lab's (entry points `monitor.*`); the runtime
    lists them in its help and hands them the rest of the command line."""
    from megatron_rl.commands import installed

    lab = installed("monitor")
    assert {"eval", "synth", "train-synthetic"} <= set(lab)
    assert all(lab[name].module.startswith("megatron_rl_lab.") for name in ("eval", "synth", "train-synthetic"))
    with pytest.raises(SystemExit):
        main(["--help"])
    printed = capsys.readouterr().out
    assert all(name in printed for name in ("detect", "train-denoiser", "eval", "synth", "train-synthetic"))
    with pytest.raises(SystemExit) as bad:
        main(["eval", "--machines", "8,x"])
    assert bad.value.code == 2 and "python -m megatron_rl.monitor eval" in capsys.readouterr().err


def test_train_denoiser_needs_traces_of_the_cluster(capsys):
    with pytest.raises(SystemExit) as bad:
        main(["train-denoiser", "--out", "x"])
    assert bad.value.code == 2 and "--trace" in capsys.readouterr().err
