/* What tierkv/copy/_rowcopy.c shares with _rowcopy_hash.c (the copy that hashes each destination page) and
 * _rowcopy_alloc.c (the slot allocator's checks). */
#ifndef TIERKV_ROWCOPY_H
#define TIERKV_ROWCOPY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* Shared between this module's objects only: kept out of the .so's exported symbols. */
#if defined(__GNUC__) || defined(__clang__)
#define ROWCOPY_INTERNAL __attribute__((visibility("hidden")))
#else
#define ROWCOPY_INTERNAL
#endif

/* A run's first bytes fetched ahead of its copy, at most this many (see _rowcopy.c's run_page_copy). */
#define PREFETCH_MAX_NBYTES 2048
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(address, for_write) __builtin_prefetch((address), (for_write))
#else
#define PREFETCH(address, for_write) ((void)0)
#endif

/* One copy: chunk i of page p sits at base[i] + pages[p] * page_nbytes on each side, chunks walked in
 * (outer, page, inner) order. ``digests`` / ``digest_valid``: NULL, or per destination page the xxh3-64 of
 * its bytes and a flag, both written by a hashed copy (run_hashed_page_copy). */
typedef struct {
    char *dst;
    const char *src;
    const int64_t *dst_base, *src_base, *dst_pages, *src_pages;
    Py_ssize_t num_pages, outer, inner, dst_page_nbytes, src_page_nbytes, chunk_nbytes;
    uint64_t *digests;
    unsigned char *digest_valid;
} PageCopy;

/* The plain copy (_rowcopy.c): chunks in (outer, page, inner) order, adjacent ones merged, runs prefetched. */
ROWCOPY_INTERNAL void run_page_copy(const PageCopy *c);

/* 1 when each destination page is written whole and in address order by one pass over its chunks (outer
 * 1, chunks back to back from the page's start and filling it): the bytes a hashed copy can digest. */
ROWCOPY_INTERNAL int pages_written_in_order(const PageCopy *c);

/* The copy, each destination page hashed as it is written (see _rowcopy_hash.c); runs without the GIL.
 * -1 when the xxh3 state could not be allocated (nothing hashed, nothing recorded). */
ROWCOPY_INTERNAL int run_hashed_page_copy(const PageCopy *c);

/* 1 once use_xxh3 has bound the xxh3 functions; else 0 with RuntimeError set. */
ROWCOPY_INTERNAL int xxh3_bound(void);

/* use_xxh3(capsule): bind the xxh3-64 functions tierkv._pageio took from the xxhash package. */
ROWCOPY_INTERNAL PyObject *use_xxh3(PyObject *self, PyObject *capsule);

/* Shared helpers of _rowcopy.c (see there). */
ROWCOPY_INTERNAL int get_int64s(PyObject *obj, Py_buffer *view, const char *name);
ROWCOPY_INTERNAL int slots_to_pages(const int64_t *slots, Py_ssize_t num_slots, Py_ssize_t page_size,
                                    Py_ssize_t num_pages, int64_t *pages);
ROWCOPY_INTERNAL int get_slots(PyObject *obj, Py_buffer *view, PyObject **holder, const char *name);

/* The slot allocator's bookkeeping (_rowcopy_alloc.c). */
ROWCOPY_INTERNAL PyObject *free_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
ROWCOPY_INTERNAL PyObject *check_allocated(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
ROWCOPY_INTERNAL PyObject *pages_to_slots(PyObject *self, PyObject *args);

#endif
