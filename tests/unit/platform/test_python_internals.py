"""The CPython accessor of the platform layer does what the interpreter's exit does first."""

import subprocess
import sys
import textwrap

from megatron_rl.platform import python_internals


def test_finish_threads_wakes_idle_pool_workers_and_joins_threads():
    """In a process of its own: afterwards the process cannot start thread-pool work again."""
    script = textwrap.dedent("""
        import threading, time
        from concurrent.futures import ThreadPoolExecutor
        from megatron_rl.platform.python_internals import finish_threads_as_at_exit

        done = []
        threading.Thread(target=lambda: (time.sleep(0.3), done.append(1))).start()
        pool = ThreadPoolExecutor(1)
        pool.submit(int).result()  # an idle worker that a plain join would wait on forever
        finish_threads_as_at_exit()
        alive = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
        print(done, alive)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[1] []"


def test_the_accessor_names_the_release_it_was_read_from():
    import threading

    assert callable(threading._shutdown)
    assert python_internals.PYTHON_VERSION in python_internals.finish_threads_as_at_exit.__doc__
