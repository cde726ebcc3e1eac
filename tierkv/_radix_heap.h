/* Public API of _radix_heap.c: the eviction heap, a list of (key, node id, seq, node) tuples in heapq's
 * order, and the comparison it ranks by. */
#ifndef TIERKV_RADIX_HEAP_H
#define TIERKV_RADIX_HEAP_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

int tierkv_obj_cmp(PyObject *x, PyObject *y);  /* -1, 0, 1 as x <, ==, > y; -2 on error */
int tierkv_key_cmp(PyObject *x, PyObject *y);  /* tierkv_obj_cmp over tuples, lexicographic */
int tierkv_heap_push(PyObject *heap, PyObject *entry);
PyObject *tierkv_heap_pop(PyObject *heap);  /* new reference; NULL without an error when empty */

#endif
