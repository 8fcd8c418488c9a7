/*
 * CRC32C (Castagnoli), the checksum stored for every tensor in a checkpoint.
 *
 * On x86-64 with SSE4.2 the crc32 instruction runs three independent streams
 * at once (it has a latency of 3 cycles and a throughput of 1), and the three
 * partial CRCs are joined with the GF(2) shift below. Elsewhere a
 * slicing-by-8 table does the work. fp_crc32c_combine() joins the CRCs of
 * consecutive pieces, which is what lets several threads checksum one
 * tensor's blocks independently.
 */
#include "fp_engine.h"

#include <stdint.h>
#include <string.h>

#define POLY 0x82f63b78u /* CRC32C, reflected */

static uint32_t table[8][256];
static uint32_t x2n_table[32];
static int have_sse42;

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
#endif
}

const char *fp_crc32c_impl(void)
{
    return have_sse42 ? "sse4.2" : "slice-by-8";
}

uint32_t fp_crc32c(uint32_t crc, const void *buf, size_t len)
{
    uint32_t c = ~crc;
#if defined(__x86_64__)
    if (have_sse42)
        return ~crc_hw(c, buf, len);
#endif
    return ~crc_sw(c, buf, len);
}
