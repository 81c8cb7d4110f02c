"""Node loss: local commits, replicas, parity and restore from peers, behind one seam of the commit
and load paths (see :mod:`ckpt.peers.local_commits`). Nothing here is imported by a plain save or
load (no ``local_dir`` commits): the core knows only the hooks."""
