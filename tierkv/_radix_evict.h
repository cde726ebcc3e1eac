/* Public API of _radix_evict.c and _radix_pages.c: EvictionHeap's compiled loop (tierkv/eviction/heap.py)
 * and the freeing of what it evicts (tierkv/pools/allocator.py). */
#ifndef TIERKV_RADIX_EVICT_H
#define TIERKV_RADIX_EVICT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *tierkv_evict_device(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
/* _radix_pages.c: the slot allocator's free of an eviction's slot tensors */
PyObject *tierkv_free_whole_pages(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
