/* The memory of a CPU, contiguous torch tensor, read in place: shared by the tree's slot readers
 * (tierkv/_radix_*.c) and the chunk copy's slot arguments (tierkv/copy/_rowcopy.c). Why: ``tensor.numpy()``
 * costs 0.5-3 us per call, several times what these callers then do with a few slots. */
#ifndef TIERKV_TENSOR_MEMORY_H
#define TIERKV_TENSOR_MEMORY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* The memory of a CPU, contiguous tensor of ``dtype`` (an int64 one, as the slot readers pass): its data
 * pointer (NULL when empty) and element count. 1; 0 when ``t`` is not such a tensor (no error set, the
 * caller names what it wanted); -1 on error. */
int tierkv_tensor_memory(PyObject *t, PyObject *dtype, const int64_t **data, Py_ssize_t *numel);

#endif
