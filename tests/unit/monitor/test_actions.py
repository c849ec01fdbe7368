"""Exclude file (deduplicated, atomic, safe with concurrent writers) and alert records."""

import threading

import pytest

from megatron_rl.monitor.actions import append_exclude, format_alerts, read_alerts, read_exclude, write_alerts
from megatron_rl.monitor.detect import Alert


def test_exclude_file_appends_in_order_without_duplicates(tmp_path):
    p = tmp_path / "run" / "exclude_hosts.txt"
    assert append_exclude(p, ["node3", "node1", "node3"]) == ["node3", "node1"]
    assert append_exclude(p, ["node1", " node7 ", ""]) == ["node7"]
    assert append_exclude(p, ["node7"]) == []
    assert p.read_text() == "node3\nnode1\nnode7\n"  # what `sbatch --exclude` will be given
    assert [f.name for f in p.parent.iterdir() if f.name.startswith(".")] == []  # no temp files left


def test_exclude_file_keeps_what_an_operator_wrote(tmp_path):
    p = tmp_path / "x.txt"
    p.write_text("# bad DIMM\nnode9\n\n")
    append_exclude(p, ["node2"])
    assert read_exclude(p) == ["node9", "node2"]


def test_concurrent_writers_lose_nothing(tmp_path):
    p = tmp_path / "x.txt"
    threads = [threading.Thread(target=append_exclude, args=(p, [f"n{i}", f"n{i + 1}"])) for i in range(0, 40, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(read_exclude(p)) == sorted(f"n{i}" for i in range(40))


def test_hostname_slurm_cannot_parse_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="whitespace or a comma"):
        append_exclude(tmp_path / "x.txt", ["a,b"])


def test_alerts_round_trip_and_table(tmp_path):
    alerts = [Alert("node1", "gpu_power", 10.0, 258.0, 7.5), Alert("node2", "cpu_util", 20.0, 270.0, 9.0)]
    p = tmp_path / "alerts.jsonl"
    write_alerts(p, alerts[:1])
    write_alerts(p, alerts[1:], append=True)
    assert read_alerts(p) == alerts
    write_alerts(p, [])  # a fresh detect run replaces the file
    assert read_alerts(p) == []
    table = format_alerts(alerts)
    assert "node1" in table and "gpu_power" in table and "258.0" in table
    assert format_alerts([]) == "no faulty machine declared"
