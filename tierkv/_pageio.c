/* Native page I/O for the L3 stores: batched checksums, and copies that checksum as they go.
 *
 * Why: per page, a hasher object and a header check from Python cost microseconds; here a whole batch is
 * one call that runs without the GIL (the scheduler and the store's workers keep running), and each page
 * is hashed chunk by chunk right as it is copied, while the chunk is in the core's cache. The file store
 * reads and writes whole pack files from Python (one preadv/pwritev a group) and checksums them here with
 * xxh3_many; the Redis and Mooncake stores copy replies into their pages with copy_blobs_xxh3
 * (_pageio_mem.c).
 *
 * The checksum is xxh3-64, the one tierkv.storage.page_format computes with the xxhash package: this
 * module takes the functions from that package's own shared object (bind_xxh3, given its path), so the
 * two can never disagree; the caller checks a known digest before using it.
 *
 * Headers are passed as templates: the 48 bytes a page's header must hold, with the checksum field
 * (at checksum_offset) left to fill. A copy fills it with the checksum of what it copied and compares the
 * whole stored header with it (one memcmp checks magic, version, namespace, length, key digest and
 * checksum). Anything else is the caller's to explain.
 */
#include "_pageio.h"

#include <dlfcn.h>
#include <stdint.h>

Xxh3Functions xxh3;
/* xxh64 of a page's key, for its header's key digest (optional: without it, key_digests raises and the
 * caller hashes the keys in Python) */
typedef uint64_t (*xxh64_fn)(const void *, size_t, uint64_t);
static xxh64_fn xxh64_oneshot;

static PyObject *bind_xxh3(PyObject *self, PyObject *args) {
    (void)self;
    const char *path;
    if (!PyArg_ParseTuple(args, "s:bind_xxh3", &path)) return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) Py_RETURN_FALSE;
    /* The _dispatch variants (xxHash's x86 dispatcher, in the package since 3.x) pick AVX2 or AVX-512 at run
     * time: 2x the plain SSE2 functions on a cached chunk here (38 against 21 GB/s), the same digests. */
    xxh3.oneshot = (xxh3_fn)dlsym(lib, "XXH3_64bits_dispatch");
    if (xxh3.oneshot == NULL) xxh3.oneshot = (xxh3_fn)dlsym(lib, "XXH3_64bits");
    xxh3.create = (create_fn)dlsym(lib, "XXH3_createState");
    xxh3.reset = (reset_fn)dlsym(lib, "XXH3_64bits_reset");
    xxh3.update = (update_fn)dlsym(lib, "XXH3_64bits_update_dispatch");
    if (xxh3.update == NULL) xxh3.update = (update_fn)dlsym(lib, "XXH3_64bits_update");
    xxh3.digest = (digest_fn)dlsym(lib, "XXH3_64bits_digest");
    xxh3.free_state = (free_fn)dlsym(lib, "XXH3_freeState");
    xxh3.oneshot128 = (xxh128_fn)dlsym(lib, "XXH3_128bits_dispatch");
    if (xxh3.oneshot128 == NULL) xxh3.oneshot128 = (xxh128_fn)dlsym(lib, "XXH3_128bits");
    xxh64_oneshot = (xxh64_fn)dlsym(lib, "XXH64");
    if (!xxh3.oneshot || !xxh3.create || !xxh3.reset || !xxh3.update || !xxh3.digest || !xxh3.free_state ||
        !xxh3.oneshot128) {
        memset(&xxh3, 0, sizeof(xxh3));
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;  /* the handle stays open: the functions are used for the life of the process */
}

int require_xxh3(void) {
    if (xxh3.oneshot == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "xxh3 is not bound (call bind_xxh3 first)");
        return -1;
    }
    return 0;
}

void release_buffers(Buffers *b) {
    for (Py_ssize_t i = 0; i < b->count; i++) PyBuffer_Release(&b->views[i]);
    PyMem_Free(b->views);
    b->views = NULL;
    b->count = 0;
}

int get_buffers(PyObject *seq, int flags, Py_ssize_t expect_len, const char *name, Buffers *b) {
    b->views = NULL;
    b->count = 0;
    PyObject *fast = PySequence_Fast(seq, name);
    if (fast == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (expect_len >= 0 && n != expect_len) {
        PyErr_Format(PyExc_ValueError, "%s has %zd items, expected %zd", name, n, expect_len);
        Py_DECREF(fast);
        return -1;
    }
    b->views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    if (b->views == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, i), &b->views[i], flags | PyBUF_C_CONTIGUOUS) < 0) {
            release_buffers(b);
            Py_DECREF(fast);
            return -1;
        }
        b->count = i + 1;
    }
    Py_DECREF(fast);
    return 0;
}

/* ``digests`` (n of them) as a list of ints; frees them and releases ``b`` either way (the common end of
 * xxh3_many and xxh3_pages) */
static PyObject *digest_list(uint64_t *digests, Py_ssize_t n, Buffers *b) {
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *d = PyLong_FromUnsignedLongLong(digests[i]);
        if (d == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, d);
    }
    PyMem_Free(digests);
    release_buffers(b);
    return out;
}

static PyObject *xxh3_many(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *seq;
    Buffers b;
    if (!PyArg_ParseTuple(args, "O:xxh3_many", &seq) || require_xxh3() < 0) return NULL;
    if (get_buffers(seq, PyBUF_SIMPLE, -1, "buffers", &b) < 0) return NULL;
    uint64_t *digests = PyMem_Malloc((b.count ? b.count : 1) * sizeof(uint64_t));
    if (digests == NULL) {
        release_buffers(&b);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < b.count; i++) digests[i] = xxh3.oneshot(b.views[i].buf, (size_t)b.views[i].len);
    Py_END_ALLOW_THREADS
    return digest_list(digests, b.count, &b);
}

/* xxh3-64 of each page_nbytes piece of each buffer (a run of consecutive pages of the host pool): the file
 * store writes a backup from such runs, one view a run instead of one a page. */
static PyObject *xxh3_pages(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *seq;
    Py_ssize_t page_nbytes;
    Buffers b;
    if (!PyArg_ParseTuple(args, "On:xxh3_pages", &seq, &page_nbytes) || require_xxh3() < 0) return NULL;
    if (page_nbytes < 1) {
        PyErr_Format(PyExc_ValueError, "xxh3_pages: page_nbytes must be >= 1, got %zd", page_nbytes);
        return NULL;
    }
    if (get_buffers(seq, PyBUF_SIMPLE, -1, "buffers", &b) < 0) return NULL;
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < b.count; i++) {
        if (b.views[i].len % page_nbytes != 0) {
            PyErr_Format(PyExc_ValueError, "xxh3_pages: buffer %zd holds %zd bytes, not whole pages of %zd", i,
                         b.views[i].len, page_nbytes);
            release_buffers(&b);
            return NULL;
        }
        n += b.views[i].len / page_nbytes;
    }
    uint64_t *digests = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    if (digests == NULL) {
        release_buffers(&b);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < b.count; i++) {
        const unsigned char *at = b.views[i].buf;
        for (Py_ssize_t off = 0; off < b.views[i].len; off += page_nbytes)
            digests[k++] = xxh3.oneshot(at + off, (size_t)page_nbytes);
    }
    Py_END_ALLOW_THREADS
    return digest_list(digests, n, &b);
}

/* The index of the first item of keys that is not a str of min_len to max_len lowercase hex digits, or -1:
 * tierkv.storage.base.check_keys for a whole batch. Why: every store call checks its keys, and the Python
 * pass (join, translate, lengths) cost ~0.1 us a key, ~0.5 CPU-s of a replay's ~5 million. */
static PyObject *first_bad_key(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *seq;
    Py_ssize_t min_len, max_len;
    if (!PyArg_ParseTuple(args, "Onn:first_bad_key", &seq, &min_len, &max_len)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "keys must be a sequence");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), bad = -1;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n && bad < 0; i++) {
        PyObject *key = items[i];
        if (!PyUnicode_Check(key) || !PyUnicode_IS_ASCII(key) || PyUnicode_GET_LENGTH(key) < min_len ||
            PyUnicode_GET_LENGTH(key) > max_len) {
            bad = i;
            break;
        }
        const Py_UCS1 *chars = PyUnicode_1BYTE_DATA(key);
        for (Py_ssize_t j = 0; j < PyUnicode_GET_LENGTH(key); j++) {
            Py_UCS1 c = chars[j];
            if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) {
                bad = i;
                break;
            }
        }
    }
    Py_DECREF(fast);
    return PyLong_FromSsize_t(bad);
}

static void put_be64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (56 - 8 * i));
}

/* The key digest field of each page's header: xxh64 (seed 0) of the key's UTF-8 bytes, canonical (big-endian),
 * back to back. Why here: a backup of 610 small pages hashed its keys one Python call each (~0.2 CPU-s of a
 * 2,000-request replay with a file L3). */
static PyObject *key_digests(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "O:key_digests", &seq)) return NULL;
    if (xxh64_oneshot == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "xxh64 is not bound (bind_xxh3 did not find XXH64)");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(seq, "keys must be a sequence");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        Py_ssize_t size;
        const char *utf8 = PyUnicode_Check(items[i]) ? PyUnicode_AsUTF8AndSize(items[i], &size) : NULL;
        if (utf8 == NULL) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "key %zd is not a str", i);
            Py_CLEAR(out);
            break;
        }
        put_be64((unsigned char *)PyBytes_AS_STRING(out) + 8 * i, xxh64_oneshot(utf8, (size_t)size, 0));
    }
    Py_DECREF(fast);
    return out;
}

/* The chain of tierkv.hashing.page_hashes for xxh3-128: digest_i = H(digest_(i-1) + tag + page i's bytes),
 * digest_(-1) = prior, each as xxhash's canonical (big-endian) 16 bytes, returned as 32-char hex strings.
 * Why: per page, Python made a concatenated bytes object, a digest and its hex (~0.5 us); a replay hashes
 * ~2 million pages. The chain runs without the GIL; only the strings are made with it. */
static PyObject *chain_xxh3_128(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer prior, tag, data;
    Py_ssize_t stride;
    if (!PyArg_ParseTuple(args, "y*y*y*n:chain_xxh3_128", &prior, &tag, &data, &stride)) return NULL;
    PyObject *out = NULL;
    unsigned char *buf = NULL, *digests = NULL;
    if (require_xxh3() < 0) goto done;
    if (prior.len != 16 || stride < 1 || data.len % stride != 0) {
        PyErr_Format(PyExc_ValueError, "chain_xxh3_128: prior of %zd bytes (16 wanted), %zd bytes of data in "
                     "pages of %zd", prior.len, data.len, stride);
        goto done;
    }
    Py_ssize_t n = data.len / stride, head = 16 + tag.len;
    buf = PyMem_Malloc((size_t)(head + stride));
    digests = PyMem_Malloc((size_t)(n ? n : 1) * 16);
    if (buf == NULL || digests == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(buf, prior.buf, 16);
    memcpy(buf + 16, tag.buf, (size_t)tag.len);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(buf + head, (const unsigned char *)data.buf + i * stride, (size_t)stride);
        Xxh128Hash h = xxh3.oneshot128(buf, (size_t)(head + stride));
        put_be64(digests + 16 * i, h.high64);
        put_be64(digests + 16 * i + 8, h.low64);
        memcpy(buf, digests + 16 * i, 16);
    }
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    static const char hex[] = "0123456789abcdef";
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *text = PyUnicode_New(32, 127);
        if (text == NULL) {
            Py_CLEAR(out);
            break;
        }
        Py_UCS1 *chars = PyUnicode_1BYTE_DATA(text);
        for (int j = 0; j < 16; j++) {
            chars[2 * j] = (Py_UCS1)hex[digests[16 * i + j] >> 4];
            chars[2 * j + 1] = (Py_UCS1)hex[digests[16 * i + j] & 15];
        }
        PyList_SET_ITEM(out, i, text);
    }
done:
    PyMem_Free(buf);
    PyMem_Free(digests);
    PyBuffer_Release(&prior);
    PyBuffer_Release(&tag);
    PyBuffer_Release(&data);
    return out;
}

void put_le64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

PyObject *results_list(const PageResult *results, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *item = Py_BuildValue("(iL)", results[i].status, (long long)results[i].value);
        if (item == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, item);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"bind_xxh3", bind_xxh3, METH_VARARGS,
     "bind_xxh3(path): take XXH3_64bits and its streaming functions from the shared object at path; True if all "
     "were found"},
    {"xxh3_many", xxh3_many, METH_VARARGS, "xxh3_many(buffers) -> [xxh3-64 of each], without the GIL"},
    {"xxh3_pages", xxh3_pages, METH_VARARGS,
     "xxh3_pages(buffers, page_nbytes) -> [xxh3-64 of each page_nbytes piece of each buffer, in order], without the GIL"},
    {"first_bad_key", first_bad_key, METH_VARARGS,
     "first_bad_key(keys, min_len, max_len) -> index of the first key that is not a str of min_len to max_len "
     "lowercase hex digits, or -1"},
    {"key_digests", key_digests, METH_VARARGS,
     "key_digests(keys) -> bytes: xxh64 (seed 0, canonical big-endian) of each key's UTF-8 bytes, 8 bytes a key"},
    {"chain_xxh3_128", chain_xxh3_128, METH_VARARGS,
     "chain_xxh3_128(prior, tag, data, stride) -> [hex of d_i = xxh3-128(d_(i-1) + tag + data[i*stride:(i+1)*stride])"
     "], d_(-1) = prior (16 bytes), digests canonical (big-endian)"},
    {"copy_blobs_xxh3", copy_blobs_xxh3, METH_VARARGS,
     "copy_blobs_xxh3(sources, payloads, headers, expected, payload_nbytes, checksum_offset) -> "
     "[(status, checksum)]: copy each blob (payload then 48-byte header), sources[i] (a list of buffers, or an "
     "int64 array of addresses) "
     "into payloads[i] and headers[i*48:], hashing each payload chunk as it lands, and compare the header with "
     "template expected[i*48:] holding that checksum; status 0 ok, 3 mismatch"},
    {"read_xxh3", read_xxh3, METH_VARARGS,
     "read_xxh3(fd, page, offset) -> xxh3-64 of the page's bytes read from fd at offset (a page over 240 bytes), "
     "or None if the file ends first; copied and hashed in one pass, without the GIL"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pageio", NULL, -1, methods};

/* Bumped whenever a function's arguments change (tierkv/storage/native.py checks it). 3: copy_blobs_xxh3.
 * 4: read_pages and write_pages removed (the file store reads and writes pack files from Python).
 * 5: chain_xxh3_128 (and bind_xxh3 needs XXH3_128bits), xxh3_pages, first_bad_key. 6: read_xxh3.
 * 7: key_digests. */
#define API_VERSION 7

PyMODINIT_FUNC PyInit__pageio(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    /* the bound functions, for tierkv.copy._rowcopy's hashed L1 -> L2 copy (one binding for both modules) */
    PyObject *capsule = PyCapsule_New(&xxh3, "tierkv._pageio.xxh3_functions", NULL);
    if (PyModule_AddIntConstant(m, "API_VERSION", API_VERSION) < 0 || capsule == NULL
        || PyModule_AddObject(m, "xxh3_functions", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
