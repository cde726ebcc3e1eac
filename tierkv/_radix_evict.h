/* Public API of _radix_evict.c: EvictionHeap's compiled loop (tierkv/eviction/heap.py). */
#ifndef TIERKV_RADIX_EVICT_H
#define TIERKV_RADIX_EVICT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *tierkv_evict_device(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
