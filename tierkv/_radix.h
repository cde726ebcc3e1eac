/* Shared by the two files of tierkv._radix: _radix.c (keys, module) and _radix_evict.c (eviction). */
#ifndef TIERKV_RADIX_H
#define TIERKV_RADIX_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* a C-contiguous int64 ("q") buffer of obj; TypeError naming ``name`` otherwise */
int tierkv_int64_view(PyObject *obj, Py_buffer *view, const char *name);

PyObject *tierkv_evict_device(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
