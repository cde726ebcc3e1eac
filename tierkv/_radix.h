/* Public API of _radix.c (keys and the module); the other units of tierkv._radix each have their own
 * header: _radix_heap.h (the heap), _radix_node.h (tree nodes), _radix_evict.h (the eviction loop). */
#ifndef TIERKV_RADIX_H
#define TIERKV_RADIX_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* a C-contiguous int64 ("q") buffer of obj; TypeError naming ``name`` otherwise */
int tierkv_int64_view(PyObject *obj, Py_buffer *view, const char *name);

/* how many leading elements of a and b (n each) are equal */
Py_ssize_t tierkv_mismatch(const int64_t *a, const int64_t *b, Py_ssize_t n);

#endif
