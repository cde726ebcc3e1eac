/* The slot allocator's bookkeeping (tierkv/pools/allocator.py), part of the _rowcopy module.
 *
 * Every free, insert and copy validates its slots. In numpy that is a dozen small ops and full-size
 * temporaries per call (a sort to find a page freed twice): a third of a trace replay's CPU once eviction
 * frees a few pages per call. Here it is one pass. On any complaint these raise ValueError with the state
 * unchanged, and the allocator re-runs its numpy reference, which names the problem exactly. */
#include "_rowcopy.h"

#include <string.h>

static int get_flags(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_RECORDS) < 0) return -1;
    if (view->itemsize != 1 || !PyBuffer_IsContiguous(view, 'C')) {
        PyErr_SetString(PyExc_TypeError, "page flags must be a contiguous array of 1-byte bools");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Each page's flag must be ``from`` (each page listed once): flips them to !from. On a page whose flag is
 * not (a repeat, flipped already), flips back those done and fails. */
static int flip_pages(char *flags, const int64_t *pages, Py_ssize_t num_pages, char from) {
    for (Py_ssize_t p = 0; p < num_pages; p++) {
        if (flags[pages[p]] != from) {
            while (p-- > 0) flags[pages[p]] = from;
            PyErr_SetString(PyExc_ValueError, "a page in the wrong state, or given twice");
            return -1;
        }
        flags[pages[p]] = !from;
    }
    return 0;
}

/* slots, page_size, flags (per page: 1 = free), then free_slots' output pages: whole aligned pages below
 * len(flags), which are checked. Returns the page count. */
static Py_ssize_t slot_pages(PyObject *const *args, Py_ssize_t nargs, const char *usage, Py_buffer *slots,
                             PyObject **holder, Py_ssize_t *page_size, Py_buffer *flags, int64_t **pages) {
    if (nargs != 4 && nargs != 3) {
        PyErr_Format(PyExc_TypeError, "%s: %zd arguments", usage, nargs);
        return -1;
    }
    *page_size = PyLong_AsSsize_t(args[1]);
    if (*page_size == -1 && PyErr_Occurred()) return -1;
    if (*page_size <= 0) {
        PyErr_Format(PyExc_ValueError, "page_size must be positive, got %zd", *page_size);
        return -1;
    }
    if (get_slots(args[0], slots, holder, "slots") < 0 || get_flags(args[2], flags) < 0) return -1;
    Py_ssize_t num_pages = slots->len / 8 / *page_size;
    *pages = PyMem_Malloc((num_pages + 1) * sizeof(int64_t));
    if (*pages == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (slots_to_pages(slots->buf, slots->len / 8, *page_size, flags->len, *pages) < 0) return -1;
    return num_pages;
}

static PyObject *slot_pages_done(PyObject *result, Py_buffer *slots, PyObject *holder, Py_buffer *flags,
                                 int64_t *pages) {
    if (slots->obj) PyBuffer_Release(slots);
    if (flags->obj) PyBuffer_Release(flags);
    Py_XDECREF(holder);
    PyMem_Free(pages);
    Py_XINCREF(result);
    return result;
}

PyObject *free_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    static const char usage[] = "free_slots(slots, page_size, is_free, out_pages)";
    Py_buffer slots = {0}, flags = {0}, out = {0};
    PyObject *holder = NULL, *result = NULL;
    int64_t *pages = NULL;
    Py_ssize_t page_size;
    Py_ssize_t num_pages = slot_pages(args, nargs, usage, &slots, &holder, &page_size, &flags, &pages);
    if (num_pages < 0) goto done;
    if (nargs != 4 || get_int64s(args[3], &out, "out_pages") < 0) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "%s: out_pages is missing", usage);
        goto done;
    }
    if (out.readonly == 0 && out.len / 8 == num_pages
        && flip_pages(flags.buf, pages, num_pages, 0) == 0) {
        memcpy(out.buf, pages, num_pages * sizeof(int64_t));
        result = Py_None;
    } else if (!PyErr_Occurred()) {
        PyErr_Format(PyExc_ValueError, "out_pages must be a writable array of %zd pages", num_pages);
    }
done:
    if (out.obj) PyBuffer_Release(&out);
    return slot_pages_done(result, &slots, holder, &flags, pages);
}

PyObject *check_allocated(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    Py_buffer slots = {0}, flags = {0};
    PyObject *holder = NULL, *result = NULL;
    int64_t *pages = NULL;
    Py_ssize_t page_size;
    Py_ssize_t num_pages = slot_pages(args, nargs, "check_allocated(slots, page_size, is_free)", &slots, &holder,
                                      &page_size, &flags, &pages);
    /* flipped to free and back: a page already free, or listed twice, fails the first flip */
    if (num_pages >= 0 && flip_pages(flags.buf, pages, num_pages, 0) == 0) {
        flip_pages(flags.buf, pages, num_pages, 1);
        result = Py_None;
    }
    return slot_pages_done(result, &slots, holder, &flags, pages);
}

PyObject *pages_to_slots(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *pages_obj, *out_obj;
    Py_ssize_t page_size;
    if (!PyArg_ParseTuple(args, "OnO:pages_to_slots", &pages_obj, &page_size, &out_obj)) return NULL;
    Py_buffer pages = {0}, out = {0};
    PyObject *result = NULL;
    if (get_int64s(pages_obj, &pages, "pages") < 0 || get_int64s(out_obj, &out, "out") < 0) goto done;
    if (page_size <= 0 || out.readonly || out.len != pages.len * page_size) {
        PyErr_Format(PyExc_ValueError, "pages_to_slots: %zd pages of %zd slots into a %s array of %zd slots",
                     pages.len / 8, page_size, out.readonly ? "read-only" : "writable", out.len / 8);
        goto done;
    }
    const int64_t *p = pages.buf;
    int64_t *s = out.buf;
    for (Py_ssize_t i = 0; i < pages.len / 8; i++) {
        int64_t first = p[i] * page_size;
        for (Py_ssize_t j = 0; j < page_size; j++) *s++ = first + j;
    }
    result = Py_None;
done:
    if (pages.obj) PyBuffer_Release(&pages);
    if (out.obj) PyBuffer_Release(&out);
    Py_XINCREF(result);
    return result;
}
