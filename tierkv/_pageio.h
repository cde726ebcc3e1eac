/* What tierkv/_pageio.c shares with the other parts of the _pageio module (_pageio_mem.c). */
#ifndef TIERKV_PAGEIO_H
#define TIERKV_PAGEIO_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define HEADER_NBYTES 48

/* Shared between this module's objects only: kept out of the .so's exported symbols. */
#if defined(__GNUC__) || defined(__clang__)
#define PAGEIO_INTERNAL __attribute__((visibility("hidden")))
#else
#define PAGEIO_INTERNAL
#endif

/* Copy results (the first item of each (status, checksum) pair). */
enum { READ_OK = 0, READ_MISMATCH = 3 };

typedef uint64_t (*xxh3_fn)(const void *, size_t);
typedef void *(*create_fn)(void);
typedef int (*reset_fn)(void *);
typedef int (*update_fn)(void *, const void *, size_t);
typedef uint64_t (*digest_fn)(const void *);
typedef int (*free_fn)(void *);
typedef struct {
    uint64_t low64;
    uint64_t high64;
} Xxh128Hash; /* XXH128_hash_t's layout */
typedef Xxh128Hash (*xxh128_fn)(const void *, size_t);

/* xxh3-64 as the xxhash package's shared object has it (bind_xxh3 fills this). */
typedef struct {
    xxh3_fn oneshot;
    create_fn create;
    reset_fn reset;
    update_fn update;
    digest_fn digest;
    free_fn free_state;
    xxh128_fn oneshot128; /* xxh3-128: chained page hashes (chain_xxh3_128) */
} Xxh3Functions;

PAGEIO_INTERNAL extern Xxh3Functions xxh3;
PAGEIO_INTERNAL int require_xxh3(void);

/* Copy ``n`` bytes (n > XXH3_COPY_MIN_NBYTES) and return the XXH3-64 of the bytes stored, in one pass
 * (tierkv/_xxh3_copy.c); shorter copies are the caller's (memcpy, then xxh3.oneshot). */
#define XXH3_COPY_MIN_NBYTES 240
PAGEIO_INTERNAL uint64_t copy_xxh3_long(void *dst, const void *src, size_t n);

/* The same for a page copied in parts, each a multiple of 64 bytes, back to back from the page's start:
 * start(n), part... (the whole page, its tail copied by part too when n is a multiple of 64, else by
 * the caller), finish (reads the page's last 64 bytes). */
typedef struct {
    uint64_t acc[8];
    size_t regular, done; /* the page's stripes accumulated in order, and how many so far */
} Xxh3Copy;
PAGEIO_INTERNAL void xxh3_copy_start(Xxh3Copy *state, size_t n);
PAGEIO_INTERNAL void xxh3_copy_part(Xxh3Copy *state, void *dst, const void *src, size_t nbytes);
PAGEIO_INTERNAL uint64_t xxh3_copy_finish(Xxh3Copy *state, const void *page, size_t n);

/* Buffers of a sequence, all acquired or none (then an exception is set). */
typedef struct {
    Py_buffer *views;
    Py_ssize_t count;
} Buffers;

PAGEIO_INTERNAL int get_buffers(PyObject *seq, int flags, Py_ssize_t expect_len, const char *name, Buffers *b);
PAGEIO_INTERNAL void release_buffers(Buffers *b);

typedef struct {
    int status;
    int64_t value;
} PageResult;

PAGEIO_INTERNAL PyObject *results_list(const PageResult *results, Py_ssize_t n);
PAGEIO_INTERNAL void put_le64(unsigned char *p, uint64_t v);

PAGEIO_INTERNAL PyObject *copy_blobs_xxh3(PyObject *self, PyObject *args);
PAGEIO_INTERNAL PyObject *read_xxh3(PyObject *self, PyObject *args);

#endif
