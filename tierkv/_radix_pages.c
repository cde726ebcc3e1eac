#include "_radix_evict.h"
#include "_radix_node.h"
#include <stdint.h>
#include <string.h>

/* free_whole_pages: the slot allocator's free of an eviction's victims (tierkv/pools/allocator.py,
 * SlotAllocator.free_each with whole_pages), one pass over the victims' slot tensors.
 *
 * Why here: an eviction hands back one slot tensor per node; reading each one's pages through numpy
 * (``t.numpy()``, a torch detach per tensor) and ``len(t)`` (a Python-level __len__) cost more than the
 * eviction loop itself (two thirds of a steady trace eviction). Here each tensor costs a few C-level method
 * calls that read its layout, then its memory is read directly: each page's first slot, as the allocator's
 * first-slot reference (``_free_pages_of``) reads it. It lives beside the eviction loop
 * because it frees what that loop collects; it knows nothing of the tree.
 *
 * Contract: every tensor must be a CPU, contiguous, 1-D int64 torch tensor of whole aligned pages (a tree
 * node's slots); anything else raises TypeError, a misaligned page, a page out of range or a page freed
 * twice ValueError, both with the flags unchanged, so the caller can re-run its reference to name the
 * problem. */

/* slot pages read ahead of the one being freed: 48 pages (6 KiB at page 16) cover a memory latency at ~8 ns
 * a page; 16 freed a steady trace eviction's 2,100 pages in 16.5-17.4 us, 48 in 13.7-14.3 */
#define PREFETCH_PAGES 48

typedef struct {
    const int64_t *slots;
    Py_ssize_t num_slots;
} SlotRun;

/* The memory and length of one slot tensor; TypeError unless CPU, contiguous and of ``dtype``. */
static int read_run(PyObject *t, PyObject *dtype, SlotRun *run) {
    int ok = tierkv_tensor_memory(t, dtype, &run->slots, &run->num_slots);
    if (ok == 0) {
        PyErr_SetString(PyExc_TypeError, "free_whole_pages takes CPU contiguous int64 tensors");
    }
    return ok == 1 ? 0 : -1;
}

/* Each page's id into ``pages``, its flag flipped to free; on a bad page, the flags flipped so far are
 * flipped back. Returns the pages written, or -1. Only each page's first slot is read, as the allocator's
 * first-slot reference reads it (``_free_pages_of``: the caller vouches that its tensors are whole pages):
 * on page 16 a page's last slot is on another cache line, and those reads were most of this loop's time
 * (an eviction's slots were written long before, so each line is a miss). */
static Py_ssize_t flip_runs(const SlotRun *runs, Py_ssize_t num_runs, Py_ssize_t page_size, char *is_free,
                            Py_ssize_t num_pages, int64_t *pages) {
    Py_ssize_t n = 0;
    const char *why = NULL;
    int shift = -1;  /* a power-of-two page: a shift and a mask, not a 64-bit division per page */
    if ((page_size & (page_size - 1)) == 0) {
        for (shift = 0; ((Py_ssize_t)1 << shift) < page_size; shift++) {
        }
    }
    for (Py_ssize_t r = 0; r < num_runs && why == NULL; r++) {
        const int64_t *s = runs[r].slots;
        for (Py_ssize_t i = 0; i < runs[r].num_slots; i += page_size) {
            /* a hint, harmless past the end: the hardware prefetcher stops at each 4 KiB memory page, and
             * on page 16 a slot page is a line of its own, so a whole-tree eviction waited on every line */
            __builtin_prefetch(s + i + PREFETCH_PAGES * page_size);
            int64_t first = s[i];
            int64_t page = shift >= 0 ? first >> shift : first / page_size;
            int aligned = shift >= 0 ? (first & (page_size - 1)) == 0 : first % page_size == 0;
            if (first < 0 || !aligned) {
                why = "slots are not whole aligned pages";
            } else if (page >= num_pages) {
                why = "slot out of range";
            } else if (is_free[page]) {
                why = "double free of a page";
            }
            if (why != NULL) {
                break;
            }
            is_free[page] = 1;
            pages[n++] = page;
        }
    }
    if (why == NULL) {
        return n;
    }
    while (n-- > 0) {
        is_free[pages[n]] = 0;
    }
    PyErr_SetString(PyExc_ValueError, why);
    return -1;
}

PyObject *tierkv_free_whole_pages(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4 || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "free_whole_pages(slot_tensors: list, page_size, is_free, dtype)");
        return NULL;
    }
    Py_ssize_t page_size = PyLong_AsSsize_t(args[1]);
    if (page_size == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (page_size < 1) {
        PyErr_Format(PyExc_ValueError, "page_size must be positive, got %zd", page_size);
        return NULL;
    }
    PyObject *list = args[0], *result = NULL;
    Py_ssize_t num_runs = PyList_GET_SIZE(list), num_slots = 0;
    Py_buffer flags = {0};
    SlotRun *runs = PyMem_Malloc((num_runs + 1) * sizeof(SlotRun));
    if (runs == NULL) {
        return PyErr_NoMemory();
    }
    for (Py_ssize_t r = 0; r < num_runs; r++) {  /* the calls first: a refusal changes nothing */
        if (read_run(PyList_GET_ITEM(list, r), args[3], &runs[r]) < 0) {
            goto done;
        }
        /* the slots were written at insert, long ago: ask for them now so flip_runs finds them in (their
         * reads were most of its time) */
        __builtin_prefetch(runs[r].slots);
        if (runs[r].num_slots % page_size) {
            PyErr_Format(PyExc_ValueError, "%zd slots are not whole pages of %zd", runs[r].num_slots, page_size);
            goto done;
        }
        num_slots += runs[r].num_slots;
    }
    if (PyObject_GetBuffer(args[2], &flags, PyBUF_WRITABLE) < 0) {
        goto done;
    }
    result = PyBytes_FromStringAndSize(NULL, num_slots / page_size * (Py_ssize_t)sizeof(int64_t));
    if (result != NULL && flip_runs(runs, num_runs, page_size, flags.buf, flags.len,
                                    (int64_t *)PyBytes_AS_STRING(result)) < 0) {
        Py_CLEAR(result);
    }
done:
    if (flags.obj != NULL) {
        PyBuffer_Release(&flags);
    }
    PyMem_Free(runs);
    return result;
}
