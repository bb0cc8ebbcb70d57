"""Installs dflash_mlx_blas.pth into site-packages beside the package, for wheels and editable installs alike.

At interpreter start-up Python runs the `import` lines of every .pth file in site-packages. Ours loads
dflash_mlx/_blas.py on its own (stdlib only; the rest of dflash_mlx and mlx are not imported) and calls
`startup()`: on Linux, when mlx is installed, it loads the fast BLAS before anything can import mlx, so
`import mlx_lm` before `import dflash_mlx` keeps the fast path (docs/cpu-performance.md). Everything else about
the package is in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel
from setuptools.command.sdist import sdist

PTH = "dflash_mlx_blas.pth"
HERE = Path(__file__).resolve().parent


class build_py_with_pth(build_py):
    """Regular wheels: put the .pth at the top of build_lib, which becomes site-packages."""

    def run(self):
        super().run()
        if not self.editable_mode:
            self.copy_file(str(HERE / PTH), str(Path(self.build_lib, PTH)), preserve_mode=0)


class _WithPth:
    """Wraps setuptools' editable strategy (the .pth or finder it writes) and adds our .pth to the wheel."""

    def __init__(self, strategy):
        self.strategy = strategy

    def __call__(self, wheel, files, mapping):
        self.strategy(wheel, files, mapping)
        wheel.writestr(PTH, (HERE / PTH).read_bytes())

    def __enter__(self):
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc):
        return self.strategy.__exit__(*exc)


class editable_wheel_with_pth(editable_wheel):
    """`pip install -e .`: the editable wheel holds setuptools' own .pth/finder, and ours (it points at the
    checkout's dflash_mlx/_blas.py through the finder, so edits there take effect)."""

    def _select_strategy(self, name, tag, build_lib):
        return _WithPth(super()._select_strategy(name, tag, build_lib))


class sdist_with_pth(sdist):
    """Source distributions carry the .pth, so a wheel built from one has it too."""

    def add_defaults(self):
        super().add_defaults()
        self.filelist.append(PTH)


setup(cmdclass={"build_py": build_py_with_pth, "editable_wheel": editable_wheel_with_pth, "sdist": sdist_with_pth})
