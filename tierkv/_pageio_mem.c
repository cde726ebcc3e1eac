/* Blobs read straight out of memory the process already maps (a Mooncake replica in this client's own
 * mounted segment, a Redis reply): each payload copied into its page and hashed in the same pass. The
 * transfer engine's own copy cannot carry the hash, so a get through it costs its copy plus a second pass
 * over memory for the checksum; this costs one copy.
 *
 * Source addresses, when given as such, are trusted (the store's replica descriptors give them); buffers
 * and destinations are checked. A header is compared whole with its template holding the checksum (magic,
 * version, namespace, length, key digest and checksum in one memcmp); explaining a mismatch is the caller's.
 */
#include "_pageio.h"

#include <errno.h>
#include <string.h>
#include <unistd.h>

/* A payload over 240 bytes is copied and hashed from the same registers (copy_xxh3_long, _xxh3_copy.c):
 * 17.6-19.5 GB/s on 128 MiB of 128 KiB pages, a plain memcpy 18.5-19.9 (2-core EPYC). Shorter ones, and
 * where that is not built, chunk by chunk: each chunk copied into its page, then hashed there while it
 * is still in the core's L2 cache (13.7-15.4 GB/s). Either way the checksum is of exactly the bytes
 * stored (a source that changed meanwhile, a replica removed and its memory reused, is a mismatch, never a
 * page that passes with other bytes), and the page is memory only this caller writes. 64 KiB: small
 * enough to stay in L2 between the copy and the hash, large enough that memcpy runs at full speed. */
#define COPY_CHUNK_NBYTES (64 << 10)

static uint64_t copy_hashed(char *dst, const char *src, Py_ssize_t nbytes, void *state) {
    if (nbytes > XXH3_COPY_MIN_NBYTES) return copy_xxh3_long(dst, src, (size_t)nbytes);
    xxh3.reset(state);
    for (Py_ssize_t off = 0; off < nbytes; off += COPY_CHUNK_NBYTES) {
        size_t len = (size_t)(nbytes - off < COPY_CHUNK_NBYTES ? nbytes - off : COPY_CHUNK_NBYTES);
        memcpy(dst + off, src + off, len);
        xxh3.update(state, dst + off, len);
    }
    return xxh3.digest(state);
}

/* The blobs' first bytes: an int64 array of addresses (memory the caller vouches for), or a list of
 * buffers of one blob each (then ``held`` keeps them acquired until the copy is done). */
static const char **get_sources(PyObject *obj, Py_ssize_t count, Py_ssize_t blob_nbytes, Buffers *held) {
    const char **sources = PyMem_Calloc(count ? count : 1, sizeof(char *));
    if (sources == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    if (PyList_Check(obj)) {
        if (get_buffers(obj, PyBUF_SIMPLE, count, "sources", held) < 0) goto fail;
        for (Py_ssize_t i = 0; i < count; i++) {
            if (held->views[i].len != blob_nbytes) {
                PyErr_Format(PyExc_ValueError, "source %zd has %zd bytes, expected %zd", i, held->views[i].len,
                             blob_nbytes);
                goto fail;
            }
            sources[i] = held->views[i].buf;
        }
        return sources;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_RECORDS_RO) < 0) goto fail;
    int ok = view.itemsize == 8 && view.format != NULL && strchr("ql", view.format[0]) != NULL
             && view.format[1] == '\0' && PyBuffer_IsContiguous(&view, 'C') && view.len == count * 8;
    for (Py_ssize_t i = 0; ok && i < count; i++) sources[i] = (const char *)(intptr_t)((const int64_t *)view.buf)[i];
    PyBuffer_Release(&view);
    if (ok) return sources;
    PyErr_Format(PyExc_ValueError, "sources must be a list of %zd buffers or an int64 array of %zd addresses", count,
                 count);
fail:
    PyMem_Free(sources);
    return NULL;
}

PyObject *copy_blobs_xxh3(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *sources_obj, *payloads_obj, *headers_obj, *expected_obj;
    Py_ssize_t payload_nbytes, checksum_offset;
    if (!PyArg_ParseTuple(args, "OOOOnn:copy_blobs_xxh3", &sources_obj, &payloads_obj, &headers_obj,
                          &expected_obj, &payload_nbytes, &checksum_offset) || require_xxh3() < 0) return NULL;
    if (payload_nbytes < 0 || checksum_offset < 0 || checksum_offset > HEADER_NBYTES - 8) {
        return PyErr_Format(PyExc_ValueError, "payload_nbytes %zd or checksum_offset %zd out of range", payload_nbytes,
                            checksum_offset);
    }
    Buffers payloads;
    if (get_buffers(payloads_obj, PyBUF_WRITABLE, -1, "payloads", &payloads) < 0) return NULL;
    Py_ssize_t n = payloads.count;
    Buffers held = {NULL, 0};
    Py_buffer headers = {0}, expected = {0};
    PyObject *out = NULL;
    PageResult *results = NULL;
    void *state = NULL;
    const char **src = get_sources(sources_obj, n, payload_nbytes + HEADER_NBYTES, &held);
    if (src == NULL) goto done;
    if (PyObject_GetBuffer(headers_obj, &headers, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (PyObject_GetBuffer(expected_obj, &expected, PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (headers.len != n * HEADER_NBYTES || expected.len != n * HEADER_NBYTES) {
        PyErr_Format(PyExc_ValueError, "header buffers must hold %zd bytes (48 per page)", n * HEADER_NBYTES);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (payloads.views[i].len != payload_nbytes) {
            PyErr_Format(PyExc_ValueError, "payload %zd has %zd bytes, expected %zd", i, payloads.views[i].len,
                         payload_nbytes);
            goto done;
        }
    }
    results = PyMem_Calloc(n ? n : 1, sizeof(PageResult));
    if (results == NULL || (state = xxh3.create()) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *blob = src[i];
        unsigned char *header = (unsigned char *)headers.buf + i * HEADER_NBYTES;
        unsigned char want[HEADER_NBYTES];
        uint64_t digest = copy_hashed(payloads.views[i].buf, blob, payload_nbytes, state);
        memcpy(header, blob + payload_nbytes, HEADER_NBYTES);
        memcpy(want, (const char *)expected.buf + i * HEADER_NBYTES, HEADER_NBYTES);
        put_le64(want + checksum_offset, digest);
        results[i].status = memcmp(want, header, HEADER_NBYTES) == 0 ? READ_OK : READ_MISMATCH;
        results[i].value = (int64_t)digest;
    }
    Py_END_ALLOW_THREADS
    out = results_list(results, n);
done:
    if (state != NULL) xxh3.free_state(state);
    PyMem_Free(results);
    PyMem_Free(src);
    release_buffers(&held);
    if (headers.obj) PyBuffer_Release(&headers);
    if (expected.obj) PyBuffer_Release(&expected);
    release_buffers(&payloads);
    return out;
}

/* ``n`` bytes of ``fd`` at ``offset`` into ``buf``: fewer only at the file's end; -1 with errno on error. */
static ssize_t pread_full(int fd, char *buf, size_t n, off_t offset) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, buf + got, n - got, offset + (off_t)got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -1;
        if (r == 0) break;
        got += (size_t)r;
    }
    return (ssize_t)got;
}

/* A bounce buffer this large stays in the core's L2 between the kernel's copy into it and ours out of it. */
#define READ_BOUNCE_NBYTES (256 << 10)

/* read_xxh3(fd, page, offset) -> the XXH3-64 of the page's bytes, or None where the file ends before the page
 * does: ``fd``'s bytes from ``offset`` read a bounce buffer at a time, each copied into the page by the
 * one-pass copy (_xxh3_copy.c). Where reading straight into the page then hashing it had the kernel's copy
 * fetch each destination line before writing it and the hash read the page again, this writes the page
 * with streamed stores and hashes from registers. Without the GIL. */
PyObject *read_xxh3(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    long long offset;
    PyObject *page_obj;
    if (!PyArg_ParseTuple(args, "iOL:read_xxh3", &fd, &page_obj, &offset)) return NULL;
    Py_buffer page;
    if (PyObject_GetBuffer(page_obj, &page, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (page.len <= XXH3_COPY_MIN_NBYTES || offset < 0) {
        PyBuffer_Release(&page);
        return PyErr_Format(PyExc_ValueError, "read_xxh3 takes a page over %d bytes (got %zd) at an offset >= 0 "
                            "(got %lld)", XXH3_COPY_MIN_NBYTES, page.len, offset);
    }
    char *bounce = PyMem_RawMalloc(READ_BOUNCE_NBYTES);
    if (bounce == NULL) {
        PyBuffer_Release(&page);
        return PyErr_NoMemory();
    }
    size_t n = (size_t)page.len, pos = 0;
    int error = 0, ended = 0;
    Xxh3Copy state;
    xxh3_copy_start(&state, n);
    Py_BEGIN_ALLOW_THREADS
    while (pos < n) {
        size_t want = n - pos < READ_BOUNCE_NBYTES ? n - pos : READ_BOUNCE_NBYTES;
        ssize_t got = pread_full(fd, bounce, want, (off_t)(offset + (long long)pos));
        if (got < 0) error = errno;
        if (got < 0 || (size_t)got < want) {
            ended = got >= 0;
            break;
        }
        size_t whole = want & ~(size_t)63; /* only the page's last piece can end inside a stripe */
        xxh3_copy_part(&state, (char *)page.buf + pos, bounce, whole);
        memcpy((char *)page.buf + pos + whole, bounce + whole, want - whole);
        pos += want;
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(bounce);
    PyObject *out = NULL;
    if (error) {
        errno = error;
        PyErr_SetFromErrno(PyExc_OSError);
    } else if (ended) {
        out = Py_NewRef(Py_None);
    } else {
        out = PyLong_FromUnsignedLongLong(xxh3_copy_finish(&state, page.buf, n));
    }
    PyBuffer_Release(&page);
    return out;
}
