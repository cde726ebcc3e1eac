/* Public API of _radix_walk.c (the walk down a key), _radix_slots.c (reading nodes' slot values) and
 * _radix_leaf.c (an insert's new leaf). */
#ifndef TIERKV_RADIX_WALK_H
#define TIERKV_RADIX_WALK_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *tierkv_walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *tierkv_gather_device_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *tierkv_plan_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *tierkv_new_leaf(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
