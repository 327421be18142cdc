"""Ships ``oasis_sglang_cpu.pth`` at the root of site-packages (pyproject has the rest).

The .pth runs ``import oasis_sglang.cpu.finder`` at interpreter start, so SGLang's
CPU engine finds the torch ``sgl_kernel`` ops in every process it spawns, with no wrapper.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "oasis_sglang_cpu.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        dst = Path(self.build_lib) / PTH
        dst.write_text(Path(PTH).read_text())

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [str(Path(self.build_lib) / PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
