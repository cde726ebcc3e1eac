/* Nodes' device slots read in place, for the cache's match (gather the prefix's slots) and insert (which of the
 * caller's slots duplicate the tree's). A node's value is a 1-D int64 CPU tensor (any object with an int64
 * buffer is read through it). Why not ``tensor.numpy()`` per node: that call cost 1.5-3 us, several times the
 * rest of a chat-shaped match; a tensor is read here after checking that it is a contiguous int64 CPU tensor
 * of the node's length, through ``data_ptr()``. */
#include "_radix_walk.h"
#include "_radix.h"
#include "_radix_node.h"
#include <string.h>

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
    const int64_t *p = NULL;
    Py_ssize_t n = -1;
    int ok = tierkv_tensor_memory(value, int64, &p, &n);
    if (ok != 1) {
        if (ok == 0) {
            PyErr_SetString(PyExc_TypeError, "a node value is not a contiguous int64 CPU tensor");
        }
        return NULL;
    }
    if (n < num_slots) {
        PyErr_Format(PyExc_ValueError, "node value of %zd slots, expected at least %zd", n, num_slots);
        return NULL;
    }
    if (p == NULL && num_slots > 0) {
        PyErr_SetString(PyExc_ValueError, "a node value has no data");
    }
    return p;
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

/* The device slots of the path's nodes, as (pointer, count) runs read in place, with each run's lowest and
 * highest slot: the nodes live through the call (the caller's list holds them) and nothing changes their
 * values during it. A path of up to HELD_INLINE nodes needs no allocation. */
#define HELD_INLINE 8
typedef struct {
    const int64_t **ptrs;
    Py_ssize_t *counts;
    int64_t *los, *his;
    Py_ssize_t num, room;
    const int64_t *inline_ptrs[HELD_INLINE];
    Py_ssize_t inline_counts[HELD_INLINE];
    int64_t inline_los[HELD_INLINE], inline_his[HELD_INLINE];
} HeldRuns;

static void held_init(HeldRuns *r) {
    r->ptrs = r->inline_ptrs, r->counts = r->inline_counts, r->los = r->inline_los, r->his = r->inline_his;
    r->num = 0, r->room = HELD_INLINE;
}

static void held_free(HeldRuns *r) {
    if (r->ptrs != r->inline_ptrs) {
        PyMem_Free((void *)r->ptrs), PyMem_Free(r->counts), PyMem_Free(r->los), PyMem_Free(r->his);
    }
}

static int held_grow(HeldRuns *r) {
    Py_ssize_t room = r->room * 2;
    const int64_t **ptrs = PyMem_Malloc((size_t)room * sizeof(*ptrs));
    Py_ssize_t *counts = PyMem_Malloc((size_t)room * sizeof(*counts));
    int64_t *los = PyMem_Malloc((size_t)room * 8), *his = PyMem_Malloc((size_t)room * 8);
    if (ptrs == NULL || counts == NULL || los == NULL || his == NULL) {
        PyMem_Free((void *)ptrs), PyMem_Free(counts), PyMem_Free(los), PyMem_Free(his);
        PyErr_NoMemory();
        return -1;
    }
    memcpy((void *)ptrs, (const void *)r->ptrs, (size_t)r->num * sizeof(*ptrs));
    memcpy(counts, r->counts, (size_t)r->num * sizeof(*counts));
    memcpy(los, r->los, (size_t)r->num * 8), memcpy(his, r->his, (size_t)r->num * 8);
    held_free(r);
    r->ptrs = ptrs, r->counts = counts, r->los = los, r->his = his, r->room = room;
    return 0;
}

/* Whether held[0..n) == mine[0..n), and the lowest and highest of held, in one pass over both (the compare
 * and the range each read the path's slots: a 3,000-token prompt's 24 KB, on every insert under it).
 * Branch-free, so it vectorises (AVX2 where the CPU has it: SSE2 has no 64-bit compare). Four quads of
 * accumulators: with one, as the compiler vectorised the plain loop, each step waited on the previous
 * step's min and max (a compare and a blend): a fan-out insert's slot check (3,600 slots matched) took 1.83 us,
 * 1.39 with four. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
static int equal_and_range(const int64_t *held, const int64_t *mine, Py_ssize_t n, int64_t *lo, int64_t *hi) {
    int64_t low = INT64_MAX, high = INT64_MIN, diff = 0;
    Py_ssize_t j = 0;
#if defined(__GNUC__)
    typedef int64_t quad __attribute__((vector_size(32)));
    quad a[4], b[4], d = {0, 0, 0, 0};  /* an OR waits on nothing: one accumulator does */
    for (int k = 0; k < 4; k++) {
        a[k] = (quad){INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX}, b[k] = -a[k] - 1;
    }
    for (; j + 16 <= n; j += 16) {  /* four independent quads: no step waits on the last one's min and max */
        for (int k = 0; k < 4; k++) {
            quad v, w;
            memcpy(&v, held + j + 4 * k, sizeof v);
            memcpy(&w, mine + j + 4 * k, sizeof w);
            d |= v ^ w;
            quad below = v < a[k], above = v > b[k];  /* lanes of all ones where true */
            a[k] = (v & below) | (a[k] & ~below);
            b[k] = (v & above) | (b[k] & ~above);
        }
    }
    for (int i = 0; i < 4; i++) {
        diff |= d[i];
        for (int k = 0; k < 4; k++) {
            low = a[k][i] < low ? a[k][i] : low;
            high = b[k][i] > high ? b[k][i] : high;
        }
    }
#endif
    for (; j < n; j++) {
        int64_t v = held[j];
        diff |= v ^ mine[j];
        low = v < low ? v : low;
        high = v > high ? v : high;
    }
    *lo = low, *hi = high;
    return diff == 0;
}

/* compare ``n`` of the caller's slots at ``mine`` with ``node``'s device slots: each unequal one is appended
 * to ``*out`` (allocated on first use, room for ``room`` slots, ``*num_out`` used); the node's slots join
 * ``runs``; 0, or -1 on error */
static int add_mismatches(PyObject *node, const int64_t *mine, Py_ssize_t n, PyObject *int64, int64_t **out,
                          Py_ssize_t *num_out, Py_ssize_t room, HeldRuns *runs) {
    Py_buffer view;
    const int64_t *held = value_slots(SLOT(node, device_value), n, int64, &view);
    if ((held == NULL && PyErr_Occurred()) || (runs->num == runs->room && held_grow(runs) < 0)) {
        if (view.obj != NULL) {
            PyBuffer_Release(&view);
        }
        return -1;
    }
    Py_ssize_t r = runs->num++;
    runs->ptrs[r] = held, runs->counts[r] = n;
    int equal = equal_and_range(held, mine, n, &runs->los[r], &runs->his[r]);
    for (Py_ssize_t j = 0; !equal && j < n; j++) {
        if (held[j] == mine[j]) {
            continue;
        }
        if (*out == NULL && (*out = PyMem_Malloc((size_t)room * 8 + 8)) == NULL) {
            PyErr_NoMemory();
            break;
        }
        (*out)[(*num_out)++] = mine[j];
    }
    if (view.obj != NULL) {
        PyBuffer_Release(&view);
    }
    return PyErr_Occurred() ? -1 : 0;
}

/* Pages an insert gives to nodes, checked against the allocator's page flags (1 = free) as
 * SlotAllocator.check_allocated checks them: whole aligned pages, in range, allocated, none given twice. Pages
 * seen are flagged free while checking (a repeat then fails) and flagged back by ``pages_restore``. */
typedef struct {
    char *flags;
    Py_ssize_t num_pages, page_size, num_seen, room;
    int64_t *seen;
    int64_t lo, hi;  /* the lowest and highest slot of the pages seen */
    int page_shift;  /* log2(page_size) when it is a power of two, else -1: a shift, not a division a page */
} PageCheck;

/* log2(n) when n is a power of two (pages are, in practice), else -1 */
static int exact_log2(Py_ssize_t n) {
    int shift = 0;
    while (shift < 62 && ((Py_ssize_t)1 << shift) < n) {
        shift++;
    }
    return ((Py_ssize_t)1 << shift) == n ? shift : -1;
}

/* room in c->seen for ``num`` more pages: one realloc a call, not one per 64 pages */
static int seen_reserve(PageCheck *c, Py_ssize_t num) {
    if (c->num_seen + num <= c->room) {
        return 0;
    }
    Py_ssize_t room = (c->num_seen + num) * 2 + 64;
    int64_t *seen = PyMem_Realloc(c->seen, (size_t)room * 8);
    if (seen == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    c->seen = seen, c->room = room;
    return 0;
}

/* 1 when ``slots`` (n > 0) are one ascending run, slots[j] == slots[0] + j: what the allocator hands out for a
 * prompt, so its pages are checked as one range (a 12k-token new part at page 16 checked page by page, with a
 * division each, was most of an insert's slot check) */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
static int one_run(const int64_t *slots, Py_ssize_t n) {
    int64_t first = slots[0], bad = 0;
    for (Py_ssize_t j = 1; j < n; j++) {  /* no early exit: the compiler vectorises it */
        bad |= slots[j] ^ (first + j);
    }
    return bad == 0;
}

static int page_refused(void) {
    PyErr_SetString(PyExc_ValueError, "a slot taken is misaligned, out of range, free or given twice");
    return -1;
}

/* the pages [page, page + num) of a run: in range and allocated (no flag set), then flagged seen */
static int run_take(PageCheck *c, int64_t first, Py_ssize_t num) {
    Py_ssize_t ps = c->page_size;
    int64_t page = first / ps;
    if (num <= 0 || first < 0 || first % ps || page + num > c->num_pages) {
        return num == 0 ? 0 : page_refused();
    }
    char any = 0;
    for (Py_ssize_t i = 0; i < num; i++) {
        any |= c->flags[page + i];
    }
    if (any) {
        return page_refused();
    }
    memset(c->flags + page, 1, (size_t)num);
    for (Py_ssize_t i = 0; i < num; i++) {
        c->seen[c->num_seen++] = page + i;
    }
    c->lo = first < c->lo ? first : c->lo;
    c->hi = first + num * ps - 1 > c->hi ? first + num * ps - 1 : c->hi;
    return 0;
}

/* 1 when every page of ``slots`` (n a multiple of ps) is an ascending run, slots[p + i] == slots[p] + i: one
 * pass with no early exit, apart from the page flags, so that it vectorises. Why: after eviction the
 * allocator hands a prompt scattered pages, and checking each page inside the flag loop (SSE2, a division a
 * page) was most of a steady-state insert's slot check on the trace (3.2 of 5.7 us). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
static int pages_are_runs(const int64_t *slots, Py_ssize_t n, Py_ssize_t ps) {
    int64_t bad = 0;
#if defined(__GNUC__)
    if (ps == 16) {  /* the usual page: four vectors a page, one accumulator (left alone, GCC transposes pages) */
        typedef int64_t quad __attribute__((vector_size(32)));
        const quad step = {0, 1, 2, 3};
        quad acc = {0, 0, 0, 0};
        for (Py_ssize_t p = 0; p < n; p += 16) {
            quad first = step + slots[p];
            for (int k = 0; k < 16; k += 4) {
                quad x;
                memcpy(&x, slots + p + k, sizeof x);
                acc |= x ^ (first + k);
            }
        }
        return (acc[0] | acc[1] | acc[2] | acc[3]) == 0;
    }
#endif
    for (Py_ssize_t p = 0; p < n; p += ps) {
        int64_t first = slots[p];
        for (Py_ssize_t i = 1; i < ps; i++) {
            bad |= slots[p + i] ^ (first + i);
        }
    }
    return bad == 0;
}

static int pages_take(PageCheck *c, const int64_t *slots, Py_ssize_t n) {
    Py_ssize_t ps = c->page_size;
    if (n % ps) {
        PyErr_SetString(PyExc_ValueError, "slots taken are not whole pages");
        return -1;
    }
    if (n == 0 || seen_reserve(c, n / ps) < 0) {
        return n == 0 ? 0 : -1;
    }
    if (slots[n - 1] == slots[0] + (n - 1) && one_run(slots, n)) {  /* scattered pages fail the first test */
        return run_take(c, slots[0], n / ps);
    }
    if (!pages_are_runs(slots, n, ps)) {
        return page_refused();
    }
    /* locals, not c's fields: a store through the char flags may alias them, and they would be reloaded */
    char *flags = c->flags;
    int64_t *seen = c->seen + c->num_seen, lo = c->lo, hi = c->hi;
    const int shift = c->page_shift;
    const uint64_t num_pages = (uint64_t)c->num_pages, mask = shift >= 0 ? (uint64_t)ps - 1 : 0;
    Py_ssize_t num = 0;
    for (Py_ssize_t p = 0; p < n; p += ps) {  /* each page's first slot: aligned, in range, allocated */
        int64_t first = slots[p];
        uint64_t page = shift >= 0 ? (uint64_t)first >> shift : (uint64_t)first / (uint64_t)ps;
        int misaligned = shift >= 0 ? ((uint64_t)first & mask) != 0 : (uint64_t)first % (uint64_t)ps != 0;
        if (first < 0 || misaligned || page >= num_pages || flags[page]) {
            c->num_seen += num;  /* the pages flagged so far: pages_restore clears them */
            return page_refused();
        }
        flags[page] = 1;  /* seen: the same page again is refused */
        seen[num++] = (int64_t)page;
        lo = first < lo ? first : lo;
        hi = first + ps - 1 > hi ? first + ps - 1 : hi;
    }
    c->num_seen += num, c->lo = lo, c->hi = hi;
    return 0;
}

static void pages_restore(PageCheck *c) {
    for (Py_ssize_t i = 0; i < c->num_seen; i++) {
        c->flags[c->seen[i]] = 0;
    }
    PyMem_Free(c->seen);
}

/* the slots of ``mine`` that ``revived`` (a list of (start, end)) and [leaf_start, num_elems) cover, and the
 * ``num_out`` of ``out``, checked as one set (see PageCheck); then none of them may be a page the path's nodes
 * keep (``runs``): taken, it would be owned twice; freed, freed under a live node. The pages checked are
 * flagged while this runs, so that is one flag read per kept slot. */
static int check_taken(PageCheck *c, const int64_t *mine, PyObject *revived, Py_ssize_t leaf_start,
                       Py_ssize_t num_elems, const int64_t *out, Py_ssize_t num_out, const HeldRuns *runs) {
    for (Py_ssize_t i = 0; revived != NULL && i < PyList_GET_SIZE(revived); i++) {
        PyObject *range = PyList_GET_ITEM(revived, i);
        Py_ssize_t start = PyLong_AsSsize_t(PyTuple_GET_ITEM(range, 0));
        Py_ssize_t end = PyLong_AsSsize_t(PyTuple_GET_ITEM(range, 1));
        if (pages_take(c, mine + start, end - start) < 0) {
            return -1;
        }
    }
    if (pages_take(c, mine + leaf_start, num_elems - leaf_start) < 0
        || (num_out && pages_take(c, out, num_out) < 0)) {
        return -1;
    }
    int shift = c->page_shift, pow2 = shift >= 0;  /* a shift, not a 64-bit division per slot */
    for (Py_ssize_t r = 0; c->num_seen && r < runs->num; r++) {
        const int64_t *held = runs->ptrs[r];
        if (runs->his[r] < c->lo || runs->los[r] > c->hi) {
            continue;  /* no slot of this run lies in a page taken (an empty run's range is empty) */
        }
        for (Py_ssize_t j = 0; j < runs->counts[r]; j++) {
            uint64_t page = pow2 ? (uint64_t)held[j] >> shift : (uint64_t)(held[j] / c->page_size);
            if (held[j] >= 0 && page < (uint64_t)c->num_pages && c->flags[page]) {
                PyErr_Format(PyExc_ValueError, "slot %lld is the tree's own: it may not be taken or freed again",
                             (long long)held[j]);
                return -1;
            }
        }
    }
    return 0;
}

/* plan_slots' walk along the path: ``nodes`` whole, then ``partial``'s first ``partial_len`` elements (or None).
 * Nodes holding device slots add the caller's unequal slots to ``*out``; the others add their range to
 * ``*revived``. Returns the elements covered, or -1 on error. */
static Py_ssize_t path_slots(PyObject *nodes, PyObject *partial, Py_ssize_t partial_len, PyObject *int64,
                             const int64_t *mine, Py_ssize_t len_mine, int64_t **out, Py_ssize_t *num_out,
                             PyObject **revived, HeldRuns *runs) {
    Py_ssize_t pos = 0, num_nodes = PyList_GET_SIZE(nodes);
    for (Py_ssize_t i = 0; i <= num_nodes; i++) {
        PyObject *node = i < num_nodes ? PyList_GET_ITEM(nodes, i) : partial;
        if (node == Py_None) {
            break;
        }
        Py_ssize_t n = tierkv_check_node(node) < 0 ? -1 : (i < num_nodes ? PyObject_Length(SLOT(node, key)) : partial_len);
        if (n < 0 || pos + n > len_mine) {
            if (!PyErr_Occurred()) {
                PyErr_Format(PyExc_ValueError, "the path covers more than the %zd slots given", len_mine);
            }
            return -1;
        }
        if (SLOT(node, device_value) != Py_None) {
            if (add_mismatches(node, mine + pos, n, int64, out, num_out, len_mine, runs) < 0) {
                return -1;
            }
        } else {
            PyObject *range = Py_BuildValue("(nn)", pos, pos + n);
            if (range == NULL || (*revived == NULL && (*revived = PyList_New(0)) == NULL)
                || PyList_Append(*revived, range) < 0) {
                Py_XDECREF(range);
                return -1;
            }
            Py_DECREF(range);
        }
        pos += n;
    }
    return pos;
}

/* The caller's slots ``obj``: an int64 buffer (held in ``view``: release it after), or a contiguous int64 CPU
 * tensor read in place (the caller holds it through the call). Its slot count in *num. */
static const int64_t *caller_slots(PyObject *obj, PyObject *int64, Py_buffer *view, Py_ssize_t *num) {
    view->obj = NULL;
    if (PyObject_CheckBuffer(obj)) {
        if (tierkv_int64_view(obj, view, "mine") < 0) {
            return NULL;
        }
        *num = view->len / 8;
        return (const int64_t *)view->buf;
    }
    const int64_t *p = NULL;
    int ok = tierkv_tensor_memory(obj, int64, &p, num);
    if (ok == 0) {
        PyErr_SetString(PyExc_TypeError, "mine is not a contiguous int64 CPU tensor");
    }
    return ok == 1 ? p : NULL;
}

/* Copy the new leaf's slots mine[pos:num_elems] into ``leaf`` (a writable buffer of that many int64s, made
 * by the caller when the leaf must not keep a view of the caller's tensor); None: nothing to do. Why here: a
 * numpy view of the caller's tensor, then slicing and copying it in Python, cost an insert more than the
 * rest of this call. */
static int leaf_fill(PyObject *leaf, const int64_t *mine, Py_ssize_t pos, Py_ssize_t num_elems) {
    if (leaf == Py_None) {
        return 0;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(leaf, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        return -1;
    }
    if (view.len != (num_elems - pos) * 8) {
        PyErr_Format(PyExc_TypeError, "leaf must be a writable buffer of %zd int64 slots", num_elems - pos);
        PyBuffer_Release(&view);
        return -1;
    }
    memcpy(view.buf, mine + pos, (size_t)view.len);
    PyBuffer_Release(&view);
    return 0;
}

/* plan_slots(mine, nodes, partial, partial_len, num_elems, page_size, is_free, int64, leaf) -> (mismatched, revived):
 * along a planned insert's path (``nodes`` whole, then ``partial``'s first
 * ``partial_len`` elements, or None), over the caller's slots ``mine`` (an int64 buffer or tensor): the
 * caller's slots unequal to those of nodes holding device slots (a bytearray, or None when all are equal), the
 * ranges (start, end) of ``mine`` that nodes without device slots will take (a list, or None); the new leaf's
 * slots are copied into ``leaf`` (a writable buffer) unless it is None (see leaf_fill). Those, the new leaf's (from the path's end to
 * ``num_elems``) and the unequal ones are checked against the allocator's flags ``is_free`` and against the
 * path's own slots (see check_taken): a ValueError, changing nothing, if they fail. */
PyObject *tierkv_plan_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 9 || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "plan_slots takes (mine, nodes: list, partial, partial_len, num_elems, "
                                         "page_size, is_free, int64, leaf)");
        return NULL;
    }
    Py_ssize_t partial_len = PyLong_AsSsize_t(args[3]), num_elems = PyLong_AsSsize_t(args[4]);
    Py_ssize_t page_size = PyLong_AsSsize_t(args[5]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer vm, vf = {0};
    Py_ssize_t len_mine = 0;
    const int64_t *mine = caller_slots(args[0], args[7], &vm, &len_mine);
    if (mine == NULL && PyErr_Occurred()) {
        return NULL;
    }
    if (PyObject_GetBuffer(args[6], &vf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0 || vf.itemsize != 1
        || page_size < 1 || num_elems > len_mine || partial_len < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "is_free must be 1-byte flags, page_size >= 1, num_elems within mine");
        }
        if (vf.obj != NULL) {
            PyBuffer_Release(&vf);
        }
        PyBuffer_Release(&vm);
        return NULL;
    }
    Py_ssize_t num_out = 0, pos;
    int64_t *out = NULL;
    PyObject *revived = NULL, *result = NULL;
    PageCheck check = {vf.buf, vf.len, page_size, 0, 0, NULL, INT64_MAX, INT64_MIN, exact_log2(page_size)};
    HeldRuns runs;
    held_init(&runs);
    pos = path_slots(args[1], args[2], partial_len, args[7], mine, len_mine, &out, &num_out, &revived, &runs);
    if (pos < 0 || pos > num_elems) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "the path is longer than num_elems");
        }
        goto done;
    }
    int bad = check_taken(&check, mine, revived, pos, num_elems, out, num_out, &runs);
    pages_restore(&check);
    if (bad < 0 || leaf_fill(args[8], mine, pos, num_elems) < 0) {
        goto done;
    }
    PyObject *mismatched = out == NULL ? Py_NewRef(Py_None) : PyByteArray_FromStringAndSize((const char *)out, num_out * 8);
    if (mismatched != NULL) {
        result = PyTuple_Pack(2, mismatched, revived == NULL ? Py_None : revived);
        Py_DECREF(mismatched);
    }
done:
    Py_XDECREF(revived);
    PyMem_Free(out);
    held_free(&runs);
    if (vm.obj != NULL) {
        PyBuffer_Release(&vm);
    }
    PyBuffer_Release(&vf);
    return result;
}
