/* Tree nodes as the compiled eviction loop (_radix_evict.c) reads them: TreeNode slots at their offsets,
 * the checks that keep a bad node a TypeError, the leaf test, the heap key, and unlinking. */
#include "_radix_node.h"
#include "_radix.h"
#include "_radix_heap.h"
#include <structmember.h>

#define SCAN_CHILDREN 8  /* a parent with at most this many children is scanned, not hashed into */

NodeLayout tierkv_node_layout;

static int slot_offset(PyTypeObject *type, const char *name, Py_ssize_t *out) {
    PyObject *descr = PyObject_GetAttrString((PyObject *)type, name);
    if (descr == NULL) {
        return -1;
    }
    if (!Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a __slots__ member", type->tp_name, name);
        Py_DECREF(descr);
        return -1;
    }
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    *out = member->offset;
    Py_DECREF(descr);
    return member->type == T_OBJECT_EX ? 0 : (PyErr_Format(PyExc_TypeError, "%s.%s: not an object slot",
                                                           type->tp_name, name), -1);
}

int tierkv_bind_layout(PyTypeObject *type) {
    if (tierkv_node_layout.type == type) {
        return 0;
    }
    NodeLayout l = {type, 0};
    if (slot_offset(type, "id", &l.id) < 0 || slot_offset(type, "key", &l.key) < 0
        || slot_offset(type, "extra_key", &l.extra_key) < 0 || slot_offset(type, "parent", &l.parent) < 0
        || slot_offset(type, "children", &l.children) < 0
        || slot_offset(type, "_device_value", &l.device_value) < 0
        || slot_offset(type, "_host_value", &l.host_value) < 0
        || slot_offset(type, "lock_ref", &l.lock_ref) < 0 || slot_offset(type, "host_ref", &l.host_ref) < 0) {
        return -1;
    }
    Py_INCREF(type);
    Py_XDECREF(tierkv_node_layout.type);
    tierkv_node_layout = l;
    return 0;
}

int tierkv_check_node(PyObject *node) {
    /* nothing bound yet (no walk so far: a compiled helper called first): bind the node's type, which must
     * have the slots of a tree node; reading the slots of an unbound layout crashed the process */
    if (tierkv_node_layout.type == NULL && tierkv_bind_layout(Py_TYPE(node)) < 0) {
        return -1;
    }
    if (!Py_IS_TYPE(node, tierkv_node_layout.type)) {
        PyErr_Format(PyExc_TypeError, "expected a %s, got %s", tierkv_node_layout.type->tp_name, Py_TYPE(node)->tp_name);
        return -1;
    }
    if (SLOT(node, id) == NULL || SLOT(node, key) == NULL || SLOT(node, extra_key) == NULL
        || SLOT(node, parent) == NULL || SLOT(node, children) == NULL || SLOT(node, device_value) == NULL
        || SLOT(node, host_value) == NULL || SLOT(node, lock_ref) == NULL || SLOT(node, host_ref) == NULL
        || !PyDict_CheckExact(SLOT(node, children))) {
        PyErr_SetString(PyExc_TypeError, "tree node with an unset slot or non-dict children");
        return -1;
    }
    return 0;
}

/* a child of ``children`` holding device slots, scanning entries [from, to): 1, 0, or -1 on error;
 * *found is the entry after it */
static int scan_device_child(PyObject *children, Py_ssize_t from, Py_ssize_t to, Py_ssize_t *found) {
    Py_ssize_t pos = from;
    PyObject *k, *child;
    while (pos < to && PyDict_Next(children, &pos, &k, &child)) {
        if (!Py_IS_TYPE(child, tierkv_node_layout.type) || SLOT(child, device_value) == NULL) {
            return tierkv_check_node(child) < 0 ? -1 : 0;  /* the full check names what is wrong */
        }
        if (SLOT(child, device_value) != Py_None) {
            *found = pos;
            return 1;
        }
    }
    return 0;
}

/* RadixTree.is_device_leaf: 1, 0, or -1 on error */
int tierkv_is_device_leaf(NodeCtx *c, PyObject *n) {
    if (tierkv_check_node(n) < 0) {
        return -1;
    }
    if (n == c->root || SLOT(n, device_value) == Py_None) {
        return 0;
    }
    int locked = is_true(SLOT(n, lock_ref));
    if (locked) {
        return locked < 0 ? -1 : 0;
    }
    PyObject *children = SLOT(n, children);
    if (PyDict_GET_SIZE(children) == 0) {
        return 1;
    }
    ScanHint *hint = &c->hints[((uintptr_t)children >> 4) % SCAN_HINTS];
    Py_ssize_t from = hint->dict == children ? hint->pos : 0, found = 0;
    int rc = scan_device_child(children, from, PY_SSIZE_T_MAX, &found);
    if (rc == 0 && from > 0) {
        rc = scan_device_child(children, 0, from, &found);
    }
    if (rc == 1) {
        hint->dict = children, hint->pos = found - 1;
    }
    return rc < 0 ? -1 : !rc;
}

/* a child of ``children`` holding host slots: 1, 0, or -1 on error */
static int has_host_child(PyObject *children) {
    Py_ssize_t pos = 0;
    PyObject *k, *child;
    while (PyDict_Next(children, &pos, &k, &child)) {
        if (!Py_IS_TYPE(child, tierkv_node_layout.type) || SLOT(child, host_value) == NULL) {
            return tierkv_check_node(child) < 0 ? -1 : 0;
        }
        if (SLOT(child, host_value) != Py_None) {
            return 1;
        }
    }
    return 0;
}

/* RadixTree.is_host_leaf: 1, 0, or -1 on error */
int tierkv_is_host_leaf(NodeCtx *c, PyObject *n) {
    if (tierkv_check_node(n) < 0) {
        return -1;
    }
    if (n == c->root || SLOT(n, host_value) == Py_None) {
        return 0;
    }
    int held = is_true(SLOT(n, host_ref));
    if (held == 0 && SLOT(n, device_value) == Py_None) {
        held = is_true(SLOT(n, lock_ref));  /* a locked host-only node is kept */
    }
    if (held) {
        return held < 0 ? -1 : 0;
    }
    int rc = has_host_child(SLOT(n, children));
    return rc < 0 ? -1 : !rc;
}

/* the heap key of ``node`` (new reference): a call, or its slots read here, one bare or a tuple of them
 * (LRU's heap key is last_access_time: a Python call per ranked node cost more than the rest) */
PyObject *tierkv_rank(NodeCtx *c, PyObject *node) {
    if (c->num_key_slots == 0) {
        return PyObject_CallOneArg(c->key_of, node);
    }
    if (c->bare_key) {
        PyObject *v = *(PyObject **)((char *)node + c->key_slots[0]);
        if (v == NULL) {
            PyErr_SetString(PyExc_AttributeError, "the key slot of a tree node is unset");
        }
        return Py_XNewRef(v);
    }
    PyObject *key = PyTuple_New(c->num_key_slots);
    int atomic = 1;
    for (Py_ssize_t i = 0; key != NULL && i < c->num_key_slots; i++) {
        PyObject *v = *(PyObject **)((char *)node + c->key_slots[i]);
        if (v == NULL) {
            Py_DECREF(key);
            PyErr_SetString(PyExc_AttributeError, "a key slot of a tree node is unset");
            return NULL;
        }
        PyTuple_SET_ITEM(key, i, Py_NewRef(v));
        atomic &= PyLong_CheckExact(v) || PyFloat_CheckExact(v);
    }
    if (key != NULL && atomic) {  /* as the collector itself would at its next pass: a tuple of numbers is
                                   * in no cycle; untracked now, its dealloc need not touch its neighbours */
        PyObject_GC_UnTrack(key);
    }
    return key;
}

int tierkv_bind_key_slots(NodeCtx *c) {
    if (PyUnicode_Check(c->key_of)) {
        /* the last slot name bound, kept: the heap passes the same str on every call, and looking it up
         * made and freed a str each time (per eviction call, not per node) */
        static PyObject *bound_name;
        static PyTypeObject *bound_type;
        static Py_ssize_t bound_offset;
        if (c->key_of != bound_name || tierkv_node_layout.type != bound_type) {
            const char *name = PyUnicode_AsUTF8(c->key_of);
            Py_ssize_t offset;
            if (name == NULL || slot_offset(tierkv_node_layout.type, name, &offset) < 0) {
                return -1;
            }
            bound_offset = offset;
            Py_INCREF(c->key_of);
            Py_XSETREF(bound_name, c->key_of);
            bound_type = tierkv_node_layout.type;
        }
        c->key_slots[0] = bound_offset;
        c->num_key_slots = 1, c->bare_key = 1;
        return 0;
    }
    if (!PyTuple_Check(c->key_of)) {
        return 0;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(c->key_of);
    if (n < 1 || n > 4) {
        PyErr_SetString(PyExc_ValueError, "key_of as slot names takes 1 to 4 names");
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *name = PyUnicode_Check(PyTuple_GET_ITEM(c->key_of, i))
                           ? PyUnicode_AsUTF8(PyTuple_GET_ITEM(c->key_of, i)) : NULL;
        if (name == NULL) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_TypeError, "key_of slot names must be str");
            }
            return -1;
        }
        if (slot_offset(tierkv_node_layout.type, name, &c->key_slots[i]) < 0) {
            return -1;
        }
    }
    c->num_key_slots = n;
    return 0;
}

/* tierkv_rank(c, node) compared with ``key`` as tierkv_key_cmp does; a slot key is compared slot by slot, with
 * no tuple built (in a chain, each parent is compared with the heap's top and evicted at once) */
int tierkv_rank_cmp(NodeCtx *c, PyObject *node, PyObject *key) {
    PyObject *first = c->num_key_slots > 0 ? *(PyObject **)((char *)node + c->key_slots[0]) : NULL;
    if (c->bare_key && first != NULL) {
        return tierkv_obj_cmp(first, key);
    }
    if (c->num_key_slots > 0 && PyTuple_CheckExact(key) && PyTuple_GET_SIZE(key) == c->num_key_slots) {
        for (Py_ssize_t i = 0; i < c->num_key_slots; i++) {
            PyObject *v = *(PyObject **)((char *)node + c->key_slots[i]);
            if (v == NULL) {
                break;  /* tierkv_rank() raises */
            }
            int cmp = tierkv_obj_cmp(v, PyTuple_GET_ITEM(key, i));
            if (cmp != 0 || i == c->num_key_slots - 1) {
                return cmp;
            }
        }
    }
    PyObject *ranked = tierkv_rank(c, node);
    int cmp = ranked == NULL ? -2 : tierkv_key_cmp(ranked, key);
    Py_XDECREF(ranked);
    return cmp;
}

/* RadixTree.child_key(elems, extra_key, pos) for an int64 key (new reference): its first element, or its first
 * page as bytes, paired with ``extra`` unless that is None */
PyObject *tierkv_child_key_at(const int64_t *elems, Py_ssize_t pos, Py_ssize_t page_size, PyObject *extra) {
    PyObject *first = page_size == 1 ? PyLong_FromLongLong(elems[pos])
                                     : PyBytes_FromStringAndSize((const char *)(elems + pos), page_size * 8);
    if (first == NULL || extra == Py_None) {
        return first;
    }
    PyObject *pair = PyTuple_Pack(2, extra, first);
    Py_DECREF(first);
    return pair;
}

/* RadixTree.child_key(node.key, node.extra_key) for int64 keys */
PyObject *tierkv_child_key(NodeCtx *c, PyObject *node) {
    Py_buffer view;
    if (tierkv_int64_view(SLOT(node, key), &view, "node key") < 0) {
        return NULL;
    }
    PyObject *key = NULL;
    if (view.len < c->page_size * 8 || view.len == 0) {
        PyErr_SetString(PyExc_ValueError, "node key shorter than a page");
    } else {
        key = tierkv_child_key_at((const int64_t *)view.buf, 0, c->page_size, SLOT(node, extra_key));
    }
    PyBuffer_Release(&view);
    return key;
}

/* Delete ``node`` from its parent's children. Why by identity: its child key reads the first page of
 * the node's key, a cache miss per evicted node (~15 % of the loop on chat keys); a parent's few
 * children are scanned for the node instead, and only a parent with many is looked up by key. */
int tierkv_unlink_child(NodeCtx *c, PyObject *parent, PyObject *node) {
    PyObject *children = SLOT(parent, children), *k, *v;
    Py_ssize_t pos = 0;
    if (PyDict_GET_SIZE(children) <= SCAN_CHILDREN) {
        while (PyDict_Next(children, &pos, &k, &v)) {
            if (v == node) {
                if (PyDict_GET_SIZE(children) == 1) {  /* an only child (a chain's): no lookup, and the parent
                                                         * is left an empty dict, not one with a dummy */
                    PyDict_Clear(children);
                    return 0;
                }
                Py_INCREF(k);  /* the dict drops its reference while deleting */
                int rc = PyDict_DelItem(children, k);
                Py_DECREF(k);
                return rc;
            }
        }
    }
    PyObject *ck = tierkv_child_key(c, node);  /* not found: the lookup by key raises the KeyError */
    int rc = ck == NULL ? -1 : PyDict_DelItem(children, ck);
    Py_XDECREF(ck);
    return rc;
}

/* The attribute names the loop reads on every call, interned once: PyObject_GetAttrString made and
 * freed a str per name per call (a tenth of a steady eviction of a node or two). */
TreeAttrs tierkv_tree_attrs;

int tierkv_intern_tree_attrs(void) {
    if (tierkv_tree_attrs.root != NULL) {
        return 0;
    }
    PyObject **slots[] = {&tierkv_tree_attrs.root, &tierkv_tree_attrs._frontiers, &tierkv_tree_attrs.device, &tierkv_tree_attrs.host,
                          &tierkv_tree_attrs.host_changed, &tierkv_tree_attrs.device_changed, &tierkv_tree_attrs.page_size,
                          &tierkv_tree_attrs.evictable_size};
    const char *names[] = {"root", "_frontiers", "device", "host", "host_changed", "device_changed", "page_size",
                           "evictable_size"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (*slots[i] == NULL && (*slots[i] = PyUnicode_InternFromString(names[i])) == NULL) {
            return -1;
        }
    }
    return 0;
}
