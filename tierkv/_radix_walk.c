/* The walk of RadixTree.match and RadixTree.plan_insert (tierkv/radix.py keeps the pure-Python reference).
 *
 * walk(root, elems, num_elems, page_size, extra_key) follows ``elems[:num_elems]`` (an int64 array) down from
 * ``root`` and changes nothing: it returns the nodes whose whole key matched, the elements they cover, and the
 * node matched only in part (a split is the caller's: it may still refuse the call) with the whole pages of
 * it that matched. Why in C: per node the Python loop built the child key, looked it up, compared the keys
 * and cut to pages in a dozen bytecodes; a chat-shaped tree walks 4-5 nodes per request, twice (match, then
 * insert). The dict is looked up by the same child key RadixTree.child_key builds. */
#include "_radix_walk.h"
#include "_radix.h"
#include "_radix_node.h"

/* the child of ``node`` whose key starts at elems[pos] (borrowed: nothing the walk does runs Python code that
 * could change the dict), or NULL: none, or an error set */
static PyObject *child_at(PyObject *node, const int64_t *elems, Py_ssize_t pos, Py_ssize_t page_size,
                          PyObject *extra) {
    PyObject *ck = tierkv_child_key_at(elems, pos, page_size, extra);
    if (ck == NULL) {
        return NULL;
    }
    PyObject *child = PyDict_GetItemWithError(SLOT(node, children), ck);
    Py_DECREF(ck);
    return child;
}

/* equal leading elements of ``child``'s key and elems[pos:pos + room], or -1 on error */
static Py_ssize_t key_match(PyObject *child, const int64_t *elems, Py_ssize_t room, Py_ssize_t *key_len) {
    Py_buffer view;
    if (tierkv_check_node(child) < 0 || tierkv_int64_view(SLOT(child, key), &view, "node key") < 0) {
        return -1;
    }
    *key_len = view.len / 8;
    Py_ssize_t n = *key_len < room ? *key_len : room;
    Py_ssize_t matched = tierkv_mismatch((const int64_t *)view.buf, elems, n);
    PyBuffer_Release(&view);
    return matched;
}

PyObject *tierkv_walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "walk takes (root, elems, num_elems, page_size, extra_key), got %zd arguments",
                     nargs);
        return NULL;
    }
    PyObject *root = args[0], *extra = args[4];
    Py_ssize_t num_elems = PyLong_AsSsize_t(args[2]), page_size = PyLong_AsSsize_t(args[3]);
    if ((num_elems == -1 || page_size == -1) && PyErr_Occurred()) {
        return NULL;
    }
    if (tierkv_bind_layout(Py_TYPE(root)) < 0 || tierkv_check_node(root) < 0) {
        return NULL;
    }
    Py_buffer ve;
    if (tierkv_int64_view(args[1], &ve, "elems") < 0) {
        return NULL;
    }
    const int64_t *elems = (const int64_t *)ve.buf;
    PyObject *nodes = NULL, *partial = Py_None, *result = NULL;
    Py_ssize_t pos = 0, partial_len = 0;
    if (page_size < 1 || num_elems < 0 || num_elems > ve.len / 8 || num_elems % page_size) {
        PyErr_Format(PyExc_ValueError, "num_elems %zd must be whole pages of %zd within elems of %zd", num_elems,
                     page_size, ve.len / 8);
        goto done;
    }
    if ((nodes = PyList_New(0)) == NULL) {
        goto done;
    }
    PyObject *node = root;
    while (pos < num_elems) {
        PyObject *child = child_at(node, elems, pos, page_size, extra);
        if (child == NULL) {
            if (PyErr_Occurred()) {
                goto done;
            }
            break;
        }
        Py_ssize_t key_len;
        Py_ssize_t n = key_match(child, elems + pos, num_elems - pos, &key_len);
        if (n < 0) {
            goto done;
        }
        n -= n % page_size;
        if (n == 0) {
            break;
        }
        if (n < key_len) {
            partial = child, partial_len = n;
            break;
        }
        if (PyList_Append(nodes, child) < 0) {
            goto done;
        }
        node = child, pos += n;
    }
    result = Py_BuildValue("(OnOn)", nodes, pos, partial, partial_len);
done:
    Py_XDECREF(nodes);
    PyBuffer_Release(&ve);
    return result;
}
