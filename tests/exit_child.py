"""A script that saves and ends without close(): normally, with an exception, or on Ctrl-C (for
tests/test_failure.py), or after close(). The save is still being written when the script ends."""

import logging
import signal
import sys

import torch

import ckpt

root, how = sys.argv[1], sys.argv[2]
logging.basicConfig(level=logging.INFO)  # what each case says at exit is checked too
state = {"w": torch.arange(16 << 20, dtype=torch.float32)}  # 64 MiB
if how == "closed":  # nothing in flight at exit: nothing to say
    with ckpt.Checkpointer(root) as c:
        c.save(1, {"w": torch.arange(16 << 20, dtype=torch.float32)})
    sys.exit(0)
if how == "dropped":  # nobody keeps the Checkpointer: the save must still be finished at exit
    ckpt.Checkpointer(root).save(1, state)
else:
    c = ckpt.Checkpointer(root)
    c.save(1, state)
if how == "exception":
    raise RuntimeError("the training loop crashed")
if how == "sigint":
    # to this thread, and handled before raise_signal returns: os.kill(os.getpid(), …) let the kernel hand
    # the signal to an I/O thread, and on a loaded machine the main thread could reach the end of the
    # script before it noticed, ending with 0 instead of by the KeyboardInterrupt
    # Python's own handler even where this process was started with SIGINT ignored (a job sent to the
    # background by a shell ignores it, and Python then installs no KeyboardInterrupt for it)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.raise_signal(signal.SIGINT)
