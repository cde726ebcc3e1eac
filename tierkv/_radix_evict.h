/* Shared by the eviction loop (_radix_evict.c) and its node helpers (_radix_node.c). */
#ifndef TIERKV_RADIX_EVICT_H
#define TIERKV_RADIX_EVICT_H

#include "_radix.h"
#include <stdint.h>

typedef struct {
    PyTypeObject *type;
    Py_ssize_t id, key, extra_key, parent, children, device_value, host_value, lock_ref, host_ref;
} NodeLayout;

extern NodeLayout tierkv_node_layout;  /* the TreeNode type bound last (bind_layout) */

#define SLOT(o, field) (*(PyObject **)((char *)(o) + tierkv_node_layout.field))

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
    PyObject *root, *heap, *live, *changed, *seqs, *key_of, *on_evict;
    ScanHint hints[SCAN_HINTS];
    Py_ssize_t key_slots[4], num_key_slots;  /* key_of given as slot names: the key is those slots */
    int bare_key;  /* key_of given as one slot name (a str): the key is that slot's value itself */
    PyObject *device, *host, *host_changed;  /* the tree's frontier sets, None when untracked (changed is
                                                * device_changed, tracked: the heap reads it) */
    Py_ssize_t page_size, evicted_tokens;
    Stash nodes, values;  /* nodes only when the caller keeps them (keep_nodes) */
    int keep_nodes;
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

/* truth of a ref count slot: the cached small int 0 is compared, not asked */
static inline int is_true(PyObject *v) {
    static PyObject *zero;
    if (zero == NULL) {
        zero = PyLong_FromLong(0);  /* immortal in practice: the interpreter's cached small int */
    }
    return v == zero ? 0 : PyObject_IsTrue(v);
}

int tierkv_bind_layout(PyTypeObject *type);
int tierkv_check_node(PyObject *node);  /* 0, or -1 with a TypeError */
int tierkv_is_device_leaf(EvictCtx *c, PyObject *n);  /* RadixTree.is_device_leaf: 1, 0, or -1 on error */
int tierkv_bind_key_slots(EvictCtx *c);
PyObject *tierkv_rank(EvictCtx *c, PyObject *node);  /* the heap key of node (new reference) */
int tierkv_rank_cmp(EvictCtx *c, PyObject *node, PyObject *key);  /* -1, 0, 1; -2 on error */
PyObject *tierkv_child_key(EvictCtx *c, PyObject *node);  /* RadixTree.child_key of an int64 key */
int tierkv_unlink_child(EvictCtx *c, PyObject *parent, PyObject *node);  /* del parent.children[...node] */

#endif
