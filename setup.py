"""Build the optional compiled core (csrc/). Everything else about the package is in pyproject.toml.

* ``ckpt/_copyhash*.so`` (C++, fused copy + xxh3-128; byte planes, XOR and rANS for the codecs):
  built whenever a C++ compiler is there.
* ``ckpt/_cuda_copy*.so`` (CUDA, batched device-to-host copy): built when ``nvcc`` is found
  (``$CUDA_HOME/bin/nvcc`` or on PATH), whether or not this machine has a GPU.

Neither links against torch (plain C ABIs loaded with ctypes), so the build needs no torch and works
under pip's build isolation. Without a compiler or toolkit the package installs anyway and ckpt uses
its pure-Python paths. Environment:

* ``CKPT_NO_EXT=1``: compile nothing.      * ``CKPT_NO_CUDA=1``: skip the CUDA part only.
* ``CKPT_BUILD_STRICT=1``: a compile error fails the install (CI sets it).
* ``CKPT_CUDA_ARCHS="80;90"``: GPU architectures (default 75, 80, 90, plus PTX for newer GPUs). 75 (Turing:
  T4, RTX 20xx) is the oldest CUDA 13 builds for; a GPU with no image here gets torch's copies, with a warning.
"""

import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


STRICT = _flag("CKPT_BUILD_STRICT")
DEFAULT_ARCHS = "75;80;90"  # oldest first: the last also goes in as PTX, which newer GPUs compile at load


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


class BuildCore(build_ext):
    """Compile C++ with the usual toolchain and .cu sources with nvcc; failures are warnings unless strict."""

    def build_extension(self, ext):
        try:
            if ext.sources[0].endswith(".cu"):
                self._build_cuda(ext)
            else:
                super().build_extension(ext)
        except Exception as e:
            if STRICT:
                raise
            print(f"ckpt: WARNING: {ext.name} was not built ({e}); the pure-Python path will be used",
                  file=sys.stderr)

    def _build_cuda(self, ext):
        nvcc = _nvcc()
        out = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        archs = [a for a in os.environ.get("CKPT_CUDA_ARCHS", DEFAULT_ARCHS).replace(",", ";").split(";") if a.strip()]
        gencode = []
        for a in archs:
            gencode += ["-gencode", f"arch=compute_{a.strip()},code=sm_{a.strip()}"]
        newest = archs[-1].strip()
        gencode += ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]  # PTX: runs on newer GPUs too
        cmd = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", *gencode, "-o", out, *ext.sources]
        print("ckpt: " + " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True)


def _extensions() -> list:
    if _flag("CKPT_NO_EXT"):
        return []
    sources = ["csrc/copyhash.cpp", "csrc/planes.cpp", "csrc/rans.cpp", "csrc/rans_encode.cpp", "csrc/chain.cpp",
               "csrc/mask.cpp"]
    exts = [Extension("ckpt._copyhash", sources, language="c++",
                      depends=["csrc/core.h", "csrc/rans.h"],
                      extra_compile_args=["-O3", "-std=c++17", "-pthread"], extra_link_args=["-pthread"],
                      optional=not STRICT)]
    if not _flag("CKPT_NO_CUDA") and _nvcc():
        exts.append(Extension("ckpt._cuda_copy", ["csrc/cuda/batched_copy.cu"], optional=not STRICT))
    return exts


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildCore})
