#include "_radix_evict.h"
#include "_radix_heap.h"
#include "_radix_node.h"
#include <string.h>

/* The compiled eviction loop of tierkv._radix (module and key functions: _radix.c).
 *
 * evict_device(...) is EvictionHeap.evict_device's loop (tierkv/eviction/heap.py keeps the pure-Python
 * reference, built on victims(), clear_device_value() and remove_leaf()): pop the persistent heap, check
 * the candidate, drop its device value, unlink it when no tier holds it, re-rank what that changed.
 * Why here: in Python each evicted node cost ~3 us of generator, heap, property and set bookkeeping,
 * as much as SGLang's whole per-node work. The same entries, the same order: (key, node id, seq, node)
 * tuples ranked by the policy's key function, one valid entry per node id in ``live``.
 * TreeNode fields are read at their __slots__ offsets (looked up once per node type: _radix_node.c). */

/* References the loop collects (evicted nodes, their device values), turned into a list at the end.
 * Why not a list from the start: a value's reference moves here from its node's slot, so the loop
 * never touches the value (its reference count is a cache miss per node, and freeing it comes later),
 * and the buffer grows by doubling where a list grows by an eighth (~60 reallocations in a whole-tree
 * eviction of 8k nodes). A small gain (a few %: the values' release, after the call, costs the most). */
typedef struct {
    PyObject **items;
    Py_ssize_t len, cap;
} Stash;

typedef struct {
    NodeCtx node;  /* the root, the ranking, the page size */
    PyObject *heap, *live, *changed, *seqs, *on_evict;
    PyObject *device, *host, *host_changed;  /* the tree's frontier sets, None when untracked (changed is
                                                * device_changed, tracked: the heap reads it) */
    Py_ssize_t evicted_tokens;
    Stash nodes, values;  /* nodes only when the caller keeps them (keep_nodes) */
    int keep_nodes;
    int host_tier;  /* 1: the loop evicts the host tier (``changed`` is host_changed) */
    PyObject *device_changed;  /* the device tier's change set, None when untracked (host tier only) */
    int hand_back;  /* 0: evict every victim; 1: stop at one the caller must handle (see needs_caller);
                     * 2: also at one holding more whole pages than the eviction still needs */
    PyObject *held;  /* the victim handed back (popped, not evicted), or NULL */
} EvictCtx;

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

/* an object's lines with the collector's header in front (a key, a children dict) */
static inline void prefetch_object(PyObject *o) {
    prefetch_lines((const char *)o - sizeof(GCLinks), 2);
}

static inline void prefetch_slots(PyObject *n) {
    if (n != Py_None && Py_IS_TYPE(n, tierkv_node_layout.type)) {
        prefetch_object(SLOT(n, key));
        prefetch_object(SLOT(n, children));
        prefetch_lines(SLOT(n, id), 1);
        prefetch_gc_neighbours(n);
        prefetch_node(SLOT(n, parent));
    }
}

/* What releasing ``n`` will touch, asked for as its eviction starts, ~0.2 us before its release: its
 * key's and children dict's lines are in by then (prefetch_slots asked a step earlier), so what they
 * point to is read here. Why: a node's release frees its dict, its key and the key's buffer (or a view's
 * managed buffer), each a cache miss on memory written when the node was inserted, long before (glibc's
 * free of key buffers alone was ~19 % of a whole-tree eviction's samples, ~7 % with this). Hints only:
 * what is read here is the node's own objects, nothing they point to. */
static inline void prefetch_teardown(PyObject *n) {
    PyObject *children = SLOT(n, children), *key = SLOT(n, key);
    prefetch_gc_neighbours(children);
    if (PyMemoryView_Check(key)) {  /* a view of the request's tokens: its managed buffer goes with it, and
                                      * unlinking it from a parent of many children reads its first page */
        prefetch_gc_neighbours(key);
        prefetch_object((PyObject *)((PyMemoryViewObject *)key)->mbuf);
        __builtin_prefetch(PyMemoryView_GET_BUFFER(key)->buf);
        return;
    }
    PyBufferProcs *procs = Py_TYPE(key)->tp_as_buffer;
    Py_buffer view;
    if (procs == NULL || procs->bf_getbuffer == NULL || PyObject_GetBuffer(key, &view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        return;
    }
    const char *buf = (const char *)view.buf;  /* an array's items, a block of their own: the allocator */
    __builtin_prefetch(buf - 16);              /* reads the headers on both sides of it when freeing it */
    __builtin_prefetch(buf + view.len + 8);
    PyBuffer_Release(&view);
}

/* set.add / set.discard on a frontier set of the tree, nothing when it is None (nobody reads it yet:
 * tierkv/radix_frontiers.py) */
static int frontier_add(PyObject *set, PyObject *node) {
    return set == Py_None ? 0 : PySet_Add(set, node);
}

static int frontier_discard(PyObject *set, PyObject *node) {
    return set == Py_None ? 0 : PySet_Discard(set, node);
}

/* whether ``node`` is a candidate of the tier the loop evicts: 1, 0, or -1 on error */
static int is_candidate(EvictCtx *c, PyObject *node) {
    return c->host_tier ? tierkv_is_host_leaf(&c->node, node) : tierkv_is_device_leaf(&c->node, node);
}

/* one valid entry for ``node`` ranked by ``key`` (new reference consumed), or by key_of(node) when NULL */
static int push_node(EvictCtx *c, PyObject *node, PyObject *key) {
    if (key == NULL && (key = tierkv_rank(&c->node, node)) == NULL) {
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
        if (Py_IS_TYPE(node, tierkv_node_layout.type) && SLOT(node, children) != NULL) {
            prefetch_node(node);
            prefetch_lines(SLOT(node, children), 1);
            for (Py_ssize_t k = 0; k < c->node.num_key_slots; k++) {
                PyObject *v = *(PyObject **)((char *)node + c->node.key_slots[k]);
                if (v != NULL) {
                    prefetch_lines(v, 1);
                }
            }
        }
    }
    int rc = 0;
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) {
        PyObject *node = PyList_GET_ITEM(nodes, i);
        int cand = is_candidate(c, node);
        rc = cand < 0 || (cand && push_node(c, node, NULL) < 0) ? -1 : 0;
    }
    Py_DECREF(nodes);
    return rc < 0 ? -1 : PySet_Clear(c->changed);
}

/* append ``ref`` (a reference the stash takes over, released here if it cannot) */
static int stash_take(Stash *s, PyObject *ref) {
    if (s->len == s->cap) {
        Py_ssize_t cap = s->cap < 64 ? 64 : 2 * s->cap;
        PyObject **items = PyMem_Realloc(s->items, (size_t)cap * sizeof(PyObject *));
        if (items == NULL) {
            Py_DECREF(ref);
            PyErr_NoMemory();
            return -1;
        }
        s->items = items, s->cap = cap;
    }
    s->items[s->len++] = ref;
    return 0;
}

static void stash_drop(Stash *s) {
    for (Py_ssize_t i = 0; i < s->len; i++) {
        Py_DECREF(s->items[i]);
    }
    PyMem_Free(s->items);
    s->items = NULL, s->len = s->cap = 0;
}

/* the stash's references as a new list (NULL on error); the stash is left empty either way */
static PyObject *stash_list(Stash *s) {
    PyObject *list = PyList_New(s->len);
    if (list == NULL) {
        stash_drop(s);
        return NULL;
    }
    if (s->len > 0) {
        memcpy(((PyListObject *)list)->ob_item, s->items, (size_t)s->len * sizeof(PyObject *));
    }
    PyMem_Free(s->items);
    s->items = NULL, s->len = s->cap = 0;
    return list;
}

/* on_evict(node, removed) when the caller gave a hook: a policy's state (GDSF's clock) may rank the
 * parent that joins next */
static int report(EvictCtx *c, PyObject *node, PyObject *removed) {
    if (c->on_evict == Py_None) {
        return 0;
    }
    if (PyDict_CheckExact(c->on_evict)) {  /* the base Policy's hook: forget a removed node's uses */
        if (removed == Py_True && PyDict_DelItem(c->on_evict, SLOT(node, id)) < 0) {
            if (!PyErr_ExceptionMatches(PyExc_KeyError)) {
                return -1;
            }
            PyErr_Clear();
        }
        return 0;
    }
    PyObject *r = PyObject_CallFunctionObjArgs(c->on_evict, node, removed, NULL);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* Move the value at ``offset`` (the node's device or host value slot) to the stash, None in its place, and
 * count the node's tokens; ``node`` is a candidate */
static int take_value(EvictCtx *c, PyObject *node, Py_ssize_t offset, Py_ssize_t *freed) {
    prefetch_teardown(node);
    Py_ssize_t num_tokens = PyObject_Size(SLOT(node, key));
    if (num_tokens < 0 || (c->keep_nodes && stash_take(&c->nodes, Py_NewRef(node)) < 0)) {
        return -1;
    }
    PyObject **slot = (PyObject **)((char *)node + offset);
    PyObject *value = *slot;  /* its reference moves to the stash */
    *slot = Py_NewRef(Py_None);
    if (stash_take(&c->values, value) < 0) {
        return -1;
    }
    c->evicted_tokens += num_tokens;
    *freed += num_tokens;
    return 0;
}

/* remove_leaf(node) for a node no tier holds any more: unlinked, out of every frontier set */
static int unlink_node(EvictCtx *c, PyObject *parent, PyObject *node) {
    if (tierkv_check_node(parent) < 0 || tierkv_unlink_child(&c->node, parent, node) < 0
        || frontier_discard(c->device, node) < 0 || frontier_discard(c->host, node) < 0
        || (PySet_GET_SIZE(c->changed) > 0 && PySet_Discard(c->changed, node) < 0)
        || frontier_discard(c->host_tier ? c->device_changed : c->host_changed, node) < 0) {
        return -1;
    }
    return report(c, node, Py_True);
}

/* ``node.host_value = None`` (as its property setter marks the frontiers), then remove_leaf(node) when no
 * tier holds it; ``node`` is a host candidate */
static int evict_one_host(EvictCtx *c, PyObject *node, Py_ssize_t *freed) {
    if (take_value(c, node, tierkv_node_layout.host_value, freed) < 0) {
        return -1;
    }
    PyObject *parent = SLOT(node, parent);  /* the caller marks it changed (see evict_loop) */
    if ((parent != Py_None && frontier_add(c->host, parent) < 0) || frontier_add(c->device_changed, node) < 0) {
        return -1;
    }
    if (SLOT(node, device_value) != Py_None || PyDict_GET_SIZE(SLOT(node, children)) != 0) {
        return report(c, node, Py_False);  /* kept, in L1 */
    }
    return unlink_node(c, parent, node);
}

/* clear_device_value(node), then remove_leaf(node) when no tier holds it; ``node`` is a candidate */
static int evict_one(EvictCtx *c, PyObject *node, Py_ssize_t *freed) {
    if (c->host_tier) {
        return evict_one_host(c, node, freed);
    }
    if (take_value(c, node, tierkv_node_layout.device_value, freed) < 0) {
        return -1;
    }
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
    return unlink_node(c, parent, node);
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
            cand = is_candidate(c, node);
        }
        if (PyErr_Occurred()) {
            Py_DECREF(entry);
            return NULL;
        }
        if (cand && recheck) {  /* the key rose since the push: take its place again */
            PyObject *now = tierkv_rank(&c->node, node);
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
    int cand = parent == Py_None ? 0 : is_candidate(c, parent);
    if (cand <= 0) {
        return NULL;
    }
    int first = 1;
    if (PyList_GET_SIZE(c->heap) > 0) {
        PyObject *top = Py_NewRef(PyList_GET_ITEM(c->heap, 0));  /* (key, id) first when equal to it */
        int cmp = PyTuple_CheckExact(top) && PyTuple_GET_SIZE(top) == 4 ? tierkv_rank_cmp(&c->node, parent, PyTuple_GET_ITEM(top, 0))
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

/* 1 when ``node`` (a candidate) is the caller's to evict (hand_back): it has no L2 copy and either
 * L2-only descendants (deleting it deletes them: the cache frees their host slots) or a host_ref (kept),
 * or (hand_back 2) it holds more whole pages than the ``left`` tokens still needed (the cache splits
 * it); 0 otherwise, -1 on error */
static int needs_caller(EvictCtx *c, PyObject *node, Py_ssize_t left) {
    if (c->hand_back == 0) {
        return 0;
    }
    if (!c->host_tier && SLOT(node, host_value) == Py_None) {
        if (PyDict_GET_SIZE(SLOT(node, children)) != 0) {
            return 1;
        }
        int held = is_true(SLOT(node, host_ref));
        if (held != 0) {
            return held;
        }
    }
    if (c->hand_back < 2) {
        return 0;
    }
    Py_ssize_t num_tokens = PyObject_Size(SLOT(node, key));
    if (num_tokens < 0) {
        return -1;
    }
    Py_ssize_t need = (left + c->node.page_size - 1) / c->node.page_size * c->node.page_size;
    return num_tokens > need;
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
        int caller = needs_caller(c, node, num_tokens - freed);
        if (caller != 0) {  /* popped, not evicted: the caller evicts it (or keeps it) and calls again */
            if (caller < 0) {
                Py_DECREF(node);
                return -1;
            }
            c->held = node;
            return 0;
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
            if (up != Py_None && Py_IS_TYPE(up, tierkv_node_layout.type)) {
                prefetch_lines(SLOT(up, children), 1);
            }
        }
    }
    Py_XDECREF(next);
    return 0;
}

/* tree.evictable_size -= num_tokens (_account: every node evicted was unlocked), whatever error is pending */
static int account(PyObject *tree, Py_ssize_t num_tokens) {
    if (num_tokens == 0) {
        return 0;
    }
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *size = PyObject_GetAttr(tree, tierkv_tree_attrs.evictable_size), *delta = PyLong_FromSsize_t(num_tokens);
    PyObject *left = size && delta ? PyNumber_Subtract(size, delta) : NULL;
    int set = left ? PyObject_SetAttr(tree, tierkv_tree_attrs.evictable_size, left) : -1;
    Py_XDECREF(size), Py_XDECREF(delta), Py_XDECREF(left);
    if (type != NULL) {
        PyErr_Restore(type, value, tb);
    }
    return set;
}

PyObject *tierkv_evict_device(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 12) {
        PyErr_Format(PyExc_TypeError, "evict_device takes (tree, heap, live, changed, seqs, key_of, recheck, "
                     "num_tokens, on_evict, keep_nodes, hand_back, host_tier), got %zd arguments", nargs);
        return NULL;
    }
    PyObject *tree = args[0];
    EvictCtx c = {0};
    c.heap = args[1], c.live = args[2], c.changed = args[3], c.seqs = args[4], c.on_evict = args[8];
    c.node.key_of = args[5];
    int recheck = PyObject_IsTrue(args[6]), keep_nodes = PyObject_IsTrue(args[9]);
    c.host_tier = PyObject_IsTrue(args[11]);
    if (c.host_tier < 0) {
        return NULL;
    }
    Py_ssize_t num_tokens = PyLong_AsSsize_t(args[7]);
    long hand_back = PyLong_AsLong(args[10]);
    if (recheck < 0 || keep_nodes < 0 || (num_tokens == -1 && PyErr_Occurred())
        || (hand_back == -1 && PyErr_Occurred())) {
        return NULL;
    }
    if (hand_back < 0 || hand_back > 2) {
        PyErr_Format(PyExc_ValueError, "hand_back must be 0, 1 or 2, got %ld", hand_back);
        return NULL;
    }
    c.hand_back = (int)hand_back;
    if (!PyList_CheckExact(c.heap) || !PyDict_CheckExact(c.live) || !PySet_CheckExact(c.changed)) {
        PyErr_SetString(PyExc_TypeError, "evict_device needs the heap's list, live dict and changed set");
        return NULL;
    }
    PyObject *frontiers = NULL, *page = NULL, *result = NULL;
    if (tierkv_intern_tree_attrs() < 0) {
        return NULL;
    }
    c.node.root = PyObject_GetAttr(tree, tierkv_tree_attrs.root);
    c.keep_nodes = keep_nodes;
    if (c.node.root == NULL || tierkv_bind_layout(Py_TYPE(c.node.root)) < 0 || tierkv_bind_key_slots(&c.node) < 0
        || (frontiers = PyObject_GetAttr(c.node.root, tierkv_tree_attrs._frontiers)) == NULL
        || (c.device = PyObject_GetAttr(frontiers, tierkv_tree_attrs.device)) == NULL
        || (c.host = PyObject_GetAttr(frontiers, tierkv_tree_attrs.host)) == NULL
        || (c.host_changed = PyObject_GetAttr(frontiers, tierkv_tree_attrs.host_changed)) == NULL
        || (c.device_changed = PyObject_GetAttr(frontiers, tierkv_tree_attrs.device_changed)) == NULL
        || (page = PyObject_GetAttr(tree, tierkv_tree_attrs.page_size)) == NULL
        || ((c.node.page_size = PyLong_AsSsize_t(page)) == -1 && PyErr_Occurred())) {
        goto done;
    }
    if ((c.device != Py_None && !PySet_CheckExact(c.device)) || (c.host != Py_None && !PySet_CheckExact(c.host))
        || (c.host_changed != Py_None && !PySet_CheckExact(c.host_changed))
        || (c.device_changed != Py_None && !PySet_CheckExact(c.device_changed))) {
        PyErr_SetString(PyExc_TypeError, "tree frontiers are not sets or None");
        goto done;
    }
    /* The collector is paused for the loop: its heap entries are GC-tracked tuples that hold nodes, and
     * the first drain of a cold evict-all pushes a whole frontier of them at once, so every 700 a young
     * collection walked them all (a tenth of the loop's instructions). Nothing the loop makes forms a
     * cycle and it never releases the GIL, so no other code runs meanwhile; a collection that is due
     * runs at the next allocation after it. */
    int gc_was_enabled = PyGC_Disable();
    int rc = evict_loop(&c, num_tokens, recheck);
    if (gc_was_enabled) {
        PyGC_Enable();
    }
    rc = !c.host_tier && account(tree, c.evicted_tokens) < 0 ? -1 : rc;  /* L2 slots are not accounted */
    if (rc == 0) {
        PyObject *freed = PyLong_FromSsize_t(c.evicted_tokens);
        PyObject *nodes = stash_list(&c.nodes), *values = stash_list(&c.values);
        result = freed && nodes && values ? PyTuple_Pack(4, freed, nodes, values, c.held ? c.held : Py_None)
                                          : NULL;
        Py_XDECREF(freed), Py_XDECREF(nodes), Py_XDECREF(values);
    }
done:
    stash_drop(&c.nodes), stash_drop(&c.values);  /* after an error: what was evicted is dropped */
    Py_XDECREF(c.held);
    Py_XDECREF(frontiers), Py_XDECREF(page), Py_XDECREF(c.node.root);
    Py_XDECREF(c.device), Py_XDECREF(c.host), Py_XDECREF(c.host_changed), Py_XDECREF(c.device_changed);
    return result;
}

