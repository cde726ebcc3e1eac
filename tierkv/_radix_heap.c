/* The eviction heap of tierkv._radix (the loop that uses it: _radix_evict.c).
 *
 * heapq's layout and algorithm over (key, node id, seq, node) entries, with a comparison that reads
 * exact ints and floats directly. A policy key is a tuple of them, so heapq's generic tuple comparison
 * (an equality test and then an order test per nested item) cost ~1.5 us per pop at 5k entries; the
 * order is the same one (lexicographic, shorter first), so the Python path (heapq) and this one share
 * one heap. */
#include "_radix_heap.h"

/* -1, 0, 1 for x <, ==, > y as far as an order test tells (NaN-free keys); -2 on error */
/* 1 and the value when ``v`` is an int of one digit (every tick and node id for a long while): read
 * in place, no call; 0 otherwise */
static inline int compact_int(PyObject *v, long long *out) {
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)v)) {
        *out = (long long)PyUnstable_Long_CompactValue((PyLongObject *)v);
        return 1;
    }
#else
    Py_ssize_t size = Py_SIZE(v);
    if (size >= -1 && size <= 1) {
        *out = (long long)size * (long long)((PyLongObject *)v)->ob_digit[0];
        return 1;
    }
#endif
    return 0;
}

int tierkv_obj_cmp(PyObject *x, PyObject *y) {
    if (x == y) {
        return 0;
    }
    if (PyLong_CheckExact(x) && PyLong_CheckExact(y)) {
        long long a, b;
        int ox = 0, oy = 0;
        if (!compact_int(x, &a) || !compact_int(y, &b)) {
            a = PyLong_AsLongLongAndOverflow(x, &ox), b = PyLong_AsLongLongAndOverflow(y, &oy);
        }
        if (!ox && !oy) {
            return (a > b) - (a < b);
        }
    } else if (PyFloat_CheckExact(x) && PyFloat_CheckExact(y)) {
        double a = PyFloat_AS_DOUBLE(x), b = PyFloat_AS_DOUBLE(y);
        if (a == b) {
            return 0;
        }
        if (a < b || b < a) {
            return a < b ? -1 : 1;
        }
    }
    int eq = PyObject_RichCompareBool(x, y, Py_EQ);
    if (eq != 0) {
        return eq < 0 ? -2 : 0;
    }
    int lt = PyObject_RichCompareBool(x, y, Py_LT);
    return lt < 0 ? -2 : (lt ? -1 : 1);
}

int tierkv_key_cmp(PyObject *x, PyObject *y) {
    if (!PyTuple_CheckExact(x) || !PyTuple_CheckExact(y)) {
        return tierkv_obj_cmp(x, y);
    }
    Py_ssize_t nx = PyTuple_GET_SIZE(x), ny = PyTuple_GET_SIZE(y);
    for (Py_ssize_t i = 0; i < nx && i < ny; i++) {
        int c = tierkv_obj_cmp(PyTuple_GET_ITEM(x, i), PyTuple_GET_ITEM(y, i));
        if (c != 0) {
            return c;
        }
    }
    return (nx > ny) - (nx < ny);
}

/* entry a < entry b: 1, 0, -1 on error (entries are (key, id, seq, node) tuples) */
static int entry_lt(PyObject *a, PyObject *b) {
    if (!PyTuple_CheckExact(a) || !PyTuple_CheckExact(b) || PyTuple_GET_SIZE(a) < 3 || PyTuple_GET_SIZE(b) < 3) {
        return PyObject_RichCompareBool(a, b, Py_LT);
    }
    for (Py_ssize_t i = 0; i < 3; i++) {  /* keys, ids and seqs that are one-digit ints (an LRU heap's, for a
                                           * long while): compared here, no call, no reference taken */
        PyObject *x = PyTuple_GET_ITEM(a, i), *y = PyTuple_GET_ITEM(b, i);
        long long u, v;
        if (!PyLong_CheckExact(x) || !PyLong_CheckExact(y) || !compact_int(x, &u) || !compact_int(y, &v)) {
            break;  /* the general comparison below */
        }
        if (u != v) {
            return u < v;
        }
    }
    Py_INCREF(a);
    Py_INCREF(b);
    int c = 0;
    for (Py_ssize_t i = 0; i < 3 && c == 0; i++) {
        c = (i == 0 ? tierkv_key_cmp : tierkv_obj_cmp)(PyTuple_GET_ITEM(a, i), PyTuple_GET_ITEM(b, i));
    }
    int lt = c == -2 ? -1 : c < 0;
    if (c == 0) {  /* two entries of one node, one key, one seq: never in one heap, but stay exact */
        lt = PyObject_RichCompareBool(a, b, Py_LT);
    }
    Py_DECREF(a);
    Py_DECREF(b);
    return lt;
}

/* a comparison ran Python code that changed the heap: refuse, as heapq does */
static int heap_changed(PyObject *heap, Py_ssize_t size) {
    if (PyList_GET_SIZE(heap) != size) {
        PyErr_SetString(PyExc_RuntimeError, "eviction heap changed size during a comparison");
        return 1;
    }
    return 0;
}

/* heapq._siftdown: the entry at pos moves toward the root (startpos) */
static int sift_root(PyObject *heap, Py_ssize_t startpos, Py_ssize_t pos) {
    Py_ssize_t size = PyList_GET_SIZE(heap);
    while (pos > startpos) {
        Py_ssize_t parentpos = (pos - 1) >> 1;
        PyObject **arr = ((PyListObject *)heap)->ob_item;
        int lt = entry_lt(arr[pos], arr[parentpos]);
        if (lt < 0 || heap_changed(heap, size)) {
            return -1;
        }
        if (!lt) {
            break;
        }
        arr = ((PyListObject *)heap)->ob_item;
        PyObject *tmp = arr[parentpos];
        arr[parentpos] = arr[pos];
        arr[pos] = tmp;
        pos = parentpos;
    }
    return 0;
}

/* heapq._siftup: the smaller child rises until a leaf is reached, then that leaf's entry sifts back */
static int sift_leaf(PyObject *heap, Py_ssize_t pos) {
    Py_ssize_t endpos = PyList_GET_SIZE(heap), startpos = pos, limit = endpos >> 1;
    while (pos < limit) {
        Py_ssize_t childpos = 2 * pos + 1;
        if (childpos + 1 < endpos) {
            PyObject **arr = ((PyListObject *)heap)->ob_item;
            int lt = entry_lt(arr[childpos], arr[childpos + 1]);
            if (lt < 0 || heap_changed(heap, endpos)) {
                return -1;
            }
            childpos += lt ^ 1;
        }
        PyObject **arr = ((PyListObject *)heap)->ob_item;
        PyObject *tmp = arr[childpos];
        arr[childpos] = arr[pos];
        arr[pos] = tmp;
        pos = childpos;
    }
    return sift_root(heap, startpos, pos);
}

int tierkv_heap_push(PyObject *heap, PyObject *entry) {
    if (PyList_Append(heap, entry) < 0) {
        return -1;
    }
    return sift_root(heap, 0, PyList_GET_SIZE(heap) - 1);
}

/* smallest entry (new reference); NULL without an error when the heap is empty */
PyObject *tierkv_heap_pop(PyObject *heap) {
    Py_ssize_t n = PyList_GET_SIZE(heap);
    if (n == 0) {
        return NULL;
    }
    PyObject *last = PyList_GET_ITEM(heap, n - 1);  /* its reference moves with it */
    Py_SET_SIZE(heap, n - 1);  /* no slice deletion: the list keeps its room (a heap grows back), nothing is freed */
    if (n == 1) {
        return last;
    }
    PyObject *top = PyList_GET_ITEM(heap, 0);  /* its reference moves to the caller */
    PyList_SET_ITEM(heap, 0, last);
    if (sift_leaf(heap, 0) < 0) {
        Py_DECREF(top);
        return NULL;
    }
    return top;
}
