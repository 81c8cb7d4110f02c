"""The seams between the core and local commits hold: the loader knows neither the commit protocol nor
the peers, and a plain save and load never load ckpt.peers."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import ckpt

ROOT = pathlib.Path(ckpt.__file__).parent


def imported(module: str) -> set[str]:
    """The ckpt modules ``module`` (a file under ckpt/) imports, as dotted names relative to ckpt."""
    tree = ast.parse((ROOT / module).read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            out.add(node.module or "")
    return out


def test_loader_and_commit_know_no_tiers():
    for module in ("loader.py", "fill.py", "commit.py", "writer.py"):
        names = imported(module)
        assert not any(n.startswith("peers") or n.startswith("storage.tiered") for n in names), (module, names)
    assert "commit" not in imported("loader.py")


def test_a_plain_save_and_load_never_load_the_peers(tmp_path):
    code = f"""
import sys, torch, ckpt
with ckpt.Checkpointer({str(tmp_path / 'ck')!r}) as c:
    c.save(1, {{"w": torch.ones(4)}}).wait()
    s = {{"w": torch.zeros(4)}}
    assert c.load("latest", s) == 1 and bool(s["w"].eq(1).all())
print(sorted(m for m in sys.modules if m.startswith("ckpt.peers")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
