"""Builds the optional native parts: the chunk copy (tierkv/_rowcopy.c) and the radix tree's key
comparison (tierkv/_radix.c); metadata lives in pyproject.toml.

``optional=True``: without a C compiler the package still installs; the CPU copies fall back to torch
index ops (see tierkv/cpu_copy.py) and the tree to its pure-Python comparison (see tierkv/radix.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(f"tierkv.{name}", [f"tierkv/{name}.c"], extra_compile_args=["-O3"], optional=True)
                   for name in ("_rowcopy", "_radix")])
