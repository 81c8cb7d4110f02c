"""Run an example (its file name in examples/, then its arguments) as torchrun's worker and fail if
the interpreter starts finalizing while the process group's gloo worker threads still run.

A worker running then may drop its last reference to a finished collective during the
finalization; those tensors need the GIL, the finalizing interpreter ends the thread instead, and
the process aborts ("terminate called without an active exception", SIGABRT after "done"). The
abort needs a worker that is slow to drop its reference, so it is rare; the workers being alive when
the finalization starts is not, and that is what this checks (tests/test_chaos.py).
"""

import atexit
import os
import runpy
import sys


def gloo_threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended while we looked
            pass
    return sorted(n for n in names if "gloo" in n)


def check() -> None:  # atexit: the interpreter is about to finalize
    left = gloo_threads()
    if left:
        print(f"rank {os.environ.get('RANK')}: the interpreter finalizes with gloo threads running: {left}",
              file=sys.stderr, flush=True)
        os._exit(3)


atexit.register(check)
example = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", sys.argv[1])
sys.argv = [example, *sys.argv[2:]]
runpy.run_path(example, run_name="__main__")
