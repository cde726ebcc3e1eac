"""Builds the optional native parts: the chunk copy (tierkv/copy/_rowcopy.c, _rowcopy_hash.c, _rowcopy_alloc.c), the
radix tree's key comparison and eviction loop (tierkv/_radix.c, _radix_evict.c, _radix_node.c, _radix_heap.c,
_radix_walk.c, _radix_slots.c, _radix_pages.c, _radix_leaf.c; tierkv/_tensor_memory.c in both) and the L3 page
I/O (tierkv/_pageio.c, _pageio_mem.c, _xxh3_copy.c);
metadata lives in pyproject.toml.

``optional=True``: without a C compiler the package still installs; the CPU copies fall back to torch
index ops (see tierkv/copy/cpu_copy.py), the tree to its pure-Python comparison (see tierkv/radix.py) and the
page stores to their Python I/O loops (see tierkv/storage/native.py).
"""

from setuptools import Extension, setup

SOURCES = {"copy._rowcopy": ["tierkv/copy/_rowcopy.c", "tierkv/copy/_rowcopy_hash.c",
                                     "tierkv/copy/_rowcopy_alloc.c", "tierkv/_xxh3_copy.c",
                                     "tierkv/_tensor_memory.c"],
           "_radix": ["tierkv/_radix.c", "tierkv/_radix_evict.c", "tierkv/_radix_node.c", "tierkv/_radix_heap.c",
                      "tierkv/_radix_walk.c", "tierkv/_radix_slots.c", "tierkv/_radix_pages.c",
                      "tierkv/_radix_leaf.c", "tierkv/_tensor_memory.c"],
           "_pageio": ["tierkv/_pageio.c", "tierkv/_pageio_mem.c", "tierkv/_xxh3_copy.c"]}

HEADERS = {"copy._rowcopy": ["tierkv/copy/_rowcopy.h", "tierkv/_pageio.h", "tierkv/_tensor_memory.h"],
           "_radix": ["tierkv/_radix.h", "tierkv/_radix_evict.h", "tierkv/_radix_heap.h", "tierkv/_radix_node.h",
                      "tierkv/_radix_walk.h", "tierkv/_tensor_memory.h"],
           "_pageio": ["tierkv/_pageio.h"]}

setup(ext_modules=[Extension(f"tierkv.{name}", sources, depends=HEADERS.get(name, []), extra_compile_args=["-O3"],
                             optional=True)
                   for name, sources in SOURCES.items()])
