#include "_radix.h"
#include <structmember.h>
#include <stdint.h>

#define SCAN_CHILDREN 8  /* a parent with at most this many children is scanned, not hashed into */

/* The compiled eviction loop of tierkv._radix (module and key functions: _radix.c).
 *
 * evict_device(...) is EvictionHeap.evict_device's loop (tierkv/eviction/heap.py keeps the pure-Python
 * reference, built on victims(), clear_device_value() and remove_leaf()): pop the persistent heap, check
 * the candidate, drop its device value, unlink it when no tier holds it, re-rank what that changed.
 * Why here: in Python each evicted node cost ~3 us of generator, heap, property and set bookkeeping,
 * as much as SGLang's whole per-node work. The same entries, the same order: (key, node id, seq, node)
 * tuples ranked by the policy's key function, one valid entry per node id in ``live``.
 * TreeNode fields are read at their __slots__ offsets (looked up once per node type). */

typedef struct {
    PyTypeObject *type;
    Py_ssize_t id, key, extra_key, parent, children, device_value, host_value, lock_ref, host_ref;
} NodeLayout;

static NodeLayout layout;

#define SLOT(o, field) (*(PyObject **)((char *)(o) + layout.field))

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

static int bind_layout(PyTypeObject *type) {
    if (layout.type == type) {
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
    Py_XDECREF(layout.type);
    layout = l;
    return 0;
}

static int check_node(PyObject *node) {
    if (!Py_IS_TYPE(node, layout.type)) {
        PyErr_Format(PyExc_TypeError, "expected a %s, got %s", layout.type->tp_name, Py_TYPE(node)->tp_name);
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

/* Where a scan of a parent's children last found one holding device slots: the next scan starts there.
 * Why: evicting in LRU order deletes a parent's oldest children first, and a dict keeps deleted entries
 * (as holes) in front of the live ones, so scans from the start cost O(children) each, O(children^2)
 * for a parent (a shared system prompt) that loses them one by one. Only a hint: a scan that finds
 * nothing from it wraps round to the start, so a stale one (a dict resized, freed, reused) costs time,
 * never a wrong answer. */
#define SCAN_HINTS 64

typedef struct {
    PyObject *dict;  /* compared, never dereferenced: it may be gone */
    Py_ssize_t pos;
} ScanHint;

typedef struct {
    PyObject *root, *heap, *live, *changed, *seqs, *key_of, *on_evict;
    ScanHint hints[SCAN_HINTS];
    Py_ssize_t key_slots[4], num_key_slots;  /* key_of given as slot names: the key is those slots */
    int bare_key;  /* key_of given as one slot name (a str): the key is that slot's value itself */
    PyObject *device, *host, *host_changed;  /* the tree's frontier sets, None when untracked (changed is
                                                * device_changed, tracked: the heap reads it) */
    Py_ssize_t page_size, evicted_tokens;
    PyObject *nodes, *values;
} EvictCtx;

/* set.add / set.discard on a frontier set of the tree, nothing when it is None (nobody reads it yet:
 * tierkv/radix_frontiers.py) */
static int frontier_add(PyObject *set, PyObject *node) {
    return set == Py_None ? 0 : PySet_Add(set, node);
}

static int frontier_discard(PyObject *set, PyObject *node) {
    return set == Py_None ? 0 : PySet_Discard(set, node);
}

/* a child of ``children`` holding device slots, scanning entries [from, to): 1, 0, or -1 on error;
 * *found is the entry after it */
static int scan_device_child(PyObject *children, Py_ssize_t from, Py_ssize_t to, Py_ssize_t *found) {
    Py_ssize_t pos = from;
    PyObject *k, *child;
    while (pos < to && PyDict_Next(children, &pos, &k, &child)) {
        if (!Py_IS_TYPE(child, layout.type) || SLOT(child, device_value) == NULL) {
            return check_node(child) < 0 ? -1 : 0;  /* the full check names what is wrong */
        }
        if (SLOT(child, device_value) != Py_None) {
            *found = pos;
            return 1;
        }
    }
    return 0;
}

/* Memory an eviction will read: a node's own lines (with the collector's header in front), then, once
 * those are in, what its slots point to. Why: evicting walks up chains of nodes built long before
 * (a conversation's turns), each a handful of cache misses; asking for a parent's lines one step
 * early overlaps them with the work on its child. Hints only: nothing is read here. */
static inline void prefetch_lines(const void *p, int num_lines) {
    for (int i = 0; i < num_lines; i++) {
        __builtin_prefetch((const char *)p + 64 * i);
    }
}

/* The cyclic collector's links in front of a tracked object (CPython's PyGC_Head, 3.8 to 3.13): freeing
 * a node unlinks it, writing to both neighbours; read only to prefetch them. */
typedef struct {
    uintptr_t next, prev;
} GCLinks;

static inline void prefetch_node(PyObject *n) {
    if (n != Py_None) {
        prefetch_lines((const char *)n - sizeof(GCLinks), 4);
    }
}

static inline void prefetch_gc_neighbours(PyObject *n) {
#if PY_VERSION_HEX < 0x030E0000
    if (PyObject_GC_IsTracked(n)) {
        const GCLinks *links = (const GCLinks *)n - 1;
        __builtin_prefetch((const void *)(links->next & ~(uintptr_t)3));
        __builtin_prefetch((const void *)(links->prev & ~(uintptr_t)3));
    }
#else
    (void)n;
#endif
}

static inline void prefetch_slots(PyObject *n) {
    if (n != Py_None && Py_IS_TYPE(n, layout.type)) {
        prefetch_lines(SLOT(n, key), 1);
        prefetch_lines(SLOT(n, children), 1);
        prefetch_lines(SLOT(n, id), 1);
        prefetch_gc_neighbours(n);
        prefetch_node(SLOT(n, parent));
    }
}

/* truth of a ref count slot: the cached small int 0 is compared, not asked */
static inline int is_true(PyObject *v) {
    static PyObject *zero;
    if (zero == NULL) {
        zero = PyLong_FromLong(0);  /* immortal in practice: the interpreter's cached small int */
    }
    return v == zero ? 0 : PyObject_IsTrue(v);
}

/* RadixTree.is_device_leaf: 1, 0, or -1 on error */
static int is_device_leaf(EvictCtx *c, PyObject *n) {
    if (check_node(n) < 0) {
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

/* the heap key of ``node`` (new reference): a call, or its slots read here, one bare or a tuple of them
 * (LRU's heap key is last_access_time: a Python call per ranked node cost more than the rest) */
static PyObject *rank(EvictCtx *c, PyObject *node) {
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

static int bind_key_slots(EvictCtx *c) {
    if (PyUnicode_Check(c->key_of)) {
        const char *name = PyUnicode_AsUTF8(c->key_of);
        if (name == NULL || slot_offset(layout.type, name, &c->key_slots[0]) < 0) {
            return -1;
        }
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
        if (slot_offset(layout.type, name, &c->key_slots[i]) < 0) {
            return -1;
        }
    }
    c->num_key_slots = n;
    return 0;
}

/* rank(c, node) compared with ``key`` as tierkv_key_cmp does; a slot key is compared slot by slot, with
 * no tuple built (in a chain, each parent is compared with the heap's top and evicted at once) */
static int rank_cmp(EvictCtx *c, PyObject *node, PyObject *key) {
    PyObject *first = c->num_key_slots > 0 ? *(PyObject **)((char *)node + c->key_slots[0]) : NULL;
    if (c->bare_key && first != NULL) {
        return tierkv_obj_cmp(first, key);
    }
    if (c->num_key_slots > 0 && PyTuple_CheckExact(key) && PyTuple_GET_SIZE(key) == c->num_key_slots) {
        for (Py_ssize_t i = 0; i < c->num_key_slots; i++) {
            PyObject *v = *(PyObject **)((char *)node + c->key_slots[i]);
            if (v == NULL) {
                break;  /* rank() raises */
            }
            int cmp = tierkv_obj_cmp(v, PyTuple_GET_ITEM(key, i));
            if (cmp != 0 || i == c->num_key_slots - 1) {
                return cmp;
            }
        }
    }
    PyObject *ranked = rank(c, node);
    int cmp = ranked == NULL ? -2 : tierkv_key_cmp(ranked, key);
    Py_XDECREF(ranked);
    return cmp;
}

/* one valid entry for ``node`` ranked by ``key`` (new reference consumed), or by key_of(node) when NULL */
static int push_node(EvictCtx *c, PyObject *node, PyObject *key) {
    if (key == NULL && (key = rank(c, node)) == NULL) {
        return -1;
    }
    PyObject *seq = PyIter_Next(c->seqs), *entry = NULL;
    int rc = -1;
    if (seq != NULL && PyDict_SetItem(c->live, SLOT(node, id), seq) == 0
        && (entry = PyTuple_Pack(4, key, SLOT(node, id), seq, node)) != NULL) {
        rc = tierkv_heap_push(c->heap, entry);
    } else if (seq == NULL && !PyErr_Occurred()) {
        PyErr_SetString(PyExc_RuntimeError, "eviction heap sequence exhausted");
    }
    Py_DECREF(key);
    Py_XDECREF(seq);
    Py_XDECREF(entry);
    return rc;
}

/* EvictionHeap._drain: push the changed nodes that are candidates now, then forget the changes */
static int drain(EvictCtx *c) {
    if (PySet_GET_SIZE(c->changed) == 0) {
        return 0;
    }
    /* Three passes: listing the nodes and then asking for what ranking them reads are short loops whose
     * cache misses overlap (a cold evict-all drains a node per leaf of the tree); the pass that ranks and
     * pushes then finds it in cache. */
    PyObject *nodes = PySequence_List(c->changed);
    if (nodes == NULL) {
        return -1;
    }
    PyObject_GC_UnTrack(nodes);  /* a temporary in no cycle: collections the pushes trigger skip it */
    Py_ssize_t n = PyList_GET_SIZE(nodes);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *node = PyList_GET_ITEM(nodes, i);
        if (Py_IS_TYPE(node, layout.type) && SLOT(node, children) != NULL) {
            prefetch_node(node);
            prefetch_lines(SLOT(node, children), 1);
            for (Py_ssize_t k = 0; k < c->num_key_slots; k++) {
                PyObject *v = *(PyObject **)((char *)node + c->key_slots[k]);
                if (v != NULL) {
                    prefetch_lines(v, 1);
                }
            }
        }
    }
    int rc = 0;
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) {
        PyObject *node = PyList_GET_ITEM(nodes, i);
        int cand = is_device_leaf(c, node);
        rc = cand < 0 || (cand && push_node(c, node, NULL) < 0) ? -1 : 0;
    }
    Py_DECREF(nodes);
    return rc < 0 ? -1 : PySet_Clear(c->changed);
}

/* RadixTree.child_key(node.key, node.extra_key) for int64 keys */
static PyObject *child_key(EvictCtx *c, PyObject *node) {
    Py_buffer view;
    if (tierkv_int64_view(SLOT(node, key), &view, "node key") < 0) {
        return NULL;
    }
    PyObject *first = NULL;
    if (view.len < c->page_size * 8 || view.len == 0) {
        PyErr_SetString(PyExc_ValueError, "node key shorter than a page");
    } else if (c->page_size == 1) {
        first = PyLong_FromLongLong(((const int64_t *)view.buf)[0]);
    } else {
        first = PyBytes_FromStringAndSize((const char *)view.buf, c->page_size * 8);
    }
    PyBuffer_Release(&view);
    PyObject *extra = SLOT(node, extra_key);
    if (first == NULL || extra == Py_None) {
        return first;
    }
    PyObject *pair = PyTuple_Pack(2, extra, first);
    Py_DECREF(first);
    return pair;
}

/* on_evict(node, removed) when the caller gave a hook: a policy's state (GDSF's clock) may rank the
 * parent that joins next */
static int report(EvictCtx *c, PyObject *node, PyObject *removed) {
    if (c->on_evict == Py_None) {
        return 0;
    }
    PyObject *r = PyObject_CallFunctionObjArgs(c->on_evict, node, removed, NULL);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* Delete ``node`` from its parent's children. Why by identity: its child key reads the first page of
 * the node's key, a cache miss per evicted node (~15 % of the loop on chat keys); a parent's few
 * children are scanned for the node instead, and only a parent with many is looked up by key. */
static int unlink_child(EvictCtx *c, PyObject *parent, PyObject *node) {
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
    PyObject *ck = child_key(c, node);  /* not found: the lookup by key raises the KeyError */
    int rc = ck == NULL ? -1 : PyDict_DelItem(children, ck);
    Py_XDECREF(ck);
    return rc;
}

/* clear_device_value(node), then remove_leaf(node) when no tier holds it; ``node`` is a candidate */
static int evict_one(EvictCtx *c, PyObject *node, Py_ssize_t *freed) {
    Py_ssize_t num_tokens = PyObject_Size(SLOT(node, key));
    if (num_tokens < 0 || (c->nodes != NULL && PyList_Append(c->nodes, node) < 0)
        || PyList_Append(c->values, SLOT(node, device_value)) < 0) {
        return -1;
    }
    Py_SETREF(SLOT(node, device_value), Py_NewRef(Py_None));
    c->evicted_tokens += num_tokens;
    *freed += num_tokens;
    PyObject *parent = SLOT(node, parent);  /* the caller marks it changed (see evict_loop) */
    if (parent != Py_None && frontier_add(c->device, parent) < 0) {
        return -1;
    }
    if (SLOT(node, host_value) != Py_None || PyDict_GET_SIZE(SLOT(node, children)) != 0) {
        /* kept, host-only: the host tier's heap ranks it again (removed nodes leave that set at once) */
        return frontier_add(c->host_changed, node) < 0 ? -1 : report(c, node, Py_False);
    }
    int held = is_true(SLOT(node, host_ref));
    if (held) {
        if (held > 0) {
            PyErr_Format(PyExc_RuntimeError, "node %S is locked", SLOT(node, id));
        }
        return -1;
    }
    if (check_node(parent) < 0 || unlink_child(c, parent, node) < 0
        || frontier_discard(c->device, node) < 0 || frontier_discard(c->host, node) < 0
        || (PySet_GET_SIZE(c->changed) > 0 && PySet_Discard(c->changed, node) < 0)
        || frontier_discard(c->host_changed, node) < 0) {
        return -1;
    }
    return report(c, node, Py_True);
}

/* The next victim popped from the heap (new reference), NULL with no error when the heap is empty. */
static PyObject *pop_victim(EvictCtx *c, int recheck) {
    while (PyList_GET_SIZE(c->heap) > 0) {
        PyObject *entry = tierkv_heap_pop(c->heap);
        if (entry == NULL) {
            return NULL;
        }
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 4) {
            Py_DECREF(entry);
            PyErr_SetString(PyExc_TypeError, "eviction heap entry is not a (key, id, seq, node) tuple");
            return NULL;
        }
        PyObject *key = PyTuple_GET_ITEM(entry, 0), *id = PyTuple_GET_ITEM(entry, 1);
        PyObject *seq = PyTuple_GET_ITEM(entry, 2), *node = PyTuple_GET_ITEM(entry, 3);
        prefetch_slots(node);
        PyObject *cur = PyDict_GetItemWithError(c->live, id);
        int valid = cur == NULL ? 0 : (cur == seq ? 1 : PyObject_RichCompareBool(cur, seq, Py_EQ));
        int cand = 0;
        if (valid > 0 && PyDict_DelItem(c->live, id) == 0) {
            cand = is_device_leaf(c, node);
        }
        if (PyErr_Occurred()) {
            Py_DECREF(entry);
            return NULL;
        }
        if (cand && recheck) {  /* the key rose since the push: take its place again */
            PyObject *now = rank(c, node);
            int cmp = now == NULL ? -2 : tierkv_key_cmp(now, key);
            int same = cmp == -2 ? -1 : cmp == 0;
            if (same < 0) {
                Py_XDECREF(now);
                Py_DECREF(entry);
                return NULL;
            }
            if (same == 0) {
                cand = 0;
                if (push_node(c, node, now) < 0) {  /* consumes now */
                    Py_DECREF(entry);
                    return NULL;
                }
            } else {
                Py_DECREF(now);
            }
        }
        if (cand) {
            Py_INCREF(node);
            Py_DECREF(entry);
            return node;
        }
        Py_DECREF(entry);
    }
    return NULL;
}

/* After evicting a child of ``parent``, with no other change pending (``changed`` empty): when
 * ``parent`` is a candidate now, ranked before the heap's top, it is the next victim (what pushing and
 * popping it would give), else it joins the heap; not a candidate, it is dropped (as a drain would).
 * Returns the parent to evict next (new reference), or NULL (error set or not). Why not through
 * ``changed`` and a drain: a set add, lookup, iteration and clear per victim, and a second scan of the
 * parent's children. */
static PyObject *parent_next(EvictCtx *c, PyObject *parent) {
    prefetch_slots(parent);  /* evicted next, most likely: a chain's nodes leave bottom-up */
    int cand = parent == Py_None ? 0 : is_device_leaf(c, parent);
    if (cand <= 0) {
        return NULL;
    }
    int first = 1;
    if (PyList_GET_SIZE(c->heap) > 0) {
        PyObject *top = Py_NewRef(PyList_GET_ITEM(c->heap, 0));  /* (key, id) first when equal to it */
        int cmp = PyTuple_CheckExact(top) && PyTuple_GET_SIZE(top) == 4 ? rank_cmp(c, parent, PyTuple_GET_ITEM(top, 0))
                                                                        : -2;
        if (cmp == -2 && !PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "eviction heap entry is not a (key, id, seq, node) tuple");
        }
        cmp = cmp == 0 ? tierkv_obj_cmp(SLOT(parent, id), PyTuple_GET_ITEM(top, 1)) : cmp;
        first = cmp == -2 ? -1 : cmp <= 0;
        Py_DECREF(top);
    }
    if (first == 0) {
        push_node(c, parent, NULL);  /* an error stays set for the caller */
    }
    if (first <= 0) {
        return NULL;
    }
    int stale = PyDict_Contains(c->live, SLOT(parent, id));  /* an older entry of it: drop it (no KeyError
                                                                  raised and cleared per victim) */
    if (stale < 0 || (stale && PyDict_DelItem(c->live, SLOT(parent, id)) < 0)) {
        return NULL;
    }
    return Py_NewRef(parent);
}

/* ``changed`` gains ``parent``, whatever error is pending (it must be ranked again at the next call) */
static int mark_parent(EvictCtx *c, PyObject *parent) {
    if (parent == Py_None) {
        return 0;
    }
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    int rc = PySet_Add(c->changed, parent);
    if (type != NULL) {
        PyErr_Restore(type, value, tb);
    }
    return rc;
}

static int evict_loop(EvictCtx *c, Py_ssize_t num_tokens, int recheck) {
    Py_ssize_t freed = 0;
    PyObject *next = NULL;
    if (drain(c) < 0) {
        return -1;
    }
    while (freed < num_tokens) {
        PyObject *node = next != NULL ? next : pop_victim(c, recheck);
        next = NULL;
        if (node == NULL) {
            return PyErr_Occurred() ? -1 : 0;
        }
        PyObject *parent = SLOT(node, parent);  /* alive: its parent's children hold it */
        prefetch_node(parent);
        if (PyList_GET_SIZE(c->heap) > 0) {  /* the heap's next victim, when the chain above ends */
            PyObject *top = PyList_GET_ITEM(c->heap, 0);
            if (PyTuple_CheckExact(top) && PyTuple_GET_SIZE(top) == 4) {
                prefetch_node(PyTuple_GET_ITEM(top, 3));
            }
        }
        int rc = evict_one(c, node, &freed);
        if (rc < 0 || freed >= num_tokens || PySet_GET_SIZE(c->changed) > 0) {
            rc = mark_parent(c, parent) < 0 ? -1 : rc;
            rc = rc == 0 && freed < num_tokens ? drain(c) : rc;
        } else {
            next = parent_next(c, parent);
            rc = next == NULL && PyErr_Occurred() ? -1 : 0;
        }
        Py_DECREF(node);
        if (rc < 0) {
            Py_XDECREF(next);
            return -1;
        }
        if (next != NULL) {  /* its parent's lines came in during this step: ask for the dict next's
                              * eviction unlinks it from */
            PyObject *up = SLOT(next, parent);
            if (up != Py_None && Py_IS_TYPE(up, layout.type)) {
                prefetch_lines(SLOT(up, children), 1);
            }
        }
    }
    Py_XDECREF(next);
    return 0;
}

PyObject *tierkv_evict_device(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 10) {
        PyErr_Format(PyExc_TypeError, "evict_device takes (tree, heap, live, changed, seqs, key_of, recheck, "
                     "num_tokens, on_evict, keep_nodes), got %zd arguments", nargs);
        return NULL;
    }
    PyObject *tree = args[0];
    EvictCtx c = {0};
    c.heap = args[1], c.live = args[2], c.changed = args[3], c.seqs = args[4], c.key_of = args[5], c.on_evict = args[8];
    int recheck = PyObject_IsTrue(args[6]), keep_nodes = PyObject_IsTrue(args[9]);
    Py_ssize_t num_tokens = PyLong_AsSsize_t(args[7]);
    if (recheck < 0 || keep_nodes < 0 || (num_tokens == -1 && PyErr_Occurred())) {
        return NULL;
    }
    if (!PyList_CheckExact(c.heap) || !PyDict_CheckExact(c.live) || !PySet_CheckExact(c.changed)) {
        PyErr_SetString(PyExc_TypeError, "evict_device needs the heap's list, live dict and changed set");
        return NULL;
    }
    PyObject *frontiers = NULL, *page = NULL, *result = NULL;
    c.root = PyObject_GetAttrString(tree, "root");
    c.nodes = keep_nodes ? PyList_New(0) : NULL, c.values = PyList_New(0);
    /* untracked while they grow (no Python code sees them before they are returned): collections the
     * loop's allocations trigger need not traverse them; tracked again below */
    if (c.nodes != NULL) {
        PyObject_GC_UnTrack(c.nodes);
    }
    if (c.values != NULL) {
        PyObject_GC_UnTrack(c.values);
    }
    if (c.root == NULL || (keep_nodes && c.nodes == NULL) || c.values == NULL
        || bind_layout(Py_TYPE(c.root)) < 0 || bind_key_slots(&c) < 0
        || (frontiers = PyObject_GetAttrString(c.root, "_frontiers")) == NULL
        || (c.device = PyObject_GetAttrString(frontiers, "device")) == NULL
        || (c.host = PyObject_GetAttrString(frontiers, "host")) == NULL
        || (c.host_changed = PyObject_GetAttrString(frontiers, "host_changed")) == NULL
        || (page = PyObject_GetAttrString(tree, "page_size")) == NULL
        || ((c.page_size = PyLong_AsSsize_t(page)) == -1 && PyErr_Occurred())) {
        goto done;
    }
    if ((c.device != Py_None && !PySet_CheckExact(c.device)) || (c.host != Py_None && !PySet_CheckExact(c.host))
        || (c.host_changed != Py_None && !PySet_CheckExact(c.host_changed))) {
        PyErr_SetString(PyExc_TypeError, "tree frontiers are not sets or None");
        goto done;
    }
    int rc = evict_loop(&c, num_tokens, recheck);
    if (c.evicted_tokens > 0) {  /* _account: every node evicted was unlocked; also after an error */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *size = PyObject_GetAttrString(tree, "evictable_size"), *delta = PyLong_FromSsize_t(c.evicted_tokens);
        PyObject *left = size && delta ? PyNumber_Subtract(size, delta) : NULL;
        int set = left ? PyObject_SetAttrString(tree, "evictable_size", left) : -1;
        Py_XDECREF(size), Py_XDECREF(delta), Py_XDECREF(left);
        if (type != NULL) {
            PyErr_Restore(type, value, tb);
        }
        rc = set < 0 ? -1 : rc;
    }
    if (rc == 0) {
        Py_ssize_t freed = c.evicted_tokens;
        if (!PyObject_GC_IsTracked(c.values)) {
            PyObject_GC_Track(c.values);
        }
        if (c.nodes != NULL && !PyObject_GC_IsTracked(c.nodes)) {
            PyObject_GC_Track(c.nodes);
        }
        result = c.nodes != NULL ? Py_BuildValue("(nOO)", freed, c.nodes, c.values)
                                 : Py_BuildValue("(n[]O)", freed, c.values);
    }
done:
    Py_XDECREF(frontiers), Py_XDECREF(page), Py_XDECREF(c.root);
    Py_XDECREF(c.device), Py_XDECREF(c.host), Py_XDECREF(c.host_changed), Py_XDECREF(c.nodes), Py_XDECREF(c.values);
    return result;
}

