"""A script that saves and ends without close(): normally, with an exception, or on Ctrl-C (for
tests/test_failure.py). The save is still being written when the script ends."""

import os
import signal
import sys

import torch

import ckpt

root, how = sys.argv[1], sys.argv[2]
state = {"w": torch.arange(16 << 20, dtype=torch.float32)}  # 64 MiB
if how == "dropped":  # nobody keeps the Checkpointer: the save must still be finished at exit
    ckpt.Checkpointer(root).save(1, state)
else:
    c = ckpt.Checkpointer(root)
    c.save(1, state)
if how == "exception":
    raise RuntimeError("the training loop crashed")
if how == "sigint":
    os.kill(os.getpid(), signal.SIGINT)
