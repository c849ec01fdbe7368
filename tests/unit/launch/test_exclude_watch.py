"""ExcludeWatch: a node listed in the exclude file while the job runs asks for a stop (as SIGUSR1)."""

from __future__ import annotations

import signal

from megatron_rl.launch.exclude import ExcludeWatch
from megatron_rl.launch.signals import StopSignals
from megatron_rl.monitor.actions import append_exclude


def test_the_watch_sees_this_node_once_the_monitor_lists_it(tmp_path):
    watch = ExcludeWatch(tmp_path, "node-b")
    assert not watch.listed()  # no file yet
    append_exclude(tmp_path / "monitor" / "exclude_hosts.txt", ["node-a"])  # the monitor's own writer
    assert not watch.listed()
    append_exclude(tmp_path / "monitor" / "exclude_hosts.txt", ["node-b"])
    assert watch.listed() and watch.listed()


def test_a_listed_node_stops_the_run_as_sigusr1_would(tmp_path):
    (tmp_path / "monitor").mkdir()
    with StopSignals(exclude=ExcludeWatch(tmp_path, "node-b")) as stop:
        assert stop.agree() is None
        (tmp_path / "monitor" / "exclude_hosts.txt").write_text("# operator\nnode-b\n")
        assert stop.agree() is signal.SIGUSR1  # save, requeue (and the requeue excludes node-b)


def test_only_inside_a_slurm_job(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert ExcludeWatch.in_job(tmp_path) is None
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURMD_NODENAME", "node-b")
    assert ExcludeWatch.in_job(tmp_path).node == "node-b"
