/* Native page copy for CPU L1 <-> L2 transfers.
 *
 * copy_pages moves the chunks (token rows, or a page's rows when they are adjacent) of a list of
 * pages between two byte buffers of any layouts: a chunk sits at base + page * page_nbytes on each
 * side, with the per-layout bases computed once by the pool. Chunks adjacent on both sides merge into
 * one memcpy. Bounds are checked before any byte moves, so a bad page is a ValueError, never a write
 * outside the pools. The copy runs without the GIL: the transfer worker copies while the scheduler
 * thread keeps running Python.
 *
 * Why not torch: a gather of page-sized chunks costs one op per run (or a staging pass) plus ~5 us
 * of dispatch per op; this is one call whatever the fragmentation.
 *
 * Given a page size, the page arrays are token slots instead, turned into page ids here with the slot
 * allocator's checks (whole aligned pages, in range); check_only then validates without copying. A copy
 * of a few pages thus costs one call from Python: each torch or numpy op around it costs ~1 us, and
 * 10-40 us when a large copy has just evicted the interpreter from the CPU caches.
 *
 * SlotCopier goes one step further for the transfer controller, which copies between the same two pools
 * all its life: it holds the pools' buffers and chunk maps, so a copy's call parses two slot arrays and
 * nothing else, and it reads the allocator's int64 tensors in place (see tensor_slots).
 */
#include "_rowcopy.h"
#include "../_tensor_memory.h"

#include <string.h>

int get_int64s(PyObject *obj, Py_buffer *view, const char *name) {
    /* strided request, contiguity checked here: numpy refuses a C-contiguous request for a strided
     * array with a ValueError, which callers would read as bad slots rather than a wrong argument */
    if (PyObject_GetBuffer(obj, view, PyBUF_RECORDS_RO) < 0) {
        return -1;
    }
    const char *f = view->format;
    if (view->itemsize != 8 || f == NULL || f[0] == '\0' || strchr("ql", f[0]) == NULL || f[1] != '\0'
        || !PyBuffer_IsContiguous(view, 'C')) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous int64 array, got format %s itemsize %zd",
                     name, f ? f : "?", view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int64_t min_of(const int64_t *v, Py_ssize_t n) {
    int64_t m = INT64_MAX;
    for (Py_ssize_t i = 0; i < n; i++) m = v[i] < m ? v[i] : m;
    return m;
}

static int64_t max_of(const int64_t *v, Py_ssize_t n) {
    int64_t m = INT64_MIN;
    for (Py_ssize_t i = 0; i < n; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* Every chunk offset is base[i] + page * page_nbytes with base and page taken from these arrays:
 * checking the extremes bounds them all. */
static int check_side(const char *side, const int64_t *base, Py_ssize_t num_bases, const int64_t *pages,
                      Py_ssize_t num_pages, Py_ssize_t page_nbytes, Py_ssize_t chunk_nbytes,
                      Py_ssize_t buffer_nbytes) {
    int64_t low_page = min_of(pages, num_pages), high_page = max_of(pages, num_pages);
    int64_t low_base = min_of(base, num_bases), high_base = max_of(base, num_bases);
    if (low_page < 0) {
        PyErr_Format(PyExc_ValueError, "%s page %lld is negative", side, (long long)low_page);
        return -1;
    }
    Py_ssize_t room = buffer_nbytes - chunk_nbytes - (Py_ssize_t)high_base;  /* for the page term */
    if (low_base < 0 || room < 0 || high_page > room / page_nbytes) {
        PyErr_Format(PyExc_ValueError, "%s page %lld is outside a buffer of %zd bytes (%zd bytes per page)",
                     side, (long long)high_page, buffer_nbytes, page_nbytes);
        return -1;
    }
    return 0;
}

/* pages[p] = slots[p * page_size] / page_size, checking the slots form whole aligned pages below num_pages. */
int slots_to_pages(const int64_t *slots, Py_ssize_t num_slots, Py_ssize_t page_size, Py_ssize_t num_pages,
                          int64_t *pages) {
    if (num_slots % page_size) {
        PyErr_Format(PyExc_ValueError, "%zd slots are not whole pages of %zd", num_slots, page_size);
        return -1;
    }
    for (Py_ssize_t p = 0; p < num_slots / page_size; p++) {
        int64_t first = slots[p * page_size];
        int aligned = first % page_size == 0;
        for (Py_ssize_t i = 1; i < page_size && aligned; i++) aligned = slots[p * page_size + i] == first + i;
        if (!aligned) {
            PyErr_SetString(PyExc_ValueError, "slots are not whole aligned pages");
            return -1;
        }
        if (first < 0 || first / page_size >= num_pages) {
            PyErr_Format(PyExc_ValueError, "slot out of range [0, %zd)", num_pages * page_size);
            return -1;
        }
        pages[p] = first / page_size;
    }
    return 0;
}

/* Each new run's first bytes (up to PREFETCH_MAX_NBYTES) are prefetched before the previous run is copied:
 * runs are scattered, so without it each one starts with cache misses on both sides that the hardware
 * prefetcher cannot foresee. Measured with MLA's 1152-byte chunks: the copy takes ~15% less time. Small
 * chunks (up to LOOKAHEAD_MAX_CHUNK_NBYTES: a page of a one-layer pool) are prefetched a few pages ahead
 * instead, since one run ahead leaves too little time: with the replay's 128-byte chunks, 25-45% less
 * time. (Looking ahead with large chunks halved the speed of 32 KiB chunks: kept to small ones.) */
#define LOOKAHEAD_MAX_CHUNK_NBYTES 512
#define LOOKAHEAD_NBYTES 16384  /* in flight, at most LOOKAHEAD_MAX_PAGES pages */
#define LOOKAHEAD_MAX_PAGES 8

static void prefetch_page(const PageCopy *c, Py_ssize_t p, Py_ssize_t o, Py_ssize_t prefetch_nbytes) {
    char *page_dst = c->dst + c->dst_pages[p] * c->dst_page_nbytes;
    const char *page_src = c->src + c->src_pages[p] * c->src_page_nbytes;
    for (Py_ssize_t i = o * c->inner; i < (o + 1) * c->inner; i++) {
        for (Py_ssize_t off = 0; off < prefetch_nbytes; off += 64) {
            PREFETCH(page_dst + c->dst_base[i] + off, 1);
            PREFETCH(page_src + c->src_base[i] + off, 0);
        }
    }
}

/* Chunks in (outer, page, inner) order: the caller picks the order that walks the destination
 * forward. A chunk that continues the previous one on both sides extends it instead of starting
 * a new memcpy. */
void run_page_copy(const PageCopy *c) {
    Py_ssize_t prefetch_nbytes = c->chunk_nbytes < PREFETCH_MAX_NBYTES ? c->chunk_nbytes : PREFETCH_MAX_NBYTES;
    Py_ssize_t ahead = 0;  /* pages to look ahead; 0: prefetch each run's start instead */
    if (c->chunk_nbytes <= LOOKAHEAD_MAX_CHUNK_NBYTES) {
        ahead = LOOKAHEAD_NBYTES / (2 * c->inner * c->chunk_nbytes);
        ahead = ahead < 1 ? 1 : ahead > LOOKAHEAD_MAX_PAGES ? LOOKAHEAD_MAX_PAGES : ahead;
    }
    char *run_dst = NULL;
    const char *run_src = NULL;
    size_t run_nbytes = 0;
    for (Py_ssize_t o = 0; o < c->outer; o++) {
        for (Py_ssize_t p = 0; p < c->num_pages; p++) {
            char *page_dst = c->dst + c->dst_pages[p] * c->dst_page_nbytes;
            const char *page_src = c->src + c->src_pages[p] * c->src_page_nbytes;
            for (Py_ssize_t q = p == 0 ? 0 : p + ahead; ahead && q <= p + ahead && q < c->num_pages; q++) {
                prefetch_page(c, q, o, prefetch_nbytes);
            }
            for (Py_ssize_t i = o * c->inner; i < (o + 1) * c->inner; i++) {
                char *d = page_dst + c->dst_base[i];
                const char *s = page_src + c->src_base[i];
                if (d == run_dst + run_nbytes && s == run_src + run_nbytes) {
                    run_nbytes += (size_t)c->chunk_nbytes;
                    continue;
                }
                for (Py_ssize_t off = 0; !ahead && off < prefetch_nbytes; off += 64) {
                    PREFETCH(d + off, 1);
                    PREFETCH(s + off, 0);
                }
                if (run_nbytes) memmove(run_dst, run_src, run_nbytes);
                run_dst = d;
                run_src = s;
                run_nbytes = (size_t)c->chunk_nbytes;
            }
        }
    }
    if (run_nbytes) memmove(run_dst, run_src, run_nbytes);
}

/* Where the slots or pages come in: page_size > 0 means token slots of whole pages below
 * dst/src_num_pages. */
typedef struct {
    Py_ssize_t page_size, dst_num_pages, src_num_pages;
    int check_only;
} SlotRule;

/* The checks and the copy once every buffer is in ``c`` (pages: c->dst_pages / c->src_pages, c->num_pages
 * entries): slots become pages, every chunk is bounds-checked, then the bytes move without the GIL. */
static int copy_checked(PageCopy *c, Py_ssize_t num_bases, Py_ssize_t dst_nbytes, Py_ssize_t src_nbytes,
                        const SlotRule *rule) {
    int64_t *slot_pages = NULL;
    int status = -1;
    Py_ssize_t page_size = rule->page_size;
    if (page_size > 0) {
        slot_pages = PyMem_Malloc(2 * (c->num_pages / page_size + 1) * sizeof(int64_t));
        if (slot_pages == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        if (slots_to_pages(c->dst_pages, c->num_pages, page_size, rule->dst_num_pages, slot_pages) < 0) goto done;
        if (slots_to_pages(c->src_pages, c->num_pages, page_size, rule->src_num_pages,
                           slot_pages + c->num_pages / page_size + 1) < 0) goto done;
        c->dst_pages = slot_pages;
        c->src_pages = slot_pages + c->num_pages / page_size + 1;
        c->num_pages /= page_size;
    }
    status = 0;
    if (c->num_pages == 0 || num_bases == 0 || rule->check_only) goto done;
    status = -1;
    if (check_side("destination", c->dst_base, num_bases, c->dst_pages, c->num_pages, c->dst_page_nbytes,
                   c->chunk_nbytes, dst_nbytes) < 0) goto done;
    if (check_side("source", c->src_base, num_bases, c->src_pages, c->num_pages, c->src_page_nbytes,
                   c->chunk_nbytes, src_nbytes) < 0) goto done;
    int hash_failed = 0;
    Py_BEGIN_ALLOW_THREADS
    if (c->digests != NULL) hash_failed = run_hashed_page_copy(c) < 0;
    else run_page_copy(c);
    Py_END_ALLOW_THREADS
    if (hash_failed) PyErr_NoMemory();
    else status = 0;
done:
    PyMem_Free(slot_pages);
    return status;
}

static int check_sizes(const PageCopy *c, Py_ssize_t page_size) {
    if (c->chunk_nbytes <= 0 || c->inner <= 0 || c->dst_page_nbytes <= 0 || c->src_page_nbytes <= 0 || page_size < 0) {
        PyErr_Format(PyExc_ValueError, "sizes must be positive: chunk %zd, inner %zd, pages %zd/%zd bytes",
                     c->chunk_nbytes, c->inner, c->dst_page_nbytes, c->src_page_nbytes);
        return -1;
    }
    return 0;
}

static int check_chunk_maps(const Py_buffer *dst_base, const Py_buffer *src_base, Py_ssize_t inner) {
    Py_ssize_t num_bases = dst_base->len / 8;
    if (src_base->len / 8 != num_bases || num_bases % inner != 0) {
        PyErr_Format(PyExc_ValueError, "mismatched chunk maps: %zd and %zd bases (inner %zd)", num_bases,
                     src_base->len / 8, inner);
        return -1;
    }
    return 0;
}

static PyObject *copy_pages(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *dst_obj, *src_obj, *dst_base_obj, *src_base_obj, *dst_pages_obj, *src_pages_obj;
    PageCopy c = {0};
    SlotRule rule = {0, 0, 0, 0};  /* page_size > 0: slots are given */
    if (!PyArg_ParseTuple(args, "OOOOOOnnnn|nnnp:copy_pages", &dst_obj, &src_obj, &dst_base_obj, &src_base_obj,
                          &dst_pages_obj, &src_pages_obj, &c.dst_page_nbytes, &c.src_page_nbytes, &c.inner,
                          &c.chunk_nbytes, &rule.page_size, &rule.dst_num_pages, &rule.src_num_pages,
                          &rule.check_only)) {
        return NULL;
    }
    if (check_sizes(&c, rule.page_size) < 0) return NULL;
    Py_buffer dst = {0}, src = {0}, dst_base = {0}, src_base = {0}, dst_pages = {0}, src_pages = {0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (get_int64s(dst_base_obj, &dst_base, "dst_base") < 0) goto done;
    if (get_int64s(src_base_obj, &src_base, "src_base") < 0) goto done;
    if (get_int64s(dst_pages_obj, &dst_pages, "dst_pages") < 0) goto done;
    if (get_int64s(src_pages_obj, &src_pages, "src_pages") < 0) goto done;
    if (check_chunk_maps(&dst_base, &src_base, c.inner) < 0) goto done;
    c.num_pages = dst_pages.len / 8;
    if (src_pages.len / 8 != c.num_pages) {
        PyErr_Format(PyExc_ValueError, "mismatched page lists: %zd and %zd pages", c.num_pages, src_pages.len / 8);
        goto done;
    }
    c.dst = dst.buf;
    c.src = src.buf;
    c.dst_base = dst_base.buf;
    c.src_base = src_base.buf;
    c.dst_pages = dst_pages.buf;
    c.src_pages = src_pages.buf;
    c.outer = dst_base.len / 8 / c.inner;
    if (copy_checked(&c, dst_base.len / 8, dst.len, src.len, &rule) == 0) result = Py_None;
done:
    Py_XINCREF(result);
    if (dst.obj) PyBuffer_Release(&dst);
    if (src.obj) PyBuffer_Release(&src);
    if (dst_base.obj) PyBuffer_Release(&dst_base);
    if (src_base.obj) PyBuffer_Release(&src_base);
    if (dst_pages.obj) PyBuffer_Release(&dst_pages);
    if (src_pages.obj) PyBuffer_Release(&src_pages);
    return result;
}

/* SlotCopier: copy_pages' buffers, chunk maps, sizes and slot rule held for the copier's life. */
typedef struct {
    PyObject_HEAD
    Py_buffer dst, src, dst_base, src_base;
    Py_buffer digests, digest_valid;  /* the destination's digest table (uint64, uint8 per page), or none */
    int pages_in_order;  /* the destination's pages are written whole, in order: a copy can hash them */
    PageCopy layout;  /* everything but the page lists (and digests: set per hashed copy) */
    Py_ssize_t page_size, dst_num_pages, src_num_pages;
    PyObject *name;  /* of the copy, for errors */
} SlotCopier;

static PyObject *str_numpy;  /* "numpy", interned once */

static void slot_copier_dealloc(SlotCopier *self) {
    if (self->dst.obj) PyBuffer_Release(&self->dst);
    if (self->src.obj) PyBuffer_Release(&self->src);
    if (self->dst_base.obj) PyBuffer_Release(&self->dst_base);
    if (self->src_base.obj) PyBuffer_Release(&self->src_base);
    if (self->digests.obj) PyBuffer_Release(&self->digests);
    if (self->digest_valid.obj) PyBuffer_Release(&self->digest_valid);
    Py_XDECREF(self->name);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The destination's digest table: a writable uint64 and a writable 1-byte array, one entry per page. */
static int get_digest_table(SlotCopier *self, PyObject *digests, PyObject *digest_valid) {
    if (PyObject_GetBuffer(digests, &self->digests, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (PyObject_GetBuffer(digest_valid, &self->digest_valid, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    const char *f = self->digests.format;
    if (self->digests.itemsize != 8 || f == NULL || strchr("QLk", f[0]) == NULL || f[1] != '\0'
        || self->digests.len / 8 != self->dst_num_pages || self->digest_valid.itemsize != 1
        || self->digest_valid.len != self->dst_num_pages) {
        PyErr_Format(PyExc_ValueError, "digest table: %zd uint64 digests and %zd flags for %zd pages",
                     self->digests.len / 8, self->digest_valid.len, self->dst_num_pages);
        return -1;
    }
    return 0;
}

static int slot_copier_init(SlotCopier *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"dst", "src", "dst_base", "src_base", "dst_page_nbytes", "src_page_nbytes", "inner",
                               "chunk_nbytes", "page_size", "dst_num_pages", "src_num_pages", "name", "digests",
                               "digest_valid", NULL};
    PyObject *dst_obj, *src_obj, *dst_base_obj, *src_base_obj, *name, *digests = Py_None, *digest_valid = Py_None;
    PageCopy *c = &self->layout;
    if (self->dst.obj != NULL) {
        PyErr_SetString(PyExc_TypeError, "SlotCopier is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOnnnnnnnU|OO:SlotCopier", keywords, &dst_obj, &src_obj,
                                     &dst_base_obj, &src_base_obj, &c->dst_page_nbytes, &c->src_page_nbytes,
                                     &c->inner, &c->chunk_nbytes, &self->page_size, &self->dst_num_pages,
                                     &self->src_num_pages, &name, &digests, &digest_valid)) {
        return -1;
    }
    if (check_sizes(c, self->page_size) < 0) return -1;
    if (self->page_size == 0) {
        PyErr_SetString(PyExc_ValueError, "page_size must be positive: a SlotCopier takes token slots");
        return -1;
    }
    if (PyObject_GetBuffer(dst_obj, &self->dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (PyObject_GetBuffer(src_obj, &self->src, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (get_int64s(dst_base_obj, &self->dst_base, "dst_base") < 0) return -1;
    if (get_int64s(src_base_obj, &self->src_base, "src_base") < 0) return -1;
    if (check_chunk_maps(&self->dst_base, &self->src_base, c->inner) < 0) return -1;
    c->dst = self->dst.buf;
    c->src = self->src.buf;
    c->dst_base = self->dst_base.buf;
    c->src_base = self->src_base.buf;
    c->outer = self->dst_base.len / 8 / c->inner;
    self->pages_in_order = pages_written_in_order(c);
    if ((digests == Py_None) != (digest_valid == Py_None)) {
        PyErr_SetString(PyExc_TypeError, "digests and digest_valid go together");
        return -1;
    }
    if (digests != Py_None && get_digest_table(self, digests, digest_valid) < 0) return -1;
    Py_INCREF(name);
    self->name = name;
    return 0;
}

/* 0 when this copier can hash its destination pages (a digest table, pages written in order, xxh3 bound);
 * else -1 with the reason set. */
static int hash_ready(const SlotCopier *self) {
    if (self->digests.obj == NULL || !self->pages_in_order) {
        PyErr_Format(PyExc_ValueError, "%U: cannot hash the destination pages (%s)", self->name,
                     self->digests.obj == NULL ? "no digest table" : "a page is not written whole and in order");
        return -1;
    }
    return xxh3_bound() ? 0 : -1;
}

/* The allocator hands out CPU int64 torch tensors: read in place (~0.2 us) instead of through a numpy view
 * (~0.5 us each, two per copy: half of a one-page copy's call). 1: ``view`` describes the tensor's memory and
 * holds no reference (the caller's argument keeps the tensor alive for the call); 0: not such a tensor
 * (whatever went wrong, its numpy view then reports). */
static PyObject *torch_int64;

static int tensor_slots(PyObject *obj, Py_buffer *view) {
    if (torch_int64 == NULL) {  /* a tensor came in: torch is imported */
        PyObject *torch = PyImport_ImportModule("torch");
        torch_int64 = torch == NULL ? NULL : PyObject_GetAttrString(torch, "int64");
        Py_XDECREF(torch);
    }
    const int64_t *data = NULL;
    Py_ssize_t num = 0;
    if (torch_int64 == NULL || tierkv_tensor_memory(obj, torch_int64, &data, &num) != 1) {
        PyErr_Clear();
        return 0;
    }
    memset(view, 0, sizeof(*view));
    view->buf = (void *)data;
    view->len = num * 8;
    view->itemsize = 8;
    view->readonly = 1;
    return 1;
}

/* A slot array's buffer: the object's own, else a CPU int64 tensor's memory, else its numpy view's. */
int get_slots(PyObject *obj, Py_buffer *view, PyObject **holder, const char *name) {
    if (!PyObject_CheckBuffer(obj)) {
        if (tensor_slots(obj, view)) return 0;
        *holder = PyObject_CallMethodObjArgs(obj, str_numpy, NULL);
        if (*holder == NULL) return -1;
        obj = *holder;
    }
    return get_int64s(obj, view, name);
}

static PyObject *slot_copier_copy_slots(SlotCopier *self, PyObject *const *args, Py_ssize_t nargs) {
    if (self->dst.obj == NULL) {
        PyErr_SetString(PyExc_TypeError, "SlotCopier is not initialised");
        return NULL;
    }
    if (nargs < 2 || nargs > 4) {
        PyErr_Format(PyExc_TypeError, "copy_slots(src_slots, dst_slots, check_only=False, hash=False): %zd arguments",
                     nargs);
        return NULL;
    }
    SlotRule rule = {self->page_size, self->dst_num_pages, self->src_num_pages, 0};
    if (nargs >= 3 && (rule.check_only = PyObject_IsTrue(args[2])) < 0) return NULL;
    int hash = nargs == 4 ? PyObject_IsTrue(args[3]) : 0;
    if (hash < 0 || (hash && hash_ready(self) < 0)) return NULL;
    Py_buffer src_slots = {0}, dst_slots = {0};
    PyObject *src_holder = NULL, *dst_holder = NULL, *result = NULL;
    PageCopy c = self->layout;
    if (get_slots(args[0], &src_slots, &src_holder, "src_slots") < 0) goto done;
    if (get_slots(args[1], &dst_slots, &dst_holder, "dst_slots") < 0) goto done;
    if (src_slots.len != dst_slots.len) {
        PyErr_Format(PyExc_ValueError, "%U: %zd source slots vs %zd destination slots", self->name, src_slots.len / 8,
                     dst_slots.len / 8);
        goto done;
    }
    c.num_pages = dst_slots.len / 8;
    c.dst_pages = dst_slots.buf;
    c.src_pages = src_slots.buf;
    if (hash) {
        c.digests = self->digests.buf;
        c.digest_valid = self->digest_valid.buf;
    }
    if (copy_checked(&c, self->dst_base.len / 8, self->dst.len, self->src.len, &rule) == 0) result = Py_None;
done:
    Py_XINCREF(result);
    if (src_slots.obj) PyBuffer_Release(&src_slots);
    if (dst_slots.obj) PyBuffer_Release(&dst_slots);
    Py_XDECREF(src_holder);
    Py_XDECREF(dst_holder);
    return result;
}

static PyObject *slot_copier_hashes_pages(SlotCopier *self, PyObject *unused) {
    (void)unused;
    return PyBool_FromLong(self->digests.obj != NULL && self->pages_in_order);
}

static PyMethodDef slot_copier_methods[] = {
    {"copy_slots", (PyCFunction)(void (*)(void))slot_copier_copy_slots, METH_FASTCALL,
     "copy_slots(src_slots, dst_slots, check_only=False, hash=False): copy_pages with the held buffers, given token "
     "slots (int64 arrays, or CPU torch tensors: their numpy views); check_only: check, copy nothing; hash: record "
     "each destination page's xxh3-64 in the digest table as it is written (flag cleared first, set after)"},
    {"hashes_pages", (PyCFunction)slot_copier_hashes_pages, METH_NOARGS,
     "hashes_pages() -> whether copy_slots can hash: a digest table is held and each destination page is "
     "written whole and in address order"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SlotCopierType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tierkv.copy._rowcopy.SlotCopier",
    .tp_basicsize = sizeof(SlotCopier),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "SlotCopier(dst, src, dst_base, src_base, dst_page_nbytes, src_page_nbytes, inner, chunk_nbytes, "
              "page_size, dst_num_pages, src_num_pages, name): copy_pages' arguments but the page lists, held",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)slot_copier_init,
    .tp_dealloc = (destructor)slot_copier_dealloc,
    .tp_methods = slot_copier_methods,
};

static PyMethodDef methods[] = {

    {"copy_pages", copy_pages, METH_VARARGS,
     "copy_pages(dst, src, dst_base, src_base, dst_pages, src_pages, dst_page_nbytes, src_page_nbytes, inner, "
     "chunk_nbytes): for o, p, i: dst[dst_base[o*inner+i] + dst_pages[p]*dst_page_nbytes :+chunk_nbytes] = "
     "src[src_base[o*inner+i] + src_pages[p]*src_page_nbytes :+chunk_nbytes]. With page_size, dst_num_pages, "
     "src_num_pages: the page arrays are token slots of whole pages, checked like the slot allocator does; "
     "check_only: check, copy nothing"},
    {"free_slots", (PyCFunction)(void (*)(void))free_slots, METH_FASTCALL,
     "free_slots(slots, page_size, is_free, out_pages): the pages of whole aligned slot pages, each allocated "
     "(is_free[p] == 0) and given once, marked free and written to out_pages; else ValueError, nothing changed"},
    {"check_allocated", (PyCFunction)(void (*)(void))check_allocated, METH_FASTCALL,
     "check_allocated(slots, page_size, is_free): ValueError unless the slots are whole aligned pages below "
     "len(is_free), each allocated and given once"},
    {"use_xxh3", use_xxh3, METH_O,
     "use_xxh3(capsule): hash with the xxh3-64 functions of tierkv._pageio (its xxh3_functions capsule, bound)"},
    {"pages_to_slots", pages_to_slots, METH_VARARGS,
     "pages_to_slots(pages, page_size, out): out[p * page_size + i] = pages[p] * page_size + i"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowcopy", NULL, -1, methods};

/* Bumped whenever a function's arguments change: tierkv/copy/cpu_copy.py ignores a build of another version
 * (say, one an editable install of another checkout left on the path) instead of calling it wrongly.
 * 3: SlotCopier. 4: the slot allocator's free_slots, check_allocated, pages_to_slots. 5: copy_slots(..., hash),
 * SlotCopier's digest table and hashes_pages, use_xxh3. */
#define API_VERSION 5

PyMODINIT_FUNC PyInit__rowcopy(void) {
    if (PyType_Ready(&SlotCopierType) < 0) return NULL;
    str_numpy = PyUnicode_InternFromString("numpy");
    if (str_numpy == NULL) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&SlotCopierType);
    if (PyModule_AddObject(m, "SlotCopier", (PyObject *)&SlotCopierType) < 0
        || PyModule_AddIntConstant(m, "API_VERSION", API_VERSION) < 0) {
        Py_DECREF(&SlotCopierType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
