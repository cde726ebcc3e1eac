/* Nodes' device slots read in place, for the cache's match (gather the prefix's slots) and insert (which of the
 * caller's slots duplicate the tree's). A node's value is a 1-D int64 CPU tensor (any object with an int64
 * buffer is read through it). Why not ``tensor.numpy()`` per node: that call cost 1.5-3 us, several times the
 * rest of a chat-shaped match; a tensor is read here after checking that it is a contiguous int64 CPU tensor
 * of the node's length, through ``data_ptr()``. */
#include "_radix_walk.h"
#include "_radix.h"
#include "_radix_node.h"
#include <string.h>

static PyObject *str_data_ptr, *str_is_contiguous, *str_numel, *str_is_cpu, *str_dtype;

static int intern_names(void) {
    if (str_data_ptr != NULL) {
        return 0;
    }
    str_data_ptr = PyUnicode_InternFromString("data_ptr");
    str_is_contiguous = PyUnicode_InternFromString("is_contiguous");
    str_numel = PyUnicode_InternFromString("numel");
    str_is_cpu = PyUnicode_InternFromString("is_cpu");
    str_dtype = PyUnicode_InternFromString("dtype");
    return str_dtype == NULL ? -1 : 0;
}

/* 1 when calling ``name`` on ``obj`` (or reading it, when ``call`` is 0) gives True, 0 when not, -1 on error */
static int truth_of(PyObject *obj, PyObject *name, int call) {
    PyObject *v = call ? PyObject_CallMethodNoArgs(obj, name) : PyObject_GetAttr(obj, name);
    if (v == NULL) {
        return -1;
    }
    int t = v == Py_True ? 1 : (v == Py_False ? 0 : PyObject_IsTrue(v));
    Py_DECREF(v);
    return t;
}

/* The int64 slots of ``value`` (``num_slots`` of them). A buffer is held in ``view`` (release it after);
 * a tensor is checked (CPU, int64, contiguous, at least that long) and read at its data pointer. */
static const int64_t *value_slots(PyObject *value, Py_ssize_t num_slots, PyObject *int64, Py_buffer *view) {
    view->obj = NULL;
    if (PyObject_CheckBuffer(value)) {
        if (tierkv_int64_view(value, view, "node value") < 0) {
            return NULL;
        }
        if (view->len / 8 < num_slots) {
            PyErr_Format(PyExc_ValueError, "node value of %zd slots, expected %zd", view->len / 8, num_slots);
            PyBuffer_Release(view);
            return NULL;
        }
        return (const int64_t *)view->buf;
    }
    PyObject *dtype = PyObject_GetAttr(value, str_dtype);
    if (dtype == NULL) {
        return NULL;
    }
    Py_DECREF(dtype);  /* compared by identity only: torch's dtypes are singletons */
    if (dtype != int64 || truth_of(value, str_is_cpu, 0) != 1 || truth_of(value, str_is_contiguous, 1) != 1) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "a node value is not a contiguous int64 CPU tensor");
        }
        return NULL;
    }
    PyObject *numel = PyObject_CallMethodNoArgs(value, str_numel);
    Py_ssize_t n = numel == NULL ? -1 : PyLong_AsSsize_t(numel);
    Py_XDECREF(numel);
    if (n < num_slots) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "node value of %zd slots, expected at least %zd", n, num_slots);
        }
        return NULL;
    }
    PyObject *ptr = PyObject_CallMethodNoArgs(value, str_data_ptr);
    void *p = ptr == NULL ? NULL : PyLong_AsVoidPtr(ptr);
    Py_XDECREF(ptr);
    if (p == NULL && !PyErr_Occurred() && num_slots > 0) {
        PyErr_SetString(PyExc_ValueError, "a node value has no data");
    }
    return (const int64_t *)p;
}

/* a node's key length (its slot count, by the tree's invariant) */
static Py_ssize_t key_length(PyObject *node) {
    if (tierkv_check_node(node) < 0) {
        return -1;
    }
    return PyObject_Length(SLOT(node, key));
}

/* gather_device_slots(nodes, int64) -> (num_nodes, bytearray): the slots of the leading nodes that hold device
 * slots, in order, as native int64s (match_prefix's device indices: one copy, no torch.cat) */
PyObject *tierkv_gather_device_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "gather_device_slots takes (nodes: list, int64)");
        return NULL;
    }
    if (intern_names() < 0) {
        return NULL;
    }
    PyObject *nodes = args[0];
    Py_ssize_t count = 0, total = 0;
    for (; count < PyList_GET_SIZE(nodes); count++) {
        PyObject *node = PyList_GET_ITEM(nodes, count);
        Py_ssize_t n = key_length(node);
        if (n < 0) {
            return NULL;
        }
        if (SLOT(node, device_value) == Py_None) {
            break;
        }
        total += n;
    }
    PyObject *out = PyByteArray_FromStringAndSize(NULL, total * 8);
    if (out == NULL) {
        return NULL;
    }
    char *dst = PyByteArray_AS_STRING(out);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *node = PyList_GET_ITEM(nodes, i);
        Py_ssize_t n = PyObject_Length(SLOT(node, key));
        Py_buffer view;
        const int64_t *src = value_slots(SLOT(node, device_value), n, args[1], &view);
        if (src == NULL && PyErr_Occurred()) {
            Py_DECREF(out);
            return NULL;
        }
        memcpy(dst, src, (size_t)n * 8);
        dst += n * 8;
        if (view.obj != NULL) {
            PyBuffer_Release(&view);
        }
    }
    return Py_BuildValue("(nN)", count, out);
}

/* slot_mismatches(mine, shared, int64) -> bytearray: for each (node, start, end) of ``shared``, the slots of
 * mine[start:end] (an int64 buffer) unequal to the node's device slots at the same place, in order */
PyObject *tierkv_slot_mismatches(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3 || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "slot_mismatches takes (mine, shared: list, int64)");
        return NULL;
    }
    if (intern_names() < 0) {
        return NULL;
    }
    Py_buffer vm;
    if (tierkv_int64_view(args[0], &vm, "mine") < 0) {
        return NULL;
    }
    const int64_t *mine = (const int64_t *)vm.buf;
    Py_ssize_t len_mine = vm.len / 8, num_out = 0;
    int64_t *out = NULL;
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(args[1]); i++) {
        PyObject *item = PyList_GET_ITEM(args[1], i);
        Py_ssize_t start, end;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
            PyErr_SetString(PyExc_TypeError, "shared items must be (node, start, end)");
            goto done;
        }
        start = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 1));
        end = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 2));
        if ((start == -1 || end == -1) && PyErr_Occurred()) {
            goto done;
        }
        PyObject *node = PyTuple_GET_ITEM(item, 0);
        if (start < 0 || end < start || end > len_mine || tierkv_check_node(node) < 0) {
            if (!PyErr_Occurred()) {
                PyErr_Format(PyExc_ValueError, "shared range [%zd, %zd) outside %zd slots", start, end, len_mine);
            }
            goto done;
        }
        Py_buffer view;
        const int64_t *held = value_slots(SLOT(node, device_value), end - start, args[2], &view);
        if (held == NULL && PyErr_Occurred()) {
            goto done;
        }
        Py_ssize_t n = end - start, same = tierkv_mismatch(held, mine + start, n);
        for (Py_ssize_t j = same; j < n; j++) {
            if (held[j] == mine[start + j]) {
                continue;
            }
            if (num_out == len_mine) {
                PyErr_SetString(PyExc_ValueError, "shared ranges overlap");
                break;
            }
            if (out == NULL && (out = PyMem_Malloc((size_t)len_mine * 8 + 8)) == NULL) {
                PyErr_NoMemory();
                break;
            }
            out[num_out++] = mine[start + j];
        }
        if (view.obj != NULL) {
            PyBuffer_Release(&view);
        }
        if (PyErr_Occurred()) {
            goto done;
        }
    }
    result = PyByteArray_FromStringAndSize((const char *)out, num_out * 8);
done:
    PyMem_Free(out);
    PyBuffer_Release(&vm);
    return result;
}
