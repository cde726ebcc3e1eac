/* Native page I/O for the L3 stores: batched checksums, and the file store's reads and writes.
 *
 * Why: per page, Python's os.open/preadv/close, a hasher object and a header check cost ~15 us, half
 * of a 128 KiB page's read; here a whole batch is one call that runs without the GIL (the scheduler
 * and the checksum helpers keep running), and each page is hashed chunk by chunk right after (reads)
 * or before (writes) the kernel copies it, while the chunk is in the core's cache. A read batch may run
 * on several threads, each page read and hashed by one of them (so its chunks stay in that core's
 * cache): with a spare core the kernel's copy of one page overlaps the hash of another.
 *
 * The checksum is xxh3-64, the one tierkv.storage.page_format computes with the xxhash package: this
 * module takes the functions from that package's own shared object (bind_xxh3, given its path), so the
 * two can never disagree; the caller checks a known digest before using it.
 *
 * Headers are passed as templates: the 48 bytes a page's header must hold, with the checksum field
 * (at checksum_offset) left to fill. A write fills it and writes the template; a read fills it with the
 * checksum of what it read and compares the whole stored header with it (one memcmp checks magic,
 * version, namespace, length, key digest and checksum). Anything else is the caller's to explain.
 */
#include "_pageio.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_READ_THREADS 16
#define READER_STACK_NBYTES (256 << 10)


Xxh3Functions xxh3;

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
    if (!xxh3.oneshot || !xxh3.create || !xxh3.reset || !xxh3.update || !xxh3.digest || !xxh3.free_state) {
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
    PyObject *out = PyList_New(b.count);
    for (Py_ssize_t i = 0; out != NULL && i < b.count; i++) {
        PyObject *d = PyLong_FromUnsignedLongLong(digests[i]);
        if (d == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, d);
    }
    PyMem_Free(digests);
    release_buffers(&b);
    return out;
}

/* Per-page arguments of a batch, unpacked under the GIL. */
typedef struct {
    int *dir_fds;
    const char **names, **temps;
    PyObject *names_fast, *temps_fast;
    Buffers payloads;
    Py_buffer headers, expected;  /* headers: n * 48 bytes (read: filled; write: templates) */
    Py_ssize_t count;
} Batch;

static void release_batch(Batch *b) {
    PyMem_Free(b->dir_fds);
    PyMem_Free(b->names);
    PyMem_Free(b->temps);
    Py_XDECREF(b->names_fast);
    Py_XDECREF(b->temps_fast);
    release_buffers(&b->payloads);
    if (b->headers.obj) PyBuffer_Release(&b->headers);
    if (b->expected.obj) PyBuffer_Release(&b->expected);
}

static int get_names(PyObject *seq, Py_ssize_t n, const char ***names, PyObject **fast) {
    *fast = PySequence_Fast(seq, "names must be a sequence of bytes");
    if (*fast == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(*fast) != n) {
        PyErr_Format(PyExc_ValueError, "%zd names for %zd pages", PySequence_Fast_GET_SIZE(*fast), n);
        return -1;
    }
    *names = PyMem_Calloc(n ? n : 1, sizeof(char *));
    if (*names == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(*fast, i);
        if (!PyBytes_Check(item) || (Py_ssize_t)strlen(PyBytes_AS_STRING(item)) != PyBytes_GET_SIZE(item)) {
            PyErr_SetString(PyExc_TypeError, "each name must be bytes without NUL");
            return -1;
        }
        (*names)[i] = PyBytes_AS_STRING(item);
    }
    return 0;
}

static int get_batch(PyObject *fds, PyObject *names, PyObject *temps, PyObject *payloads, PyObject *headers,
                     PyObject *expected, int writable_payloads, Py_ssize_t payload_nbytes, Batch *b) {
    memset(b, 0, sizeof(*b));
    PyObject *fast = PySequence_Fast(fds, "dir_fds must be a sequence of ints");
    if (fast == NULL) return -1;
    b->count = PySequence_Fast_GET_SIZE(fast);
    b->dir_fds = PyMem_Calloc(b->count ? b->count : 1, sizeof(int));
    if (b->dir_fds == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < b->count; i++) {
        b->dir_fds[i] = (int)PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if (b->dir_fds[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    if (get_names(names, b->count, &b->names, &b->names_fast) < 0) return -1;
    if (temps != NULL && get_names(temps, b->count, &b->temps, &b->temps_fast) < 0) return -1;
    if (get_buffers(payloads, writable_payloads ? PyBUF_WRITABLE : PyBUF_SIMPLE, b->count, "payloads",
                    &b->payloads) < 0) return -1;
    for (Py_ssize_t i = 0; i < b->count; i++) {
        if (b->payloads.views[i].len != payload_nbytes) {
            PyErr_Format(PyExc_ValueError, "payload %zd has %zd bytes, expected %zd", i, b->payloads.views[i].len,
                         payload_nbytes);
            return -1;
        }
    }
    if (PyObject_GetBuffer(headers, &b->headers, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (expected != NULL && PyObject_GetBuffer(expected, &b->expected, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (b->headers.len != b->count * HEADER_NBYTES || (expected != NULL && b->expected.len != b->headers.len)) {
        PyErr_Format(PyExc_ValueError, "header buffers must hold %zd bytes (48 per page)", b->count * HEADER_NBYTES);
        return -1;
    }
    return 0;
}

void put_le64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

/* Reads payload then header from offset 0, chunk by chunk, hashing each payload chunk into state (if
 * any) right after it lands; returns the bytes read, or -errno. */
static Py_ssize_t read_blob(int fd, char *payload, Py_ssize_t payload_nbytes, char *header, Py_ssize_t chunk_nbytes,
                            void *state) {
    Py_ssize_t done = 0, total = payload_nbytes + HEADER_NBYTES;
    while (done < total) {
        struct iovec iov[2];
        int n = 0;
        if (done < payload_nbytes) {
            Py_ssize_t len = payload_nbytes - done < chunk_nbytes ? payload_nbytes - done : chunk_nbytes;
            iov[n].iov_base = payload + done;
            iov[n++].iov_len = (size_t)len;
            if (done + len == payload_nbytes) {
                iov[n].iov_base = header;
                iov[n++].iov_len = HEADER_NBYTES;
            }
        } else {
            iov[n].iov_base = header + (done - payload_nbytes);
            iov[n++].iov_len = (size_t)(total - done);
        }
        ssize_t got = preadv(fd, iov, n, done);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (got == 0) break;
        if (state != NULL && done < payload_nbytes) {
            Py_ssize_t end = done + got < payload_nbytes ? done + got : payload_nbytes;
            xxh3.update(state, payload + done, (size_t)(end - done));
        }
        done += got;
    }
    return done;
}

static PageResult read_one(const Batch *b, Py_ssize_t i, Py_ssize_t chunk_nbytes, Py_ssize_t checksum_offset,
                           int touch, void *state) {
    PageResult r = {READ_OK, 0};
    if (b->dir_fds[i] < 0) {
        r.status = b->dir_fds[i] == -1 ? READ_ABSENT : READ_NO_DIR;
        return r;
    }
    /* O_NONBLOCK: a FIFO planted as a page must not block the batch (no effect on a regular file) */
    int fd = openat(b->dir_fds[i], b->names[i], O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        r.status = errno == ENOENT ? READ_ABSENT : -errno;
        return r;
    }
    Py_buffer *payload = &b->payloads.views[i];
    char *header = (char *)b->headers.buf + i * HEADER_NBYTES;
    struct stat st;
    if (fstat(fd, &st) < 0) {
        r.status = -errno;
    } else if (!S_ISREG(st.st_mode) || st.st_size != payload->len + HEADER_NBYTES) {
        r.status = READ_BAD_SIZE;
        r.value = (int64_t)st.st_size;
    } else {
        if (state != NULL) xxh3.reset(state);
        Py_ssize_t got = read_blob(fd, payload->buf, payload->len, header, chunk_nbytes, state);
        if (got < 0) r.status = (int)got;
        else if (got != payload->len + HEADER_NBYTES) {
            r.status = READ_SHORT;
            r.value = got;
        } else if (touch && futimens(fd, NULL) < 0) {
            r.status = -errno;
        }
    }
    close(fd);
    if (r.status == READ_OK && state != NULL) {
        unsigned char want[HEADER_NBYTES];
        uint64_t digest = xxh3.digest(state);
        memcpy(want, (const char *)b->expected.buf + i * HEADER_NBYTES, HEADER_NBYTES);
        put_le64(want + checksum_offset, digest);
        r.value = (int64_t)digest;
        if (memcmp(want, header, HEADER_NBYTES) != 0) r.status = READ_MISMATCH;
    }
    return r;
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

/* One read_pages call shared by its reader threads: each takes the next page not yet taken, so a thread
 * the scheduler holds back delays at most the page it holds, not a fixed share of the batch. */
typedef struct {
    const Batch *batch;
    PageResult *results;
    Py_ssize_t chunk_nbytes, checksum_offset;
    int touch;
    atomic_size_t next;
} ReadJob;

typedef struct {
    ReadJob *job;
    void *state; /* this thread's xxh3 state (NULL: no verification) */
    pthread_t thread;
} Reader;

static void *read_some(void *arg) {
    Reader *reader = arg;
    ReadJob *job = reader->job;
    for (;;) {
        size_t i = atomic_fetch_add(&job->next, 1);
        if (i >= (size_t)job->batch->count) break;
        job->results[i] = read_one(job->batch, (Py_ssize_t)i, job->chunk_nbytes, job->checksum_offset, job->touch,
                                   reader->state);
    }
    return NULL;
}

/* Runs the job on the calling thread and num_readers - 1 more (fewer if the system refuses threads:
 * the pages then go to those that run). The extra threads block every signal, as CPython expects of
 * threads it does not know. */
static void run_readers(Reader *readers, int num_readers) {
    int started = 1;
    if (num_readers > 1) {
        pthread_attr_t attr;
        sigset_t all, old;
        sigfillset(&all);
        int attr_ok = pthread_attr_init(&attr) == 0;
        if (attr_ok) pthread_attr_setstacksize(&attr, READER_STACK_NBYTES);
        pthread_sigmask(SIG_BLOCK, &all, &old);
        while (started < num_readers &&
               pthread_create(&readers[started].thread, attr_ok ? &attr : NULL, read_some, &readers[started]) == 0) {
            started++;
        }
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (attr_ok) pthread_attr_destroy(&attr);
    }
    read_some(&readers[0]);
    for (int k = 1; k < started; k++) pthread_join(readers[k].thread, NULL);
}

static PyObject *read_pages(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *fds, *names, *payloads, *headers, *expected;
    Py_ssize_t payload_nbytes, chunk_nbytes, checksum_offset;
    int touch, num_readers;
    Batch b;
    if (!PyArg_ParseTuple(args, "OOOOOnnnpi:read_pages", &fds, &names, &payloads, &headers, &expected,
                          &payload_nbytes, &chunk_nbytes, &checksum_offset, &touch, &num_readers)) return NULL;
    int verify = expected != Py_None;
    if (verify && require_xxh3() < 0) return NULL;
    if (chunk_nbytes < 1 || (verify && (checksum_offset < 0 || checksum_offset > HEADER_NBYTES - 8))) {
        return PyErr_Format(PyExc_ValueError, "chunk_nbytes %zd or checksum_offset %zd out of range", chunk_nbytes,
                            checksum_offset);
    }
    if (num_readers < 1 || num_readers > MAX_READ_THREADS) {
        return PyErr_Format(PyExc_ValueError, "num_threads %d is not in 1..%d", num_readers, MAX_READ_THREADS);
    }
    PyObject *out = NULL;
    PageResult *results = NULL;
    Reader readers[MAX_READ_THREADS];
    memset(readers, 0, sizeof(readers));
    ReadJob job;
    if (get_batch(fds, names, NULL, payloads, headers, verify ? expected : NULL, 1, payload_nbytes, &b) < 0) goto done;
    if (num_readers > b.count) num_readers = b.count > 0 ? (int)b.count : 1;
    results = PyMem_Calloc(b.count ? b.count : 1, sizeof(PageResult));
    if (results == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    job = (ReadJob){&b, results, chunk_nbytes, checksum_offset, touch, 0};
    for (int k = 0; k < num_readers; k++) {
        readers[k].job = &job;
        if (verify && (readers[k].state = xxh3.create()) == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    run_readers(readers, num_readers);
    Py_END_ALLOW_THREADS
    out = results_list(results, b.count);
done:
    for (int k = 0; k < MAX_READ_THREADS; k++) {
        if (readers[k].state != NULL) xxh3.free_state(readers[k].state);
    }
    PyMem_Free(results);
    release_batch(&b);
    return out;
}

/* Writes buffers back to back from offset; 0 or -errno. */
static int write_all(int fd, struct iovec *iov, int n, off_t offset) {
    while (n > 0) {
        ssize_t put = pwritev(fd, iov, n, offset);
        if (put < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        offset += put;
        while (n > 0 && (size_t)put >= iov[0].iov_len) {
            put -= (ssize_t)iov[0].iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov[0].iov_base = (char *)iov[0].iov_base + put;
            iov[0].iov_len -= (size_t)put;
        }
    }
    return 0;
}

/* Payload then header at offset 0; each chunk hashed (when state) just before it is written, so the
 * kernel copies it from cache; the checksum goes into the header before the last write. */
static int write_blob(int fd, const char *payload, Py_ssize_t payload_nbytes, unsigned char *header,
                      Py_ssize_t chunk_nbytes, Py_ssize_t checksum_offset, void *state) {
    if (state != NULL) xxh3.reset(state);
    Py_ssize_t last = payload_nbytes > 0 ? (payload_nbytes - 1) / chunk_nbytes * chunk_nbytes : 0;
    for (Py_ssize_t start = 0; start < last; start += chunk_nbytes) {
        struct iovec iov = {(void *)(payload + start), (size_t)chunk_nbytes};
        if (state != NULL) xxh3.update(state, payload + start, (size_t)chunk_nbytes);
        int rc = write_all(fd, &iov, 1, start);
        if (rc < 0) return rc;
    }
    if (state != NULL) {
        xxh3.update(state, payload + last, (size_t)(payload_nbytes - last));
        put_le64(header + checksum_offset, xxh3.digest(state));
    }
    struct iovec iov[2] = {{(void *)(payload + last), (size_t)(payload_nbytes - last)}, {header, HEADER_NBYTES}};
    return write_all(fd, iov, 2, last);
}

static int write_one(const Batch *b, Py_ssize_t i, Py_ssize_t chunk_nbytes, Py_ssize_t checksum_offset, int sync,
                     void *state) {
    int dir = b->dir_fds[i];
    if (dir < 0) return -ENOENT;
    const int flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
    int fd = openat(dir, b->temps[i], flags, 0644);
    if (fd < 0 && errno == EEXIST) {  /* left by a crashed process that had our pid and thread id */
        unlinkat(dir, b->temps[i], 0);
        fd = openat(dir, b->temps[i], flags, 0644);
    }
    if (fd < 0) return -errno;
    unsigned char *header = (unsigned char *)b->headers.buf + i * HEADER_NBYTES;
    int rc = write_blob(fd, b->payloads.views[i].buf, b->payloads.views[i].len, header, chunk_nbytes,
                        checksum_offset, state);
    if (rc == 0 && sync && fsync(fd) < 0) rc = -errno;
    if (close(fd) < 0 && rc == 0) rc = -errno;
    /* rename() replaces a planted symlink itself; it never writes through one */
    if (rc == 0 && renameat(dir, b->temps[i], dir, b->names[i]) < 0) rc = -errno;
    if (rc < 0) {
        unlinkat(dir, b->temps[i], 0);
        return rc;
    }
    if (sync && fsync(dir) < 0) return -errno;  /* the rename is durable once its directory entry is */
    return 0;
}

static PyObject *write_pages(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *fds, *temps, *names, *payloads, *headers, *stop_obj;
    Py_ssize_t payload_nbytes, chunk_nbytes, checksum_offset;
    int sync;
    Batch b;
    if (!PyArg_ParseTuple(args, "OOOOOnnnpO:write_pages", &fds, &temps, &names, &payloads, &headers, &payload_nbytes,
                          &chunk_nbytes, &checksum_offset, &sync, &stop_obj)) return NULL;
    if (checksum_offset >= 0 && require_xxh3() < 0) return NULL;
    if (chunk_nbytes < 1 || checksum_offset > HEADER_NBYTES - 8) {
        return PyErr_Format(PyExc_ValueError, "chunk_nbytes %zd or checksum_offset %zd out of range", chunk_nbytes,
                            checksum_offset);
    }
    PyObject *out = NULL, *stop = NULL;
    PageResult *results = NULL;
    void *state = NULL;
    int stop_errnos[16];
    Py_ssize_t num_stop = 0;
    if (get_batch(fds, names, temps, payloads, headers, NULL, 0, payload_nbytes, &b) < 0) goto done;
    stop = PySequence_Fast(stop_obj, "stop_errnos must be a sequence of ints");
    if (stop == NULL) goto done;
    num_stop = PySequence_Fast_GET_SIZE(stop) < 16 ? PySequence_Fast_GET_SIZE(stop) : 16;
    for (Py_ssize_t k = 0; k < num_stop; k++) {
        stop_errnos[k] = (int)PyLong_AsLong(PySequence_Fast_GET_ITEM(stop, k));
        if (PyErr_Occurred()) goto done;
    }
    results = PyMem_Calloc(b.count ? b.count : 1, sizeof(PageResult));
    if (results == NULL || (checksum_offset >= 0 && (state = xxh3.create()) == NULL)) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    int stopped = 0;
    for (Py_ssize_t i = 0; i < b.count; i++) {
        if (stopped) {  /* not attempted: a refusal the rest would hit too */
            results[i].status = 1;
            continue;
        }
        results[i].status = write_one(&b, i, chunk_nbytes, checksum_offset, sync, state);
        for (Py_ssize_t k = 0; k < num_stop; k++) stopped |= results[i].status == -stop_errnos[k];
    }
    Py_END_ALLOW_THREADS
    out = results_list(results, b.count);
done:
    Py_XDECREF(stop);
    if (state != NULL) xxh3.free_state(state);
    PyMem_Free(results);
    release_batch(&b);
    return out;
}

static PyMethodDef methods[] = {
    {"bind_xxh3", bind_xxh3, METH_VARARGS,
     "bind_xxh3(path): take XXH3_64bits and its streaming functions from the shared object at path; True if all "
     "were found"},
    {"xxh3_many", xxh3_many, METH_VARARGS, "xxh3_many(buffers) -> [xxh3-64 of each], without the GIL"},
    {"read_pages", read_pages, METH_VARARGS,
     "read_pages(dir_fds, names, payloads, headers, expected, payload_nbytes, chunk_nbytes, checksum_offset, touch, "
     "num_threads) -> [(status, value)]: on num_threads threads (1-16; each page read and hashed by one), "
     "open names[i] under dir_fds[i] (-1: absent, -2: unusable) without following a symlink, read its payload "
     "into payloads[i] and its 48-byte trailer into headers[i*48:]; with expected "
     "(header templates) hash the payload and compare the trailer with the template holding that checksum. "
     "status 0 ok (value: checksum), 1 absent, 2 wrong size (value: size), 3 header mismatch (value: checksum), "
     "4 short read (value: bytes), 5 directory unusable, -errno"},
    {"copy_blobs_xxh3", copy_blobs_xxh3, METH_VARARGS,
     "copy_blobs_xxh3(sources, payloads, headers, expected, payload_nbytes, checksum_offset) -> "
     "[(status, checksum)]: copy each blob (payload then 48-byte header), sources[i] (a list of buffers, or an "
     "int64 array of addresses) "
     "into payloads[i] and headers[i*48:], hashing each payload chunk as it lands, and compare the header with "
     "template expected[i*48:] holding that checksum; status 0 ok, 3 mismatch"},
    {"write_pages", write_pages, METH_VARARGS,
     "write_pages(dir_fds, temps, names, payloads, headers, payload_nbytes, chunk_nbytes, checksum_offset, sync, "
     "stop_errnos) -> [(status, 0)]: write payload then header to temps[i] (O_EXCL, no symlink followed) and "
     "rename it over names[i]; checksum_offset >= 0: hash the payload into the header template there first. "
     "status 0 ok, -errno failed, 1 not attempted (after a failure with an errno in stop_errnos)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pageio", NULL, -1, methods};

/* Bumped whenever a function's arguments change (tierkv/storage/native.py checks it). 3: copy_blobs_xxh3. */
#define API_VERSION 3

PyMODINIT_FUNC PyInit__pageio(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "API_VERSION", API_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
