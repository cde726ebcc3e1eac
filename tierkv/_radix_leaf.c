/* An insert's new leaf made in one call: the node with every slot set, its key (a view of the caller's token
 * array, or a copy: RadixTree._leaf_key's rule), and its entry in the parent's children (RadixTree.child_key).
 * Why: in Python the key, the node's sixteen slots and the child key cost a trace insert 2.9 of its 13 us. */
#include "_radix.h"
#include "_radix_node.h"
#include "_radix_walk.h"
#include <structmember.h>

#define NUM_LEAF_SLOTS 16

/* every slot of TreeNode, in the order the offsets below are kept */
static const char *const leaf_slot_names[NUM_LEAF_SLOTS] = {
    "id", "key", "extra_key", "parent", "children", "_device_value", "_host_value", "hash_values", "lock_ref",
    "host_ref", "hit_count", "last_access_time", "creation_time", "priority", "_frontiers", "_flags",
};
enum { ID, KEY, EXTRA_KEY, PARENT, CHILDREN, DEVICE_VALUE, HOST_VALUE, HASH_VALUES, LOCK_REF, HOST_REF,
       HIT_COUNT, LAST_ACCESS, CREATION, PRIORITY, FRONTIERS, FLAGS };

static struct {
    PyTypeObject *type;
    Py_ssize_t offsets[NUM_LEAF_SLOTS];
} leaf_layout;

/* the offsets of ``type``'s slots, which must be exactly leaf_slot_names: a slot added to TreeNode and left
 * unset here would be an AttributeError on the first read of a leaf made here */
static int bind_leaf_layout(PyTypeObject *type) {
    if (leaf_layout.type == type) {
        return 0;
    }
    PyObject *names = PyObject_GetAttrString((PyObject *)type, "__slots__");
    if (names == NULL) {
        return -1;
    }
    int ok = PyTuple_Check(names) && PyTuple_GET_SIZE(names) == NUM_LEAF_SLOTS;
    for (Py_ssize_t i = 0; ok && i < NUM_LEAF_SLOTS; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i), *descr = NULL;
        int known = 0;
        for (int j = 0; PyUnicode_Check(name) && j < NUM_LEAF_SLOTS; j++) {
            known |= PyUnicode_CompareWithASCIIString(name, leaf_slot_names[j]) == 0;
        }
        ok = known;
        if (ok) {
            descr = PyObject_GetAttrString((PyObject *)type, leaf_slot_names[i]);
            ok = descr != NULL && Py_IS_TYPE(descr, &PyMemberDescr_Type)
                 && ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX;
            if (ok) {
                leaf_layout.offsets[i] = ((PyMemberDescrObject *)descr)->d_member->offset;
            }
            Py_XDECREF(descr);
        }
    }
    Py_DECREF(names);
    if (!ok) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_TypeError, "%s's __slots__ are not the %d a tree node has", type->tp_name,
                         NUM_LEAF_SLOTS);
        }
        leaf_layout.type = NULL;
        return -1;
    }
    leaf_layout.type = type;
    return 0;
}

#define LEAF_SLOT(o, i) (*(PyObject **)((char *)(o) + leaf_layout.offsets[i]))

/* RadixTree._leaf_key: elems[start:end] as a view of ``elems`` when it leaves out at most ``slack`` elements
 * (see radix_key.key_slack), else as a copy (an array slice) */
static PyObject *leaf_key(PyObject *elems, Py_ssize_t start, Py_ssize_t end, Py_ssize_t len, Py_ssize_t slack) {
    if (len - (end - start) > slack) {
        return PySequence_GetSlice(elems, start, end);
    }
    PyObject *whole = PyMemoryView_FromObject(elems);
    PyObject *key = whole == NULL ? NULL : PySequence_GetSlice(whole, start, end);
    Py_XDECREF(whole);
    return key;
}

/* a node of ``type`` with every slot set, as TreeNode.__init__ sets them, the value and priority given */
static PyObject *leaf_node(PyTypeObject *type, PyObject *ids, PyObject *key, PyObject *extra_key, PyObject *parent,
                           PyObject *tick, PyObject *priority, PyObject *value) {
    PyObject *frontiers = LEAF_SLOT(parent, FRONTIERS);  /* the tree's, shared by every node */
    if (frontiers == NULL) {
        PyErr_SetString(PyExc_TypeError, "the parent node has no frontiers");
        return NULL;
    }
    PyObject *id = PyIter_Next(ids), *children = PyDict_New(), *zero = PyLong_FromLong(0);
    PyObject *node = id == NULL || children == NULL || zero == NULL ? NULL : type->tp_alloc(type, 0);
    if (node == NULL) {
        if (id == NULL && !PyErr_Occurred()) {
            PyErr_SetString(PyExc_RuntimeError, "the node ids ran out");
        }
        Py_XDECREF(id), Py_XDECREF(children), Py_XDECREF(zero);
        return NULL;
    }
    Py_INCREF(frontiers);
    PyObject *values[NUM_LEAF_SLOTS] = {
        [ID] = id, [KEY] = Py_NewRef(key), [EXTRA_KEY] = Py_NewRef(extra_key), [PARENT] = Py_NewRef(parent),
        [CHILDREN] = children, [DEVICE_VALUE] = Py_NewRef(value), [HOST_VALUE] = Py_NewRef(Py_None),
        [HASH_VALUES] = Py_NewRef(Py_None), [LOCK_REF] = Py_NewRef(zero), [HOST_REF] = Py_NewRef(zero),
        [HIT_COUNT] = Py_NewRef(zero), [LAST_ACCESS] = Py_NewRef(tick), [CREATION] = Py_NewRef(tick),
        [PRIORITY] = Py_NewRef(priority), [FRONTIERS] = frontiers, [FLAGS] = zero,
    };
    for (int i = 0; i < NUM_LEAF_SLOTS; i++) {
        LEAF_SLOT(node, i) = values[i];  /* the new references above, each handed to the node */
    }
    return node;
}

/* new_leaf(type, ids, parent, elems, start, end, extra_key, tick, priority, value, page_size, key_slack) ->
 * the leaf: a ``type`` node (TreeNode) under ``parent`` for elems[start:end] (an int64 array, whole pages)
 * holding device ``value``, its id next(ids), made and linked into parent.children as
 * RadixTree.apply_insert does; ``key_slack`` is radix_key.KEY_SLACK. Nothing changes on an error. */
PyObject *tierkv_new_leaf(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 12 || !PyType_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "new_leaf takes (type, ids, parent, elems, start, end, extra_key, tick, "
                                         "priority, value, page_size, key_slack)");
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)args[0];
    PyObject *parent = args[2], *elems = args[3], *extra_key = args[6];
    Py_ssize_t start = PyLong_AsSsize_t(args[4]), end = PyLong_AsSsize_t(args[5]);
    Py_ssize_t page_size = PyLong_AsSsize_t(args[10]), slack_min = PyLong_AsSsize_t(args[11]);
    if (PyErr_Occurred() || bind_leaf_layout(type) < 0 || !Py_IS_TYPE(parent, type)) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_TypeError, "parent must be a %s", type->tp_name);
        }
        return NULL;
    }
    Py_buffer view;
    if (tierkv_int64_view(elems, &view, "elems") < 0) {
        return NULL;
    }
    Py_ssize_t len = view.len / 8, own = end - start, slack = own / 8 > slack_min ? own / 8 : slack_min;
    PyObject *children = LEAF_SLOT(parent, CHILDREN), *key = NULL, *child_key = NULL, *node = NULL;
    if (page_size < 1 || start < 0 || start % page_size || own < page_size || own % page_size || end > len
        || children == NULL || !PyDict_CheckExact(children)) {
        PyErr_Format(PyExc_ValueError, "new_leaf: elements [%zd, %zd) of %zd are not whole pages of %zd, or the "
                     "parent has no children dict", start, end, len, page_size);
    } else if ((child_key = tierkv_child_key_at((const int64_t *)view.buf, start, page_size, extra_key)) != NULL
               && (key = leaf_key(elems, start, end, len, slack)) != NULL
               && (node = leaf_node(type, args[1], key, extra_key, parent, args[7], args[8], args[9])) != NULL
               && PyDict_SetItem(children, child_key, node) < 0) {
        Py_CLEAR(node);
    }
    PyBuffer_Release(&view);
    Py_XDECREF(child_key);
    Py_XDECREF(key);
    return node;
}
