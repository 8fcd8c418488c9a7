/*
 * CRC32C (Castagnoli), the checksum stored for every tensor in a checkpoint.
 *
 * On x86-64 with SSE4.2 the crc32 instruction runs three independent streams
 * at once (it has a latency of 3 cycles and a throughput of 1), and the three
 * partial CRCs are joined with the GF(2) shift below. Where the CPU has
 * AVX-512 carry-less multiplication (VPCLMULQDQ), buffers of 1 KiB and more
 * are folded 256 bytes at a time instead (four 512-bit lanes, 3x the crc32
 * instruction's speed: that is read bandwidth here), and the crc32
 * instruction reduces what is left. Elsewhere a slicing-by-8 table does the
 * work. fp_crc32c_combine() joins the CRCs of
 * consecutive pieces, which is what lets several threads checksum one
 * tensor's blocks independently.
 */
#include "fp_engine.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define POLY 0x82f63b78u /* CRC32C, reflected */

static uint32_t table[8][256];
static uint32_t x2n_table[32];
static int have_sse42;
static int have_vpclmul;

/* a * b modulo the CRC polynomial, both reflected (bit 31 is x^0). */
static uint32_t multmodp(uint32_t a, uint32_t b)
{
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0)
                break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

/* x^(n * 2^k) modulo the polynomial. */
static uint32_t x2nmodp(uint64_t n, unsigned k)
{
    uint32_t p = 1u << 31;
    while (n) {
        if (n & 1)
            p = multmodp(x2n_table[k & 31], p);
        n >>= 1;
        k++;
    }
    return p;
}

uint32_t fp_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2)
{
    return multmodp(x2nmodp(len2, 3), crc1) ^ crc2;
}

/* Raw register update, no pre/post inversion. */
static uint32_t crc_sw(uint32_t crc, const unsigned char *p, size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        crc = table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc;
        crc = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^
              table[5][(w >> 16) & 0xff] ^ table[4][(w >> 24) & 0xff] ^
              table[3][(w >> 32) & 0xff] ^ table[2][(w >> 40) & 0xff] ^
              table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        crc = table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return crc;
}

#if defined(__x86_64__)
#include <nmmintrin.h>

#define STRIPE 4096 /* bytes per stream in the three-way loop */
static uint32_t shift_stripe;   /* x^(8*STRIPE): moves a CRC past one stripe */
static uint32_t shift_2stripes; /* x^(16*STRIPE) */

__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const unsigned char *p,
                                                         size_t n)
{
    uint64_t c0 = crc;
    while (n && ((uintptr_t)p & 7)) {
        c0 = _mm_crc32_u8((uint32_t)c0, *p++);
        n--;
    }
    while (n >= 3 * STRIPE) {
        uint64_t c1 = 0, c2 = 0;
        const unsigned char *end = p + STRIPE;
        do {
            uint64_t a, b, c;
            memcpy(&a, p, 8);
            memcpy(&b, p + STRIPE, 8);
            memcpy(&c, p + 2 * STRIPE, 8);
            c0 = _mm_crc32_u64(c0, a);
            c1 = _mm_crc32_u64(c1, b);
            c2 = _mm_crc32_u64(c2, c);
            p += 8;
        } while (p < end);
        c0 = multmodp(shift_2stripes, (uint32_t)c0) ^ multmodp(shift_stripe, (uint32_t)c1) ^
             (uint32_t)c2;
        p += 2 * STRIPE;
        n -= 3 * STRIPE;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c0 = _mm_crc32_u64(c0, w);
        p += 8;
        n -= 8;
    }
    while (n--)
        c0 = _mm_crc32_u8((uint32_t)c0, *p++);
    return (uint32_t)c0;
}

/*
 * Folding. A 16-byte block A of the message, as a polynomial with its first
 * bit the highest term (the reflected order: bit j of the little-endian
 * 128-bit value is x^(127-j)), is A = H x^64 + L with H its low quadword and L
 * its high one. D bits later in the message it counts as A x^D, congruent
 * (mod P) to H (x^(D+32) mod P) x^32 + L (x^(D-32) mod P) x^32: two carry-less
 * products of a quadword by a 33-bit constant, which land, shifted by the
 * x^32, exactly on the 128 bits of the block D bits later, and are XORed into
 * it. The constants are the reflected residues shifted left once (bit i of
 * the constant is x^(32-i)), computed at start-up from x2nmodp: fold[d][0]
 * multiplies low quadwords, fold[d][1] high ones.
 */
enum { FOLD_256, FOLD_64, FOLD_16 };
static uint64_t fold[3][2];

static void fold_constants(int which, uint64_t bits)
{
    fold[which][0] = (uint64_t)x2nmodp(bits + 32, 0) << 1;
    fold[which][1] = (uint64_t)x2nmodp(bits - 32, 0) << 1;
}

#include <immintrin.h>

#define VPCLMUL_TARGET "avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2"

__attribute__((target(VPCLMUL_TARGET))) static inline __m512i fold512(__m512i x, __m512i k,
                                                                       __m512i next)
{
    __m512i lo = _mm512_clmulepi64_epi128(x, k, 0x00);
    __m512i hi = _mm512_clmulepi64_epi128(x, k, 0x11);
    return _mm512_ternarylogic_epi64(lo, hi, next, 0x96); /* lo ^ hi ^ next */
}

__attribute__((target(VPCLMUL_TARGET))) static inline __m128i fold128(__m128i x, __m128i k,
                                                                      __m128i next)
{
    __m128i lo = _mm_clmulepi64_si128(x, k, 0x00);
    __m128i hi = _mm_clmulepi64_si128(x, k, 0x11);
    return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

/* Raw register update of n >= 256 bytes. */
__attribute__((target(VPCLMUL_TARGET))) static uint32_t crc_vpclmul(uint32_t crc,
                                                                     const unsigned char *p,
                                                                     size_t n)
{
    const __m512i k256 = _mm512_set_epi64(
        (long long)fold[FOLD_256][1], (long long)fold[FOLD_256][0],
        (long long)fold[FOLD_256][1], (long long)fold[FOLD_256][0],
        (long long)fold[FOLD_256][1], (long long)fold[FOLD_256][0],
        (long long)fold[FOLD_256][1], (long long)fold[FOLD_256][0]);
    const __m512i k64 = _mm512_set_epi64(
        (long long)fold[FOLD_64][1], (long long)fold[FOLD_64][0],
        (long long)fold[FOLD_64][1], (long long)fold[FOLD_64][0],
        (long long)fold[FOLD_64][1], (long long)fold[FOLD_64][0],
        (long long)fold[FOLD_64][1], (long long)fold[FOLD_64][0]);
    const __m128i k16 = _mm_set_epi64x((long long)fold[FOLD_16][1],
                                       (long long)fold[FOLD_16][0]);
    /* The register's value enters as the XOR of the first four bytes. */
    __m512i x0 = _mm512_xor_si512(_mm512_loadu_si512(p),
                                  _mm512_castsi128_si512(_mm_cvtsi32_si128((int)crc)));
    __m512i x1 = _mm512_loadu_si512(p + 64);
    __m512i x2 = _mm512_loadu_si512(p + 128);
    __m512i x3 = _mm512_loadu_si512(p + 192);
    p += 256;
    n -= 256;
    while (n >= 256) {
        x0 = fold512(x0, k256, _mm512_loadu_si512(p));
        x1 = fold512(x1, k256, _mm512_loadu_si512(p + 64));
        x2 = fold512(x2, k256, _mm512_loadu_si512(p + 128));
        x3 = fold512(x3, k256, _mm512_loadu_si512(p + 192));
        p += 256;
        n -= 256;
    }
    x1 = fold512(x0, k64, x1);
    x2 = fold512(x1, k64, x2);
    x3 = fold512(x2, k64, x3);
    __m128i a = _mm512_extracti32x4_epi32(x3, 0);
    a = fold128(a, k16, _mm512_extracti32x4_epi32(x3, 1));
    a = fold128(a, k16, _mm512_extracti32x4_epi32(x3, 2));
    a = fold128(a, k16, _mm512_extracti32x4_epi32(x3, 3));
    /* The 16 bytes left stand for all that came before: the crc32
     * instruction, from 0, reduces them; the tail continues from there. */
    uint64_t c = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(a));
    c = _mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(a, 1));
    return crc_hw((uint32_t)c, p, n);
}

#define VPCLMUL_MIN 1024 /* below this the set-up costs more than it saves */
#endif

void fp_crc32c_init(void)
{
    for (unsigned i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table[0][i] = c;
    }
    for (unsigned i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            table[t][i] = table[0][table[t - 1][i] & 0xff] ^ (table[t - 1][i] >> 8);
    uint32_t p = 1u << 30; /* x^1 */
    x2n_table[0] = p;
    for (int n = 1; n < 32; n++)
        x2n_table[n] = p = multmodp(p, p);
#if defined(__x86_64__)
    shift_stripe = x2nmodp(STRIPE, 3);
    shift_2stripes = x2nmodp(2 * STRIPE, 3);
    __builtin_cpu_init();
    have_sse42 = __builtin_cpu_supports("sse4.2");
    fold_constants(FOLD_256, 256 * 8);
    fold_constants(FOLD_64, 64 * 8);
    fold_constants(FOLD_16, 16 * 8);
    have_vpclmul = have_sse42 && __builtin_cpu_supports("avx512f") &&
                   __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("pclmul") &&
                   getenv("FASTPERSIST_CRC32C_NO_VPCLMUL") == NULL;
#endif
}

const char *fp_crc32c_impl(void)
{
    return have_vpclmul ? "avx512-vpclmulqdq" : have_sse42 ? "sse4.2" : "slice-by-8";
}

uint32_t fp_crc32c(uint32_t crc, const void *buf, size_t len)
{
    uint32_t c = ~crc;
#if defined(__x86_64__)
    if (have_vpclmul && len >= VPCLMUL_MIN)
        return ~crc_vpclmul(c, buf, len);
    if (have_sse42)
        return ~crc_hw(c, buf, len);
#endif
    return ~crc_sw(c, buf, len);
}
