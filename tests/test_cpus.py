"""Thread pools are sized by the CPUs the process may use, not the machine's count."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ckpt import _cpus


def test_a_process_pinned_to_one_cpu_sizes_its_pools_for_one():
    one = min(os.sched_getaffinity(0))
    code = (f"import os, json; os.sched_setaffinity(0, {{{one}}}); "
            "from ckpt import _cpus; from ckpt.storage.local import LocalStorage; from ckpt.options import Options; "
            "from ckpt.peers import erasure; "
            "print(json.dumps([_cpus.usable(), LocalStorage.read_width, Options().threads, "
            "erasure.THREADS]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    usable, read_width, io_threads, parity_threads = json.loads(out.stdout.strip().splitlines()[-1])
    assert usable == read_width == parity_threads == 1
    assert io_threads == 8  # twice the usable CPUs, at least 8


def test_a_cgroup_quota_caps_the_count(tmp_path):
    f = tmp_path / "cpu.max"
    for text, want in [("max 100000\n", None), ("150000 100000\n", 2), ("50000 100000", 1),
                       ("400000 100000", 4), ("garbage", None), ("", None)]:
        f.write_text(text)
        assert _cpus._cgroup_quota(str(f)) == want, text
    assert _cpus._cgroup_quota(str(tmp_path / "absent")) is None
    assert 1 <= _cpus.usable() <= len(os.sched_getaffinity(0))
