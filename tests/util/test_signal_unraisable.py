"""A signal whose exception Python cannot propagate (it came while a ``__del__`` or a weakref callback ran) is not
lost and not printed as "Exception ignored": ``util.signals.install`` delivers it again, and the main flow raises
it. Real signals, in a child process."""

import signal
import subprocess
import sys
import textwrap

import pytest
from moments import default_signals

CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from fourd_mpi.errors import Terminated
    from fourd_mpi.util import signals

    signals.install()

    class Slow:
        def __del__(self):  # the signal arrives while this runs: its exception cannot leave __del__
            os.kill(os.getpid(), getattr(signal, sys.argv[1]))
            for _ in range(100000):
                pass

    try:
        obj = Slow()
        del obj
        for _ in range(2000):
            time.sleep(0.001)
        print("finished: the signal was lost")
    except Terminated as exc:
        print(f"terminated {exc.signum}")
    except KeyboardInterrupt as exc:
        print(f"interrupted {exc.signum}")
""")


@pytest.mark.parametrize("name, expected", [("SIGTERM", f"terminated {signal.SIGTERM}"),
                                            ("SIGHUP", f"terminated {signal.SIGHUP}"),
                                            ("SIGINT", f"interrupted {signal.SIGINT}")])
def test_a_signal_inside_a_destructor_reaches_the_main_flow(name, expected):
    # the child at the signals' defaults whatever this runner inherited (a background job ignores SIGINT, nohup
    # SIGHUP), as a command typed in a terminal has them
    proc = subprocess.run([sys.executable, "-c", CHILD, name], capture_output=True, text=True, timeout=60,
                          preexec_fn=default_signals)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_other_unraisable_exceptions_still_reach_the_previous_hook():
    child = textwrap.dedent("""
        from fourd_mpi.util import signals
        signals.install()

        class Broken:
            def __del__(self):
                raise ValueError("a real bug in a destructor")

        obj = Broken()
        del obj
        print("went on")
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "went on"
    assert "Exception ignored" in proc.stderr and "a real bug in a destructor" in proc.stderr
