/* A copy that computes XXH3-64 (seed 0, default secret) of the bytes it stores, from the very registers it
 * stores them from: one pass over memory, where a copy then a hash of the destination reads every byte
 * again from cache, and the stores can stream past the cache (no read of each destination line first).
 *
 * The algorithm is XXH3's long-input path as the xxHash specification gives it (inputs over 240 bytes):
 * eight 64-bit accumulators; each 64-byte stripe adds, per lane, the stripe's word to the neighbouring
 * lane and the product of the two 32-bit halves of (word ^ secret word) to its own; every 16 stripes (a
 * 1 KiB block) the accumulators are scrambled with the secret's last 64 bytes; the input's last 64 bytes
 * are a last stripe with the secret shifted; the lanes are merged pairwise with 128-bit products and
 * avalanched. The digests are checked against the xxhash package for every length shape
 * (tests/test_mooncake_in_place.py). Shorter inputs are the caller's (copy, then the bound xxh3).
 */
#include "_pageio.h"

#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define XXH3_COPY_AVX2 1
#endif

#define SECRET_NBYTES 192
#define STRIPE_NBYTES 64
#define STRIPES_PER_BLOCK ((SECRET_NBYTES - STRIPE_NBYTES) / 8)
#define LAST_STRIPE_SECRET (SECRET_NBYTES - STRIPE_NBYTES - 7)
#define MERGE_SECRET 11
/* Each stripe's source asked for this far ahead (a hint: never faults past the end). Without it, chunks of
 * 128 KiB (8 MiB pages) copied in 10.4-11.0 ms per 128 MiB where the plain copy took 8.4-8.5; with it
 * 7.9-8.3, and 32 KiB chunks 6.8-7.2 against the plain copy's 8.5-8.7. */
#define SOURCE_PREFETCH_NBYTES 2048

/* XXH3's default secret: a parameter of the algorithm (the specification's kSecret). */
static const uint8_t SECRET[SECRET_NBYTES] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

#define PRIME32_1 0x9E3779B1U
#define PRIME32_2 0x85EBCA77U
#define PRIME32_3 0xC2B2AE3DU
#define PRIME64_1 0x9E3779B185EBCA87ULL
#define PRIME64_2 0xC2B2AE3D27D4EB4FULL
#define PRIME64_3 0x165667B19E3779F9ULL
#define PRIME64_4 0x85EBCA77C2B2AE63ULL
#define PRIME64_5 0x27D4EB2F165667C5ULL
#define PRIME_MX1 0x165667919E3779F9ULL

static inline uint64_t read64(const void *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v; /* x86 and the other hosts torch runs on here are little-endian, as the spec reads words */
}

/* One stripe, portable: copied word by word (when ``dst``), each word accumulated as it is stored. */
static inline void stripe_scalar(uint64_t acc[8], uint8_t *dst, const uint8_t *src, const uint8_t *secret) {
    for (int i = 0; i < 8; i++) {
        uint64_t word = read64(src + 8 * i);
        if (dst != NULL) memcpy(dst + 8 * i, &word, 8);
        uint64_t keyed = word ^ read64(secret + 8 * i);
        acc[i ^ 1] += word;
        acc[i] += (keyed & 0xFFFFFFFFULL) * (keyed >> 32);
    }
}

static inline void scramble_scalar(uint64_t acc[8], const uint8_t *secret) {
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= read64(secret + 8 * i);
        acc[i] = a * PRIME32_1;
    }
}

/* ``num`` stripes copied and accumulated, the first being regular stripe ``done`` of the page (its secret
 * offset), the accumulators scrambled after each 16th (a block's end). */
static void stripes_scalar(uint64_t acc[8], uint8_t *dst, const uint8_t *src, size_t done, size_t num) {
    for (size_t j = 0; j < num; j++) {
        size_t k = (done + j) % STRIPES_PER_BLOCK;
        __builtin_prefetch(src + j * STRIPE_NBYTES + SOURCE_PREFETCH_NBYTES, 0);
        stripe_scalar(acc, dst + j * STRIPE_NBYTES, src + j * STRIPE_NBYTES, SECRET + 8 * k);
        if (k == STRIPES_PER_BLOCK - 1) scramble_scalar(acc, SECRET + SECRET_NBYTES - STRIPE_NBYTES);
    }
}

#ifdef XXH3_COPY_AVX2
/* One stripe in two 256-bit halves: loaded once, stored (streamed past the cache when ``stream``), and
 * accumulated from the same registers. */
__attribute__((target("avx2"))) static inline void stripe_avx2(__m256i acc[2], uint8_t *dst, const uint8_t *src,
                                                               const uint8_t *secret, int stream) {
    for (int h = 0; h < 2; h++) {
        __m256i word = _mm256_loadu_si256((const __m256i *)(src + 32 * h));
        if (stream) {
            _mm256_stream_si256((__m256i *)(dst + 32 * h), word);
        } else {
            _mm256_storeu_si256((__m256i *)(dst + 32 * h), word);
        }
        __m256i keyed = _mm256_xor_si256(word, _mm256_loadu_si256((const __m256i *)(secret + 32 * h)));
        __m256i product = _mm256_mul_epu32(keyed, _mm256_srli_epi64(keyed, 32));
        __m256i swapped = _mm256_shuffle_epi32(word, _MM_SHUFFLE(1, 0, 3, 2)); /* each lane's neighbour */
        acc[h] = _mm256_add_epi64(acc[h], _mm256_add_epi64(product, swapped));
    }
}

__attribute__((target("avx2"))) static inline void scramble_avx2(__m256i acc[2], const uint8_t *secret) {
    const __m256i prime = _mm256_set1_epi32((int)PRIME32_1);
    for (int h = 0; h < 2; h++) {
        __m256i a = _mm256_xor_si256(acc[h], _mm256_srli_epi64(acc[h], 47));
        a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)(secret + 32 * h)));
        __m256i low = _mm256_mul_epu32(a, prime), high = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), prime);
        acc[h] = _mm256_add_epi64(low, _mm256_slli_epi64(high, 32));
    }
}

/* stripes_scalar's work in AVX2; the stores streamed past the cache when ``stream`` (then fenced). */
__attribute__((target("avx2"))) static void stripes_avx2(uint64_t acc64[8], uint8_t *dst, const uint8_t *src,
                                                         size_t done, size_t num, int stream) {
    __m256i acc[2] = {_mm256_loadu_si256((const __m256i *)acc64), _mm256_loadu_si256((const __m256i *)(acc64 + 4))};
    for (size_t j = 0; j < num; j++) {
        size_t k = (done + j) % STRIPES_PER_BLOCK;
        __builtin_prefetch(src + j * STRIPE_NBYTES + SOURCE_PREFETCH_NBYTES, 0);
        stripe_avx2(acc, dst + j * STRIPE_NBYTES, src + j * STRIPE_NBYTES, SECRET + 8 * k, stream);
        if (k == STRIPES_PER_BLOCK - 1) scramble_avx2(acc, SECRET + SECRET_NBYTES - STRIPE_NBYTES);
    }
    if (stream) _mm_sfence(); /* the streamed stores before anything reads the page */
    _mm256_storeu_si256((__m256i *)acc64, acc[0]);
    _mm256_storeu_si256((__m256i *)(acc64 + 4), acc[1]);
}

/* TIERKV_XXH3_COPY_SCALAR=1 takes the portable path on any CPU: the tests check its digests too. */
static int have_avx2(void) {
    static int known = -1;
    if (known < 0) {
        const char *scalar = getenv("TIERKV_XXH3_COPY_SCALAR");
        known = (scalar == NULL || scalar[0] != '1') && __builtin_cpu_supports("avx2");
    }
    return known;
}
#endif

static inline uint64_t fold128(uint64_t a, uint64_t b) {
    __uint128_t product = (__uint128_t)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

void xxh3_copy_start(Xxh3Copy *state, size_t n) {
    const uint64_t init[8] = {PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1};
    memcpy(state->acc, init, sizeof init);
    state->regular = (n - 1) / STRIPE_NBYTES; /* the last 64 bytes are the last stripe's, whatever else */
    state->done = 0;
}

/* Streamed stores only for parts this large: their fence costs more than a small part's cache misses. */
#define STREAM_MIN_NBYTES 4096

void xxh3_copy_part(Xxh3Copy *state, void *dst, const void *src, size_t nbytes) {
    size_t num = nbytes / STRIPE_NBYTES, left = state->regular - state->done;
    size_t hashed = num < left ? num : left;
#ifdef XXH3_COPY_AVX2
    if (have_avx2()) {
        int stream = nbytes >= STREAM_MIN_NBYTES && ((uintptr_t)dst & 31) == 0;
        stripes_avx2(state->acc, dst, src, state->done, hashed, stream);
    } else {
        stripes_scalar(state->acc, dst, src, state->done, hashed);
    }
#else
    stripes_scalar(state->acc, dst, src, state->done, hashed);
#endif
    state->done += hashed;
    memcpy((uint8_t *)dst + hashed * STRIPE_NBYTES, (const uint8_t *)src + hashed * STRIPE_NBYTES,
           nbytes - hashed * STRIPE_NBYTES);
}

uint64_t xxh3_copy_finish(Xxh3Copy *state, const void *page, size_t n) {
    uint64_t *acc = state->acc;
    /* the last stripe, read back from the page: the digest stays that of the bytes stored */
    stripe_scalar(acc, NULL, (const uint8_t *)page + n - STRIPE_NBYTES, SECRET + LAST_STRIPE_SECRET);
    uint64_t h = (uint64_t)n * PRIME64_1;
    for (int i = 0; i < 4; i++) {
        h += fold128(acc[2 * i] ^ read64(SECRET + MERGE_SECRET + 16 * i),
                     acc[2 * i + 1] ^ read64(SECRET + MERGE_SECRET + 16 * i + 8));
    }
    h ^= h >> 37;
    h *= PRIME_MX1;
    return h ^ (h >> 32);
}

uint64_t copy_xxh3_long(void *dst, const void *src, size_t n) {
    Xxh3Copy state;
    size_t whole = n & ~(size_t)(STRIPE_NBYTES - 1);
    xxh3_copy_start(&state, n);
    xxh3_copy_part(&state, dst, src, whole);
    memcpy((uint8_t *)dst + whole, (const uint8_t *)src + whole, n - whole);
    return xxh3_copy_finish(&state, dst, n);
}
