"""Ctrl-C as a stop request: SIGINT ranks above the scheduler's signals, and a second one
ends the process at once, with one line and the shell's status for SIGINT (130)."""

import os
import signal
import subprocess
import sys

from megatron_rl.launch.signals import INTERRUPTED, StopSignals, stop_line


def test_ctrl_c_is_the_strongest_stop_request():
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.agree() == signal.SIGINT
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.agree() == signal.SIGUSR1  # one Ctrl-C later would outrank it; none came


def test_a_second_ctrl_c_ends_the_process_at_once_without_a_traceback():
    script = (
        "import os, signal, time\n"
        "from megatron_rl.launch.signals import StopSignals\n"
        "with StopSignals() as stop:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    print('first:', stop.received.name, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(30)\n"
        "print('not reached')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == INTERRUPTED == 130
    assert proc.stdout == "first: SIGINT\n"
    assert proc.stderr == "megatron-rl: second Ctrl-C: stopping now, without a checkpoint of this step\n"


def test_the_stop_line_says_why_where_and_how_to_go_on():
    assert stop_line(signal.SIGINT, 7, "runs/x/checkpoints") == (
        "stopped on SIGINT after step 7 (Ctrl-C); checkpoint saved in runs/x/checkpoints; "
        "the same command resumes from it"
    )
