"""A training process ends without the interpreter's teardown, but only after what the
outside world sees of it is finished: threads that are not daemons, log files, the
standard streams. Exit handlers (vLLM's engine shutdown among them) do not run."""

import os
import subprocess
import sys
import textwrap


def test_end_process_finishes_threads_logs_and_streams_then_skips_the_exit_handlers(tmp_path):
    """The idle thread-pool worker is what hung a trainer launch when the process joined its
    threads by hand (vLLM or the trainer leave such pools open)."""
    script = textwrap.dedent(f"""
        import atexit, logging, logging.handlers, sys, threading, time
        from concurrent.futures import ThreadPoolExecutor
        from pathlib import Path
        from megatron_rl.launch.process_exit import end_process

        out = Path({str(tmp_path)!r})
        def late_writer():
            time.sleep(0.3)
            (out / "thread.txt").write_text("written")
        threading.Thread(target=late_writer).start()
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # not waited for
        pool = ThreadPoolExecutor(1)
        pool.submit(int).result()  # an idle worker, not a daemon, until the pool is told to stop
        # Held in memory until flushed: a normal exit flushes it (logging.shutdown at exit).
        handler = logging.handlers.MemoryHandler(100, target=logging.FileHandler(out / "run.log"))
        logging.getLogger("run").addHandler(handler)
        logging.getLogger("run").setLevel(logging.INFO)
        logging.getLogger("run").info("step 3 done")
        atexit.register(lambda: (out / "atexit.txt").write_text("ran"))
        sys.stdout.write("no newline, still buffered")
        end_process(75)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout to a pipe is buffered
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 75, proc.stderr
    assert proc.stdout == "no newline, still buffered"
    assert (tmp_path / "thread.txt").read_text() == "written"
    assert (tmp_path / "run.log").read_text() == "step 3 done\n"
    assert not (tmp_path / "atexit.txt").exists()


def test_when_the_quick_exit_fails_the_process_exits_normally_with_the_same_code(tmp_path):
    """A module named vllm without vLLM's process groups: freeing its shared memory fails, and
    the run's code still comes out, through the normal exit (its handlers run)."""
    script = textwrap.dedent(f"""
        import atexit, sys, types
        from pathlib import Path
        from megatron_rl.launch.process_exit import end_process

        sys.modules["vllm"] = types.ModuleType("vllm")
        atexit.register(lambda: Path({str(tmp_path)!r}, "atexit.txt").write_text("ran"))
        end_process(75)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 75, proc.stderr
    assert "megatron-rl: quick exit not possible (ModuleNotFoundError" in proc.stderr
    assert (tmp_path / "atexit.txt").read_text() == "ran"
