"""Every process that may train in bf16 keeps oneDNN on AVX2 (issue 24 item 24).

On machines that report AMX/AVX512-BF16 without enabling it, oneDNN's bf16 matmul dies of SIGILL
(exit -4): ``test_delta_benchmark_script_runs`` passed or failed by the machine CI landed on. The
test process sets ``ONEDNN_MAX_CPU_ISA=AVX2`` in conftest.py (the processes it starts inherit it), and
every benchmark or example script that uses bf16 sets it for itself, before torch loads oneDNN. ckpt
itself never sets it: that is the training process's choice.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SETTING = ("ONEDNN_MAX_CPU_ISA", "AVX2")


def _set_before_any_other_import(path: pathlib.Path) -> bool:
    """Does ``path`` call ``os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")`` at module level with
    nothing imported before it but ``os`` (and ``__future__``)? Anything else imported first may
    import torch."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        if isinstance(node, ast.Import) and [a.name for a in node.names] == ["os"]:
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return False
        call = node.value if isinstance(node, ast.Expr) else None
        if (isinstance(call, ast.Call) and ast.unparse(call.func) == "os.environ.setdefault"
                and tuple(ast.literal_eval(a) for a in call.args) == SETTING):
            return True
    return False


def _uses_bf16(path: pathlib.Path) -> bool:
    """Names bf16 and imports torch (a script that only prints bf16 results, benchmarks/report.py, runs
    no matmul)."""
    text = path.read_text()
    return ("bfloat16" in text or "bf16" in text) and re.search(r"^\s*(import|from)\s+torch\b", text, re.M) is not None


SCRIPTS = sorted(p for d in ("benchmarks", "examples") for p in (ROOT / d).glob("*.py") if _uses_bf16(p))


def test_the_check_sees_the_bf16_trainings():
    names = {p.name for p in SCRIPTS}
    assert {"delta.py", "dcp_backend.py"} <= names  # the CPU trainings in bf16 today


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_script_using_bf16_keeps_onednn_on_avx2(script):
    assert _set_before_any_other_import(script), (
        f"{script.relative_to(ROOT)} uses bf16: put os.environ.setdefault{SETTING!r} right after `import os`, "
        "before anything that may import torch")


def test_the_test_process_and_its_children_keep_onednn_on_avx2():
    assert _set_before_any_other_import(ROOT / "tests" / "conftest.py")
    assert os.environ.get(SETTING[0]) is not None  # set in this process, so inherited by the ones it starts


def test_ckpt_itself_never_sets_it():
    for path in (ROOT / "ckpt").rglob("*.py"):
        assert SETTING[0] not in path.read_text(), path
