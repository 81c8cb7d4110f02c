"""The parts of the GPU snapshot that run without a GPU: the CUDA library's load-time checks (ABI,
probe, the fallback decision), handing optimizers to a save, and the GPU readiness script.
tests/test_gpu.py holds what needs a device."""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import shutil
import subprocess
import sys
import threading
import weakref

import pytest
import torch

from ckpt import _ext
from ckpt.errors import ConfigError
from ckpt.save import cuda_snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
P = _ext.CudaProbe
built = _ext._find("_cuda_copy")
needs_build = pytest.mark.skipif(built is None, reason="CUDA core not built (no nvcc, or CKPT_NO_CUDA)")
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU gets")


# -- the verdict: can this build run on a device? (a pure function of what the probe reports) --------
def test_a_build_whose_driver_and_kernel_fit_is_used():
    assert _ext.cuda_verdict(P(driver=13000, runtime=13000, capability=(9, 0), kernel_error=0)) is None
    # a 13.x runtime runs on any 13.x driver (minor version compatibility)
    assert _ext.cuda_verdict(P(driver=13000, runtime=13010, capability=(8, 0), kernel_error=0)) is None


def test_an_older_driver_is_named_with_both_versions_and_the_fix():
    why = _ext.cuda_verdict(P(driver=12040, runtime=13000, capability=(9, 0), kernel_error=0))
    assert why is not None and "CUDA 12.4" in why and "CUDA 13.0" in why and "error 35" in why
    assert "Update the driver" in why and "12.x toolkit" in why
    # the probe's own error 35 says the same, whatever the version numbers claim
    assert "error 35" in _ext.cuda_verdict(P(driver=13000, runtime=13000, capability=(9, 0), kernel_error=35))


@pytest.mark.parametrize("code", [_ext.ERR_NO_KERNEL_IMAGE, _ext.ERR_INVALID_DEVICE_FUNCTION])
def test_a_gpu_without_a_kernel_image_is_named_with_the_arch_to_build(code):
    why = _ext.cuda_verdict(P(driver=13000, runtime=13000, capability=(7, 5), kernel_error=code))
    assert why is not None and "compute capability 7.5" in why and 'CKPT_CUDA_ARCHS="75"' in why
    assert f"error {code}" in why


def test_no_driver_ptx_too_new_and_other_errors_are_refused():
    assert "no NVIDIA driver" in _ext.cuda_verdict(P(driver=0, runtime=13000, capability=(0, 0), kernel_error=35))
    ptx = _ext.cuda_verdict(P(driver=13000, runtime=13000, capability=(12, 0), kernel_error=_ext.ERR_UNSUPPORTED_PTX))
    assert ptx is not None and "PTX" in ptx and "error 222" in ptx
    other = _ext.cuda_verdict(P(driver=13000, runtime=13000, capability=(9, 0), kernel_error=2), "out of memory")
    assert other is not None and "error 2, out of memory" in other


# -- the built library -------------------------------------------------------------------------------
@needs_build
def test_the_built_library_reports_this_ckpts_abi():
    core = _ext.CudaCore(ctypes.CDLL(built), built)
    assert core.lib.ckpt_cuda_abi_version() == _ext.CUDA_ABI_VERSION


@needs_build
def test_a_library_built_for_another_abi_is_refused_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(_ext, "CUDA_ABI_VERSION", _ext.CUDA_ABI_VERSION + 1)
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        assert _ext._load("_cuda_copy", _ext.CudaCore) is None
    [rec] = [r for r in caplog.records if "could not load" in r.getMessage()]
    assert f"built for CUDA ABI {_ext.CUDA_ABI_VERSION - 1}" in rec.getMessage() and "reinstall" in rec.getMessage()


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_a_library_from_before_the_abi_version_is_refused(tmp_path, caplog):
    """A ckpt/_cuda_copy*.so left by an older ckpt exports the copies but no ckpt_cuda_abi_version."""
    src = tmp_path / "old.c"
    src.write_text("int ckpt_cuda_copy_kernel(void) { return 0; }\nint ckpt_cuda_copy_memcpy(void) { return 0; }\n")
    so = tmp_path / "_cuda_copy.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        assert _ext._load(str(tmp_path / "_cuda_copy"), _ext.CudaCore) is None
    assert any("could not load" in r.getMessage() for r in caplog.records)


@needs_build
@no_gpu
def test_the_probe_of_the_real_library_here_finds_no_driver_and_the_snapshot_falls_back_once(caplog):
    """Not a stand-in: the statically linked runtime really asks for a driver, finds none on this
    machine, and the decision made from it sends the copies to torch with one warning per device."""
    core = _ext.CudaCore(ctypes.CDLL(built), built)
    p = core.probe(0)
    assert p.driver == 0 and p.runtime >= 12000 and p.kernel_error != 0
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        assert cuda_snapshot.native_core(core, torch.device("cuda", 0)) is None
        assert cuda_snapshot.native_core(core, torch.device("cuda", 0)) is None
    [rec] = [r for r in caplog.records if "cannot run on GPU 0" in r.getMessage()]
    assert "no NVIDIA driver" in rec.getMessage() and "torch's copies" in rec.getMessage()
    assert cuda_snapshot.native_core(None, torch.device("cuda", 0)) is None  # no library: torch's copies, silently


# -- handing optimizers to a save ----------------------------------------------------------------------
def _sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(4))], lr=0.1)


def test_guarding_hands_optimizers_over_on_this_thread_only_and_nests():
    a, b = _sgd(), _sgd()
    other: list[tuple] = []
    with cuda_snapshot.guarding([a]):
        with cuda_snapshot.guarding([b]):
            assert cuda_snapshot.handed_over() == (a, b)
            t = threading.Thread(target=lambda: other.append(cuda_snapshot.handed_over()))
            t.start()
            t.join()
        assert cuda_snapshot.handed_over() == (a,)
    assert cuda_snapshot.handed_over() == () and other == [()]


def test_guarding_refuses_what_is_not_an_optimizer_before_handing_anything_over():
    opt = _sgd()
    with pytest.raises(ConfigError, match="takes torch.optim.Optimizer objects, got dict"):
        with cuda_snapshot.guarding([opt, opt.state_dict()]):
            pass
    assert cuda_snapshot.handed_over() == ()


def test_stepping_optimizers_are_noted_and_forgotten_when_they_go():
    cuda_snapshot.track_stepping_optimizers()
    cuda_snapshot.track_stepping_optimizers()  # once per process
    opt, idle = _sgd(), _sgd()
    opt.param_groups[0]["params"][0].grad = torch.ones(4)
    opt.step()
    noted = cuda_snapshot.stepping_optimizers()
    assert any(o is opt for o in noted) and not any(o is idle for o in noted)
    gone = weakref.ref(opt)
    del noted, opt
    gc.collect()
    assert gone() is None  # noting an optimizer does not keep it alive


# -- ready for the first GPU ----------------------------------------------------------------------------
def test_the_gpu_readiness_script_parses_and_names_its_phases():
    script = os.path.join(ROOT, "benchmarks", "gpu_ready.sh")
    subprocess.run(["bash", "-n", script], check=True)
    out = subprocess.run(["bash", script, "--help"], capture_output=True, text=True, check=True).stdout
    for phase in ("build", "test", "sanitize", "bench"):
        assert phase in out


def test_the_gpu_benchmark_explains_itself_without_a_gpu():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_snapshot.py"), "--help"],
                         capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(  # ROOT first, the rest kept
                             filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}).stdout
    assert "async_save" in out and "--quick" in out
