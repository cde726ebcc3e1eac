/* The L1 -> L2 copy that also hashes each host page (xxh3-64, the checksum an L3 page header holds), in
 * the same pass: each piece of a page is hashed right after it is written, while it is in the core's L1
 * cache, so the digest costs no second pass over memory. An L3 store given the digest (a backup of that
 * page) then writes its header without reading the page again, which matters where the store's own
 * transfer copies the page on a thread tierkv cannot hash in (Mooncake's transfer engine).
 *
 * The digest is of the destination's bytes as written (read back from cache), so it describes exactly
 * what the host page holds. It is recorded (value, then its valid flag) only once the whole page is
 * written; the host pool clears the flag whenever the page is handed out again or written any other way.
 *
 * The xxh3 functions are tierkv._pageio's (bound there from the xxhash package's own shared object and
 * checked against it), passed here as a capsule: one binding, so the two can never disagree.
 */
#include "_rowcopy.h"

#include <string.h>

#include "../_pageio.h"

/* Written, then hashed, in pieces of this many bytes: small enough to stay in L1 between the two, large
 * enough that the streaming update's per-call cost is noise. */
#define HASH_PIECE_NBYTES (16 << 10)

static const Xxh3Functions *bound_xxh3;

PyObject *use_xxh3(PyObject *self, PyObject *capsule) {
    (void)self;
    const Xxh3Functions *functions = PyCapsule_GetPointer(capsule, "tierkv._pageio.xxh3_functions");
    if (functions == NULL) return NULL;
    if (functions->create == NULL || functions->reset == NULL || functions->update == NULL
        || functions->digest == NULL || functions->free_state == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "tierkv._pageio has not bound xxh3 (call bind_xxh3 first)");
        return NULL;
    }
    bound_xxh3 = functions;
    Py_RETURN_NONE;
}

int xxh3_bound(void) {
    if (bound_xxh3 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "xxh3 is not bound here (call use_xxh3 first)");
        return 0;
    }
    return 1;
}

int pages_written_in_order(const PageCopy *c) {
    if (c->outer != 1 || c->inner * c->chunk_nbytes != c->dst_page_nbytes) return 0;
    for (Py_ssize_t i = 0; i < c->inner; i++) {
        if (c->dst_base[i] != i * c->chunk_nbytes) return 0;
    }
    return 1;
}

/* One page: its chunks copied in pieces, each stretch of HASH_PIECE_NBYTES written fed to the hash. */
static uint64_t copy_page_hashed(const PageCopy *c, char *page_dst, const char *page_src, void *state) {
    const Xxh3Functions *x = bound_xxh3;
    Py_ssize_t hashed = 0;  /* the page's leading bytes fed to the hash: chunks land in address order */
    x->reset(state);
    for (Py_ssize_t i = 0; i < c->inner; i++) {
        char *d = page_dst + c->dst_base[i];
        const char *s = page_src + c->src_base[i];
        for (Py_ssize_t off = 0; off < c->chunk_nbytes; off += HASH_PIECE_NBYTES) {
            Py_ssize_t n = c->chunk_nbytes - off < HASH_PIECE_NBYTES ? c->chunk_nbytes - off : HASH_PIECE_NBYTES;
            memcpy(d + off, s + off, (size_t)n);
            Py_ssize_t written = c->dst_base[i] + off + n;
            if (written - hashed >= HASH_PIECE_NBYTES) {
                x->update(state, page_dst + hashed, (size_t)(written - hashed));
                hashed = written;
            }
        }
    }
    if (hashed < c->dst_page_nbytes) x->update(state, page_dst + hashed, (size_t)(c->dst_page_nbytes - hashed));
    return x->digest(state);
}

int run_hashed_page_copy(const PageCopy *c) {
    void *state = bound_xxh3->create();
    if (state == NULL) return -1;
    for (Py_ssize_t p = 0; p < c->num_pages; p++) {
        int64_t page = c->dst_pages[p];
        c->digest_valid[page] = 0;  /* the page is being rewritten: its old digest no longer holds */
        uint64_t digest = copy_page_hashed(c, c->dst + page * c->dst_page_nbytes,
                                           c->src + c->src_pages[p] * c->src_page_nbytes, state);
        c->digests[page] = digest;
        __atomic_store_n(&c->digest_valid[page], 1, __ATOMIC_RELEASE);  /* the value before its flag */
    }
    bound_xxh3->free_state(state);
    return 0;
}
