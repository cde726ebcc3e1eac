/* Shared by the files of tierkv._radix: _radix.c (keys, module), _radix_evict.c (eviction loop),
 * _radix_node.c (the nodes it reads; both include _radix_evict.h) and _radix_heap.c (its heap). */
#ifndef TIERKV_RADIX_H
#define TIERKV_RADIX_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* a C-contiguous int64 ("q") buffer of obj; TypeError naming ``name`` otherwise */
int tierkv_int64_view(PyObject *obj, Py_buffer *view, const char *name);

/* _radix_heap.c: the eviction heap, a list of (key, node id, seq, node) tuples in heapq's order */
int tierkv_obj_cmp(PyObject *x, PyObject *y);  /* -1, 0, 1 as x <, ==, > y; -2 on error */
int tierkv_key_cmp(PyObject *x, PyObject *y);  /* tierkv_obj_cmp over tuples, lexicographic */
int tierkv_heap_push(PyObject *heap, PyObject *entry);
PyObject *tierkv_heap_pop(PyObject *heap);  /* new reference; NULL without an error when empty */

PyObject *tierkv_evict_device(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
