/* The L1 -> L2 copy that also hashes each host page (xxh3-64, the checksum an L3 page header holds), in
 * the same pass, so the digest costs no second pass over memory. An L3 store given the digest (a backup of
 * that page) then writes its header without reading the page again, which matters where the store's own
 * transfer copies the page on a thread tierkv cannot hash in (Mooncake's transfer engine).
 *
 * Chunks of whole 64-byte stripes (pages over 240 bytes) are copied and hashed from the same registers
 * (copy_page_fused, tierkv/_xxh3_copy.c). Other pages are copied a piece at a time by the plain copy's own
 * loop (run_page_copy, its prefetch of each scattered source chunk included), each piece hashed right after
 * it is written while it is in the core's cache: a simpler chunk-by-chunk memcpy here took 28-30 ms for
 * 128 MiB of 2 KiB chunks where the plain copy took 19.5, and as slow with the hash calls left out.
 *
 * The digest is of the destination's bytes as written (the registers stored, or the bytes read back from
 * cache), so it describes exactly what the host page holds. It is recorded (value, then its valid flag)
 * only once the whole page is written; the host pool clears the flag whenever the page is handed out again
 * or written any other way.
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

/* Page ``p``: copied a piece at a time by the plain copy's loop (its prefetching included), each piece fed to
 * the hash right after it lands. A piece is the chunks of HASH_PIECE_NBYTES (at least one chunk). */
static uint64_t copy_page_hashed(const PageCopy *c, Py_ssize_t p, void *state) {
    const Xxh3Functions *x = bound_xxh3;
    char *page_dst = c->dst + c->dst_pages[p] * c->dst_page_nbytes;
    Py_ssize_t per_piece = c->chunk_nbytes >= HASH_PIECE_NBYTES ? 1 : HASH_PIECE_NBYTES / c->chunk_nbytes;
    PageCopy piece = *c;
    piece.num_pages = 1;
    piece.dst_pages = c->dst_pages + p;
    piece.src_pages = c->src_pages + p;
    x->reset(state);
    for (Py_ssize_t first = 0; first < c->inner; first += per_piece) {
        piece.inner = c->inner - first < per_piece ? c->inner - first : per_piece;
        piece.dst_base = c->dst_base + first;
        piece.src_base = c->src_base + first;
        run_page_copy(&piece);
        /* chunks lie back to back from the page's start (pages_written_in_order) */
        x->update(state, page_dst + first * c->chunk_nbytes, (size_t)(piece.inner * c->chunk_nbytes));
    }
    return x->digest(state);
}

/* Page ``p`` copied chunk by chunk and hashed from the registers each chunk is stored from (_xxh3_copy.c),
 * the next chunk's first bytes fetched ahead as the plain copy does. For chunks of whole 64-byte stripes
 * in pages over 240 bytes. 128 MiB of 128 KiB pages (32 KiB chunks), min of 15: 6.8-7.5 ms, the plain copy
 * 8.5-8.8; hashing each piece after it landed took 11.9-12.0. */
static uint64_t copy_page_fused(const PageCopy *c, Py_ssize_t p) {
    char *page_dst = c->dst + c->dst_pages[p] * c->dst_page_nbytes;
    const char *page_src = c->src + c->src_pages[p] * c->src_page_nbytes;
    Py_ssize_t ahead = c->chunk_nbytes < PREFETCH_MAX_NBYTES ? c->chunk_nbytes : PREFETCH_MAX_NBYTES;
    Xxh3Copy state;
    xxh3_copy_start(&state, (size_t)c->dst_page_nbytes);
    for (Py_ssize_t i = 0; i < c->inner; i++) {
        const char *next = i + 1 < c->inner ? page_src + c->src_base[i + 1]
                           : p + 1 < c->num_pages ? c->src + c->src_pages[p + 1] * c->src_page_nbytes + c->src_base[0]
                           : NULL;
        for (Py_ssize_t off = 0; next != NULL && off < ahead; off += 64) PREFETCH(next + off, 0);
        xxh3_copy_part(&state, page_dst + i * c->chunk_nbytes, page_src + c->src_base[i], (size_t)c->chunk_nbytes);
    }
    return xxh3_copy_finish(&state, page_dst, (size_t)c->dst_page_nbytes);
}

int run_hashed_page_copy(const PageCopy *c) {
    void *state = bound_xxh3->create();
    if (state == NULL) return -1;
    int fused = c->chunk_nbytes % 64 == 0 && c->dst_page_nbytes > XXH3_COPY_MIN_NBYTES;
    for (Py_ssize_t p = 0; p < c->num_pages; p++) {
        int64_t page = c->dst_pages[p];
        c->digest_valid[page] = 0;  /* the page is being rewritten: its old digest no longer holds */
        uint64_t digest = fused ? copy_page_fused(c, p) : copy_page_hashed(c, p, state);
        c->digests[page] = digest;
        __atomic_store_n(&c->digest_valid[page], 1, __ATOMIC_RELEASE);  /* the value before its flag */
    }
    bound_xxh3->free_state(state);
    return 0;
}
