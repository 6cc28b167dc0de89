"""kerf's C++ work (compiles, CPU kernels, synchronizing calls) runs without the
GIL, a Ctrl-C that arrives meanwhile raises KeyboardInterrupt as soon as the
call returns, and a Ctrl-C during an autotuning pass stops the pass within one
candidate (a compile or a timed run), storing no choice."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest


def big_dora(rows=2048, cols=8192, r=16):
    rng = np.random.default_rng(3)
    return (rng.standard_normal((rows, cols), dtype=np.float32), rng.standard_normal((r, cols), dtype=np.float32),
            rng.standard_normal((rows, r), dtype=np.float32), np.ones(rows, np.float32))


def test_other_python_threads_run_while_kerf_works(kerf_cpu):
    args = big_dora(rows=4096)
    kerf_cpu.ops.dora_norm(*args, 0.5)  # compiled and warm
    calls = 5
    done = threading.Event()
    ticks = 0

    def worker():
        for _ in range(calls):
            kerf_cpu.ops.dora_norm(*args, 0.5)
        done.set()

    th = threading.Thread(target=worker)
    t0 = time.perf_counter()
    th.start()
    while not done.is_set():
        ticks += 1
        time.sleep(0.001)
    th.join()
    elapsed = time.perf_counter() - t0
    # Holding the GIL through each C++ call would let this loop run only between calls (~calls ticks).
    assert ticks >= 4 * calls, f"the main thread ran {ticks} times in {elapsed * 1e3:.0f} ms of {calls} calls"


class Interrupted(Exception):
    pass


def test_ctrl_c_during_a_call_raises_as_soon_as_the_call_returns(kerf_cpu):
    args = big_dora(rows=4096)
    kerf_cpu.ops.dora_norm(*args, 0.5)
    t0 = time.perf_counter()
    kerf_cpu.ops.dora_norm(*args, 0.5)
    one_call = time.perf_counter() - t0
    if one_call < 0.02:
        pytest.skip(f"a call takes {one_call * 1e3:.1f} ms here: too short to interrupt reliably")

    # kerf.ops.dora_norm is the binding itself (no Python frame of its own): Python
    # runs the handler as the call returns, before the statement after it.
    returned = [False]

    def handler(signum, frame):
        raise Interrupted("after the call" if returned[0] else "during the call")

    old = signal.signal(signal.SIGINT, handler)
    try:
        for _ in range(3):  # the timer thread may fire before the call starts: try again
            returned[0] = False
            timer = threading.Timer(one_call / 4, signal.raise_signal, args=(signal.SIGINT,))
            t0 = time.perf_counter()
            timer.start()
            with pytest.raises(Interrupted) as e:
                kerf_cpu.ops.dora_norm(*args, 0.5)
                returned[0] = True
                time.sleep(5)  # not reached when the interrupt comes out of the call
            elapsed = time.perf_counter() - t0
            timer.join()
            if str(e.value) == "during the call":
                assert elapsed < 3 * one_call + 0.5
                return
        pytest.fail(f"the interrupt never arrived during a call (last raised {e.value})")
    finally:
        signal.signal(signal.SIGINT, old)


TUNE_SCRIPT = textwrap.dedent("""
    import signal, sys, threading, time
    import numpy as np
    import kerf
    rng = np.random.default_rng(0)
    rows, cols, r = 1024, 4096, 16
    args = (rng.standard_normal((rows, cols), dtype=np.float32), rng.standard_normal((r, cols), dtype=np.float32),
            rng.standard_normal((rows, r), dtype=np.float32), np.ones(rows, np.float32))
    if len(sys.argv) > 1:
        threading.Timer(float(sys.argv[1]), signal.raise_signal, args=(signal.SIGINT,)).start()
    t0 = time.perf_counter()
    try:
        kerf.ops.dora_norm(*args, 0.5)
        print("done", time.perf_counter() - t0)
    except KeyboardInterrupt:
        print("interrupted", time.perf_counter() - t0)
""")


def tune_in_a_fresh_process(tmp_path, *argv):
    """Runs one dora_norm call that tunes (KERF_AUTOTUNE=force, an empty cache) in
    a new process; returns how it ended and after how many seconds."""
    env = dict(os.environ, KERF_AUTOTUNE="force", KERF_CACHE_DIR=str(tmp_path / f"cache{len(argv)}"),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", TUNE_SCRIPT, *argv], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    how, seconds = out.stdout.split()
    return how, float(seconds)


def test_ctrl_c_stops_an_autotuning_pass_within_a_candidate(kerf_cpu, tmp_path):
    how, full = tune_in_a_fresh_process(tmp_path)
    assert how == "done"
    how, seconds = tune_in_a_fresh_process(tmp_path, str(full / 5))
    assert how == "interrupted"
    # Without the tuner's interrupt check the call would return only after the whole pass.
    assert seconds < 0.8 * full, f"interrupted after {seconds:.2f} s of a {full:.2f} s tuning pass"


THREADS_SCRIPT = textwrap.dedent("""
    import numpy as np
    import kerf
    rng = np.random.default_rng(5)
    W, A, B = (rng.standard_normal(s, dtype=np.float32) for s in [(40, 72), (4, 72), (40, 4)])
    expected = W + 0.5 * (B.astype(np.float64) @ A)
    try:
        kerf.ops.lora_merge(W, A, B, 0.5)
    except ValueError as e:
        print("refused", e)
    else:
        print("ran", float(np.max(np.abs(W - expected))))
""")


@pytest.mark.parametrize("value,outcome", [
    ("3", "ran"), (" 3\t", "ran"), ("   ", "ran"),  # blanks around a number, or only blanks (as unset)
    ("abc", "refused"), ("0", "refused"), ("4097", "refused"), ("2 threads", "refused"),
])
def test_kerf_cpu_threads_takes_a_whole_number_with_blanks_around_it(kerf_cpu, tmp_path, value, outcome):
    # The CPU back end's thread pool reads KERF_CPU_THREADS once per process.
    env = dict(os.environ, KERF_CPU_THREADS=value, KERF_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", THREADS_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    how, detail = out.stdout.split(maxsplit=1)
    assert how == outcome, out.stdout
    if how == "ran":
        assert float(detail) <= 1e-5
    else:
        assert "KERF_CPU_THREADS must be a whole number from 1 to 4096" in detail
