"""Serve ``oasis_sglang.cpu.sgl_kernel_ops`` as ``sgl_kernel`` on hosts without CUDA.

Imported at interpreter start by ``oasis_sglang_cpu.pth`` (installed into site-packages by
the wheel), so SGLang's own processes — including the scheduler subprocesses it spawns —
get the CPU ops without a wrapper script. It installs a meta-path finder for the single
name ``sgl_kernel``; the finder decides only when ``sgl_kernel`` is first imported, and
steps aside (the real package loads) whenever ``libcuda.so.1`` can be loaded.
Nothing here imports torch at start-up. ``OASIS_DISABLE_CPU_SHIM=1`` turns it off.
"""

import importlib.abc
import importlib.machinery
import os
import sys

_NAME = "sgl_kernel"


def cuda_driver_present() -> bool:
    """True when the CUDA driver library can be loaded (a GPU host)."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        from oasis_sglang.cpu import sgl_kernel_ops as cpu_ops

        for name in cpu_ops.__all__:
            setattr(module, name, getattr(cpu_ops, name))
        module.__oasis_cpu_shim__ = True
        module.__version__ = "0.0.0+oasis-cpu-shim"

        def __getattr__(name):
            raise AttributeError(
                f"sgl_kernel.{name} is not available on this CPU host: oasis-sglang provides only "
                f"{', '.join(cpu_ops.__all__)} (the ops SGLang's CPU torch_native path calls)")

        module.__getattr__ = __getattr__


_SUBMODULES = ("sgl_kernel.speculative",)      # ``from sgl_kernel.speculative import ...`` (NGRAM)


class SglKernelCpuFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if (fullname != _NAME and fullname not in _SUBMODULES) or cuda_driver_present():
            return None
        spec = importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=fullname == _NAME)
        if fullname == _NAME:
            spec.submodule_search_locations = []
        return spec


def install() -> None:
    if os.environ.get("OASIS_DISABLE_CPU_SHIM") == "1":
        return
    if not any(isinstance(f, SglKernelCpuFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, SglKernelCpuFinder())


install()
