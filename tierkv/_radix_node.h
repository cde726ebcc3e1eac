/* Public API of _radix_node.c: TreeNode slots read at their offsets, the leaf test, the heap key of a
 * node, child keys and unlinking. Used by the eviction loop (_radix_evict.c), the walk (_radix_walk.c) and
 * an insert's new leaf (_radix_leaf.c). */
#ifndef TIERKV_RADIX_NODE_H
#define TIERKV_RADIX_NODE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "_tensor_memory.h"

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

/* What the node functions need of the tree and the policy: the root, how a node is ranked, the page
 * size (child keys), the scan hints. The eviction loop holds one per call. */
typedef struct {
    PyObject *root, *key_of;
    Py_ssize_t key_slots[4], num_key_slots;  /* key_of given as slot names: the key is those slots */
    int bare_key;  /* key_of given as one slot name (a str): the key is that slot's value itself */
    Py_ssize_t page_size;
    ScanHint hints[SCAN_HINTS];
} NodeCtx;

/* truth of a ref count slot: the cached small int 0 is compared, not asked */
static inline int is_true(PyObject *v) {
    static PyObject *zero;
    if (zero == NULL) {
        zero = PyLong_FromLong(0);  /* immortal in practice: the interpreter's cached small int */
    }
    return v == zero ? 0 : PyObject_IsTrue(v);
}

/* The tree's attribute names the eviction loop reads on every call, interned once (see _radix_node.c) */
typedef struct {
    PyObject *root, *_frontiers, *device, *host, *host_changed, *device_changed, *page_size, *evictable_size;
} TreeAttrs;
extern TreeAttrs tierkv_tree_attrs;
int tierkv_intern_tree_attrs(void);  /* 0, or -1 with an error set */

int tierkv_bind_layout(PyTypeObject *type);
int tierkv_check_node(PyObject *node);  /* 0, or -1 with a TypeError */
int tierkv_is_device_leaf(NodeCtx *c, PyObject *n);  /* RadixTree.is_device_leaf: 1, 0, or -1 on error */
int tierkv_is_host_leaf(NodeCtx *c, PyObject *n);  /* RadixTree.is_host_leaf: 1, 0, or -1 on error */
int tierkv_bind_key_slots(NodeCtx *c);
PyObject *tierkv_rank(NodeCtx *c, PyObject *node);  /* the heap key of node (new reference) */
int tierkv_rank_cmp(NodeCtx *c, PyObject *node, PyObject *key);  /* -1, 0, 1; -2 on error */
PyObject *tierkv_child_key(NodeCtx *c, PyObject *node);  /* RadixTree.child_key of an int64 key */
/* RadixTree.child_key of the int64 key elems[pos:] (new reference) */
PyObject *tierkv_child_key_at(const int64_t *elems, Py_ssize_t pos, Py_ssize_t page_size, PyObject *extra);
int tierkv_unlink_child(NodeCtx *c, PyObject *parent, PyObject *node);  /* del parent.children[...node] */

#endif
