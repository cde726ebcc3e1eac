/* Native core of the radix tree's keys (tierkv/radix.py and radix_key.py keep the pure-Python reference).
 *
 * common_prefix_len(a, b, offset) is the number of equal leading elements of a and b[offset:], both
 * int64 buffers (array('q')). The Python version slices both keys (copying up to one edge, 8 bytes a
 * token, twice per node walked) before comparing; here the comparison reads the buffers in place:
 * one memcmp for a whole match, memcmp over fixed chunks and then single elements to place a mismatch.
 */
#include "_radix.h"
#include "_radix_evict.h"
#include "_radix_walk.h"
#include <stdint.h>
#include <string.h>

#define CHUNK_ELEMS 64

int tierkv_int64_view(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        return -1;
    }
    /* "l" is numpy's native int64 (on LP64): slot arrays come from numpy */
    if (view->itemsize != 8 || view->format == NULL
        || (strcmp(view->format, "q") != 0 && strcmp(view->format, "l") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be an array('q'), got format %s", name,
                     view->format ? view->format : "?");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

Py_ssize_t tierkv_mismatch(const int64_t *a, const int64_t *b, Py_ssize_t n) {
    if (memcmp(a, b, (size_t)n * sizeof(int64_t)) == 0) {
        return n;
    }
    Py_ssize_t i = 0;
    while (i + CHUNK_ELEMS <= n && memcmp(a + i, b + i, CHUNK_ELEMS * sizeof(int64_t)) == 0) {
        i += CHUNK_ELEMS;
    }
    while (i < n && a[i] == b[i]) {
        i++;
    }
    return i;
}

static PyObject *common_prefix_len(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "common_prefix_len takes (a, b, offset), got %zd arguments", nargs);
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[2]);
    if (offset == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer va, vb;
    if (tierkv_int64_view(args[0], &va, "a") < 0) {
        return NULL;
    }
    if (tierkv_int64_view(args[1], &vb, "b") < 0) {
        PyBuffer_Release(&va);
        return NULL;
    }
    Py_ssize_t len_a = va.len / 8, len_b = vb.len / 8;
    PyObject *result = NULL;
    if (offset < 0 || offset > len_b) {
        PyErr_Format(PyExc_ValueError, "offset %zd is outside b of %zd elements", offset, len_b);
    } else {
        Py_ssize_t n = len_a < len_b - offset ? len_a : len_b - offset;
        result = PyLong_FromSsize_t(tierkv_mismatch((const int64_t *)va.buf, (const int64_t *)vb.buf + offset, n));
    }
    PyBuffer_Release(&va);
    PyBuffer_Release(&vb);
    return result;
}

/* pack_int64(seq) -> bytes of native int64s, or None when an item is not an exact int (bools, numpy
 * scalars, floats...) or does not fit in 64 bits: the caller's slow path then converts or names it.
 * Why: RadixKey(list) checked every item's type and then packed it, two passes of Python-level work
 * per token; this is one C loop. */
static PyObject *pack_int64(PyObject *self, PyObject *seq) {
    (void)self;
    PyObject *fast = PySequence_Fast(seq, "pack_int64 takes a list or tuple");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    if (out == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    int64_t *dst = (int64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        int overflow = 0;
        long long v = PyLong_CheckExact(items[i]) ? PyLong_AsLongLongAndOverflow(items[i], &overflow) : -1;
        if (!PyLong_CheckExact(items[i]) || overflow) {
            Py_DECREF(fast);
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        dst[i] = (int64_t)v;
    }
    Py_DECREF(fast);
    return out;
}

static PyMethodDef methods[] = {
    {"pack_int64", pack_int64, METH_O,
     "pack_int64(seq) -> bytes of int64s, or None if an item is not an int that fits in 64 bits"},
    {"evict_device", (PyCFunction)(void (*)(void))tierkv_evict_device, METH_FASTCALL,
     "evict_device(tree, heap, live, changed, seqs, key_of, recheck, num_tokens, on_evict, keep_nodes, "
     "hand_back, host_tier) -> (freed, nodes, values, held)"},
    {"free_whole_pages", (PyCFunction)(void (*)(void))tierkv_free_whole_pages, METH_FASTCALL,
     "free_whole_pages(slot_tensors, page_size, is_free, dtype) -> bytes of the int64 pages freed"},
    {"common_prefix_len", (PyCFunction)(void (*)(void))common_prefix_len, METH_FASTCALL,
     "common_prefix_len(a, b, offset) -> equal leading elements of int64 arrays a and b[offset:]"},
    {"walk", (PyCFunction)(void (*)(void))tierkv_walk, METH_FASTCALL,
     "walk(root, elems, num_elems, page_size, extra_key) -> (nodes, num_matched, partial, partial_len)"},
    {"gather_device_slots", (PyCFunction)(void (*)(void))tierkv_gather_device_slots, METH_FASTCALL,
     "gather_device_slots(nodes, int64) -> (num_nodes, slots as a bytearray) of the leading nodes holding device slots"},
    {"plan_slots", (PyCFunction)(void (*)(void))tierkv_plan_slots, METH_FASTCALL,
     "plan_slots(mine, nodes, partial, partial_len, num_elems, page_size, is_free, int64, leaf) -> (slots unequal "
     "to the nodes' or None, revived ranges or None), the slots taken checked allocated, the new leaf's copied "
     "into leaf (a writable buffer, or None)"},
    {"new_leaf", (PyCFunction)(void (*)(void))tierkv_new_leaf, METH_FASTCALL,
     "new_leaf(type, ids, parent, elems, start, end, extra_key, tick, priority, value, page_size, key_slack) -> the "
     "new leaf for elems[start:end], linked under parent"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tierkv._radix", NULL, -1, methods};

/* 2: evict_device; common_prefix_len takes memoryviews of int64 arrays (node keys may be views);
 * 3: the tree's frontier sets may be None (untracked until read); 4: evict_device takes keep_nodes;
 * 5: evict_device takes hand_back and returns the victim it handed back; 6: and host_tier;
 * 7: walk, gather_device_slots, plan_slots; 8: plan_slots reads a tensor in place and fills the new leaf's buffer */
#define API_VERSION 8

PyMODINIT_FUNC PyInit__radix(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "API_VERSION", API_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
