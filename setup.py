"""Builds the optional native chunk copy (tierkv/_rowcopy.c); metadata lives in pyproject.toml.

``optional=True``: without a C compiler the package still installs and the CPU copies fall back to
torch index ops (see tierkv/cpu_copy.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("tierkv._rowcopy", ["tierkv/_rowcopy.c"], extra_compile_args=["-O3"],
                             optional=True)])
