"""Builds the native training kernels at install time (everything else is in pyproject.toml).

Each C source in ``training/objectives/kernels/`` is compiled once per dtype flavour and
instruction-set level (``training/objectives/kernels/levels.py``) into a shared library in the
package; at run time :mod:`training.objectives.native` loads the best level this CPU supports
with ctypes. Nothing is compiled when training runs, so the training image needs no compiler.

The libraries are plain C (no Python module init): built as setuptools extensions only so
that the build backend compiles them, names them per interpreter and places them in the wheel
(or in the source tree for an editable install). Each is ``optional``: where a level cannot be
built (no C compiler, a compiler too old for the level's ``-march``), the install goes on
without it and training takes the next level or the torch path, which it records
(``NCA.kernels_``, report.json ``kernels``). The serve image copies ``service/`` only: without
the sources, nothing is built.
"""

import platform
import runpy
from pathlib import Path

from setuptools import Extension, setup

KERNELS = Path("training/objectives/kernels")


def kernel_extensions() -> list[Extension]:
    if not (KERNELS / "levels.py").is_file():
        return []
    table = runpy.run_path(str(KERNELS / "levels.py"))
    extensions = []
    for library, stem, defines in table["LIBRARIES"]:
        for level, flags, _needs in table["levels_for"](platform.machine()):
            extensions.append(
                Extension(
                    f"training.objectives.kernels.{library}_{level}",
                    sources=[str(KERNELS / f"{stem}.c")],
                    define_macros=[(name, None) for name in defines],
                    extra_compile_args=["-O3", "-std=c99", "-g0", *flags],
                    libraries=["m"],
                    optional=True,
                )
            )
    return extensions


setup(ext_modules=kernel_extensions())
