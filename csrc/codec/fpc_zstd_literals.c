/*
 * A byte plane as a zstd frame of Huffman-coded literals only (RFC 8878).
 *
 * Why: the exponent plane of trained weights is close to an order-0 source
 * (a few dozen exponents, no long repeats), so what compresses it is the
 * Huffman stage; zstd's match finder costs most of its encoding time there
 * and saves almost nothing. zstd's library has no switch to skip it, so this
 * file writes what zstd itself would write for a block of literals without
 * matches: any zstd decoder reads these frames (the codec decodes them with
 * the `zstandard` package), and files stay what they were.
 *
 * A frame: the magic number, a single-segment header with the 4-byte content
 * size, then one block per 32 KiB of the plane, each one of
 *   - RLE (a single byte value),
 *   - raw (Huffman would not make it smaller),
 *   - compressed: a literals section (Huffman, 4 streams, the table's weights
 *     FSE-coded or as direct 4-bit values, whichever is shorter) and an empty
 *     sequences section.
 * FPC_UNSUPPORTED is left for weights that neither form can hold (none are
 * known: the tests feed it every symbol range), and the caller then uses
 * zstd's library.
 *
 * The code lengths are Huffman's, limited to 11 bits and made complete
 * (zstd's decoder deduces the last weight from completeness).
 */
#include "fpc.h"

#include <stdlib.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the bit writer below stores little-endian words"
#endif

/* One Huffman table per 32 KiB: the exponents' statistics drift along a tensor, and
 * 32 KiB tables store 0.1-0.4% less than 128 KiB ones (benchmarks/codec.py) at the
 * same speed. zstd blocks may be any size up to 128 KiB. */
#define BLOCK (32u << 10)
#define MAX_BITS 11           /* the format's limit on a literal's code length */
#define MIN_HUFFMAN 1024      /* smaller blocks are stored raw: too little to gain */
#define MAX_DIRECT_SYMBOL 128 /* direct weights describe symbols 0..127, 128 implied */
#define BLOCK_HEADER 3

typedef struct {
    uint16_t code;
    uint8_t len;
} code_t;

static void put_le(uint8_t *p, uint64_t v, unsigned n)
{
    for (unsigned i = 0; i < n; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void histogram(const uint8_t *s, size_t m, uint32_t count[256])
{
    uint32_t c[4][256]; /* four tables: consecutive equal bytes do not wait on each other */
    memset(c, 0, sizeof c);
    size_t i = 0;
    for (; i + 4 <= m; i += 4) {
        c[0][s[i]]++;
        c[1][s[i + 1]]++;
        c[2][s[i + 2]]++;
        c[3][s[i + 3]]++;
    }
    for (; i < m; i++)
        c[0][s[i]]++;
    for (int k = 0; k < 256; k++)
        count[k] = c[0][k] + c[1][k] + c[2][k] + c[3][k];
}

static int by_key(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/*
 * Code lengths for the k >= 2 present symbols of `count`: Huffman's, at most
 * MAX_BITS, with a Kraft sum of exactly 1. Returns the longest length.
 */
static unsigned code_lengths(const uint32_t count[256], uint8_t len[256])
{
    uint64_t key[256]; /* count << 8 | symbol: ascending count, ties by symbol */
    int k = 0;
    for (int s = 0; s < 256; s++)
        if (count[s])
            key[k++] = (uint64_t)count[s] << 8 | (uint64_t)s;
    qsort(key, (size_t)k, sizeof key[0], by_key);

    /* Huffman's tree with two queues: leaves 0..k-1 ascending, then inner nodes in
     * the order made (their weights ascend too). parent[] points up; the root is last. */
    uint32_t w[511];
    int16_t parent[511];
    uint8_t depth[511];
    for (int i = 0; i < k; i++)
        w[i] = (uint32_t)(key[i] >> 8);
    int leaf = 0, inner = k, next = k;
    while (next < 2 * k - 1) {
        int pick[2];
        for (int t = 0; t < 2; t++)
            pick[t] = (leaf < k && (inner >= next || w[leaf] <= w[inner])) ? leaf++ : inner++;
        w[next] = w[pick[0]] + w[pick[1]];
        parent[pick[0]] = parent[pick[1]] = (int16_t)next;
        next++;
    }
    depth[2 * k - 2] = 0;
    for (int i = 2 * k - 3; i >= 0; i--)
        depth[i] = (uint8_t)(depth[parent[i]] + 1);

    /* Limit: clamp, then lengthen the rarest codes shorter than MAX_BITS until the
     * code fits (lengthening l -> l+1 frees cap >> (l+1) of the Kraft sum). */
    const uint32_t cap = 1u << MAX_BITS;
    unsigned l[256];
    uint32_t kraft = 0;
    for (int i = 0; i < k; i++) {
        l[i] = depth[i] > MAX_BITS ? MAX_BITS : depth[i];
        kraft += cap >> l[i];
    }
    while (kraft > cap)
        for (int i = 0; i < k && kraft > cap; i++)
            if (l[i] < MAX_BITS) {
                l[i]++;
                kraft -= cap >> l[i];
            }
    /* Complete: shorten the most frequent code that still fits (shortening l -> l-1
     * takes cap >> l). One always does: the deficit is a multiple of the share of a
     * longest code, and that code is longer than 1 bit when k >= 2. */
    while (kraft < cap) {
        uint32_t deficit = cap - kraft;
        for (int i = k - 1; i >= 0; i--)
            if (l[i] > 1 && (cap >> l[i]) <= deficit) {
                kraft += cap >> l[i];
                l[i]--;
                break;
            }
    }
    unsigned longest = 0;
    memset(len, 0, 256);
    for (int i = 0; i < k; i++) {
        len[key[i] & 0xff] = (uint8_t)l[i];
        if (l[i] > longest)
            longest = l[i];
    }
    return longest;
}

/* zstd's canonical codes: the longest codes take the lowest values, and codes of
 * one length ascend with the symbol. */
static void assign_codes(const uint8_t len[256], unsigned longest, code_t code[256])
{
    uint32_t n_of[MAX_BITS + 1] = {0}, start[MAX_BITS + 1] = {0};
    for (int s = 0; s < 256; s++)
        n_of[len[s]]++;
    for (unsigned b = longest; b > 1; b--)
        start[b - 1] = (start[b] + n_of[b]) >> 1;
    for (int s = 0; s < 256; s++) {
        code[s].len = len[s];
        code[s].code = len[s] ? (uint16_t)start[len[s]]++ : 0;
    }
}

/*
 * zstd's backward bitstreams, Huffman's and FSE's alike: values added low bits
 * first into a 64-bit word, whole bytes stored as they fill, and a 1 bit after
 * the last value marks the end (the decoder reads from there backwards).
 * bw_flush stores a whole 8-byte word: 8 bytes past what is written must be
 * writable. After a flush at most 7 bits wait, so 57 more fit.
 */
typedef struct {
    uint8_t *p;
    uint64_t acc;
    unsigned bits;
} bitw_t;

static inline void bw_add(bitw_t *w, uint64_t v, unsigned nbits) /* v < 2^nbits */
{
    w->acc |= v << w->bits;
    w->bits += nbits;
}

static inline void bw_flush(bitw_t *w)
{
    unsigned nbytes = w->bits >> 3;
    memcpy(w->p, &w->acc, 8);
    w->p += nbytes;
    w->acc = nbytes ? w->acc >> (8 * nbytes) : w->acc; /* nbytes < 8: bits <= 63 */
    w->bits &= 7;
}

/* The end mark, the last bytes out; the stream's size from `start`. */
static size_t bw_close(bitw_t *w, const uint8_t *start)
{
    bw_add(w, 1, 1);
    bw_flush(w);
    return (size_t)(w->p - start) + (w->bits ? 1 : 0);
}

/* One Huffman stream: the symbols in reverse order, each code with its first
 * bit highest (the decoder meets them first to last). */
static size_t encode_stream(const uint8_t *s, size_t n, const code_t *code, uint8_t *out)
{
    bitw_t w = {out, 0, 0};
    size_t i = n;
    while (i >= 5) { /* five 11-bit codes fit after a flush */
        for (unsigned k = 1; k <= 5; k++)
            bw_add(&w, code[s[i - k]].code, code[s[i - k]].len);
        i -= 5;
        bw_flush(&w);
    }
    while (i > 0) {
        i--;
        bw_add(&w, code[s[i]].code, code[s[i]].len);
    }
    bw_flush(&w);
    return bw_close(&w, out);
}

/* Bits a block's literals take with `len`. */
static uint64_t coded_bits(const uint32_t count[256], const uint8_t len[256])
{
    uint64_t b = 0;
    for (int s = 0; s < 256; s++)
        b += (uint64_t)count[s] * len[s];
    return b;
}

/*
 * Huffman weights as zstd's FSE-compressed table description (RFC 8878 4.2.1.2),
 * for blocks whose highest symbol is above what direct weights describe. This
 * follows zstd's reference encoder (FSE_writeNCount, FSE_buildCTable,
 * FSE_compress_usingCTable) step for step: the decoder counts the weights by
 * where the bitstream ends, so the layout must be exactly the reference's.
 * Writes the header byte and the description to out (room for 128 bytes);
 * returns its size, or 0 when the weights cannot be written this way.
 */
#define WEIGHT_LOG 6 /* the accuracy log; the format allows 6 at most for weights */

static unsigned highbit(uint32_t v) { return 31u - (unsigned)__builtin_clz(v); }

typedef struct {
    uint32_t delta_nbits;
    int32_t delta_state;
} fse_tt;

typedef struct {
    uint64_t value;
} fse_state;

static void fse_init(fse_state *st, const uint16_t *table, const fse_tt *tt, unsigned sym)
{
    uint32_t nbits = (tt[sym].delta_nbits + (1u << 15)) >> 16;
    uint64_t v = ((uint64_t)nbits << 16) - tt[sym].delta_nbits;
    st->value = table[(v >> nbits) + (uint64_t)(int64_t)tt[sym].delta_state];
}

static void fse_encode(bitw_t *w, fse_state *st, const uint16_t *table, const fse_tt *tt,
                       unsigned sym)
{
    uint32_t nbits = (uint32_t)((st->value + tt[sym].delta_nbits) >> 16);
    bw_add(w, st->value & ((1u << nbits) - 1), nbits);
    st->value = table[(st->value >> nbits) + (uint64_t)(int64_t)tt[sym].delta_state];
}

/* Two bytes of the table description's bit buffer out. */
static void put16(uint8_t **o, uint32_t *stream)
{
    (*o)[0] = (uint8_t)*stream;
    (*o)[1] = (uint8_t)(*stream >> 8);
    *o += 2;
    *stream >>= 16;
}

/* FSE_writeNCount: the normalized counts of values 0..max_sym, into o (up to end).
 * Returns the bytes written, or 0. */
static size_t write_ncount(const int16_t *norm, unsigned max_sym, uint8_t *o, uint8_t *end)
{
    const int size = 1 << WEIGHT_LOG;
    uint8_t *start_o = o;
    uint32_t stream = WEIGHT_LOG - 5;
    int bitcount = 4;
    int remaining = size + 1, threshold = size, nbits = WEIGHT_LOG + 1;
    unsigned sym = 0;
    int previous0 = 0;
    while (sym <= max_sym && remaining > 1) {
        if (previous0) { /* a run of zero counts: 2-bit repeat codes */
            unsigned start = sym;
            while (sym <= max_sym && !norm[sym])
                sym++;
            if (sym > max_sym)
                return 0;
            while (sym >= start + 24) {
                start += 24;
                stream += 0xFFFFu << bitcount;
                put16(&o, &stream);
            }
            while (sym >= start + 3) {
                start += 3;
                stream += 3u << bitcount;
                bitcount += 2;
            }
            stream += (sym - start) << bitcount;
            bitcount += 2;
            if (bitcount > 16) {
                put16(&o, &stream);
                bitcount -= 16;
            }
        }
        int c = norm[sym++];
        int max = (2 * threshold - 1) - remaining;
        remaining -= c < 0 ? -c : c;
        c++;
        if (c >= threshold)
            c += max;
        stream += (uint32_t)c << bitcount;
        bitcount += nbits;
        bitcount -= (c < max);
        previous0 = (c == 1);
        if (remaining < 1)
            return 0;
        while (remaining < threshold) {
            nbits--;
            threshold >>= 1;
        }
        if (bitcount > 16) {
            put16(&o, &stream);
            bitcount -= 16;
        }
        if (o + 4 > end)
            return 0;
    }
    if (remaining != 1)
        return 0;
    o[0] = (uint8_t)stream;
    o[1] = (uint8_t)(stream >> 8);
    o += (bitcount + 7) / 8;
    return (size_t)(o - start_o);
}

static size_t fse_weights(const uint8_t *wt, unsigned n, uint8_t *out)
{
    const unsigned size = 1u << WEIGHT_LOG;
    unsigned count[16] = {0}, max_sym = 0, present = 0;
    for (unsigned i = 0; i < n; i++)
        count[wt[i]]++;
    for (unsigned s = 0; s < 16; s++)
        if (count[s]) {
            max_sym = s;
            present++;
        }
    if (present < 2 || n <= 2)
        return 0;
    /* Normalize to `size`: one cell for each present value, the rest in
     * proportion, what rounding leaves to the most frequent. */
    int16_t norm[16] = {0};
    unsigned given = 0, top = 0;
    for (unsigned s = 0; s <= max_sym; s++)
        if (count[s]) {
            norm[s] = (int16_t)(1 + (uint64_t)count[s] * (size - present) / n);
            given += (unsigned)norm[s];
            if (count[s] > count[top])
                top = s;
        }
    norm[top] = (int16_t)(norm[top] + (int)(size - given));

    uint8_t *p = out + 1; /* out[0]: the header byte, the description's size */
    size_t head = write_ncount(norm, max_sym, p, out + 128);
    if (head == 0)
        return 0;
    bitw_t w = {p + head, 0, 0};
    const uint8_t *end = out + 128 - 8; /* where a flush may store its word */
    /* FSE_buildCTable: spread the values over the cells, then each value's
     * states and transforms. */
    uint16_t table[1u << WEIGHT_LOG];
    fse_tt tt[16];
    {
        uint8_t cell[1u << WEIGHT_LOG];
        unsigned step = (size >> 1) + (size >> 3) + 3, pos = 0, cumul[17];
        cumul[0] = 0;
        for (unsigned s = 0; s <= max_sym; s++) {
            cumul[s + 1] = cumul[s] + (unsigned)norm[s];
            for (int i = 0; i < norm[s]; i++) {
                cell[pos] = (uint8_t)s;
                pos = (pos + step) & (size - 1);
            }
        }
        for (unsigned u = 0; u < size; u++)
            table[cumul[cell[u]]++] = (uint16_t)(size + u);
        unsigned total = 0;
        for (unsigned s = 0; s <= max_sym; s++) {
            if (norm[s] == 0) {
                tt[s].delta_nbits = ((WEIGHT_LOG + 1) << 16) - size;
                tt[s].delta_state = 0;
            } else if (norm[s] == 1) {
                tt[s].delta_nbits = (WEIGHT_LOG << 16) - size;
                tt[s].delta_state = (int32_t)total - 1;
                total++;
            } else {
                uint32_t max_out = WEIGHT_LOG - highbit((uint32_t)norm[s] - 1);
                uint32_t min_plus = (uint32_t)norm[s] << max_out;
                tt[s].delta_nbits = (max_out << 16) - min_plus;
                tt[s].delta_state = (int32_t)total - norm[s];
                total += (unsigned)norm[s];
            }
        }
    }
    /* FSE_compress_usingCTable: two states, the weights backwards; a flush
     * after at most four values (24 bits). */
    const uint8_t *ip = wt + n;
    fse_state s1, s2;
    if (w.p > end)
        return 0;
    if (n & 1) {
        fse_init(&s1, table, tt, *--ip);
        fse_init(&s2, table, tt, *--ip);
        fse_encode(&w, &s1, table, tt, *--ip);
        bw_flush(&w);
    } else {
        fse_init(&s2, table, tt, *--ip);
        fse_init(&s1, table, tt, *--ip);
    }
    if (w.p > end)
        return 0;
    if ((n - 2) & 2) {
        fse_encode(&w, &s2, table, tt, *--ip);
        fse_encode(&w, &s1, table, tt, *--ip);
        bw_flush(&w);
    }
    while (ip > wt) {
        if (w.p > end)
            return 0;
        fse_encode(&w, &s2, table, tt, *--ip);
        fse_encode(&w, &s1, table, tt, *--ip);
        fse_encode(&w, &s2, table, tt, *--ip);
        fse_encode(&w, &s1, table, tt, *--ip);
        bw_flush(&w);
    }
    if (w.p > end)
        return 0;
    bw_add(&w, s2.value & (size - 1), WEIGHT_LOG);
    bw_add(&w, s1.value & (size - 1), WEIGHT_LOG);
    bw_flush(&w);
    if (w.p > end)
        return 0;
    size_t size_out = bw_close(&w, p);
    if (size_out >= 128)
        return 0;
    out[0] = (uint8_t)size_out;
    return 1 + size_out;
}

static size_t raw_block(const uint8_t *src, size_t m, int last, uint8_t *dst)
{
    put_le(dst, (uint64_t)last | 0u << 1 | (uint64_t)m << 3, BLOCK_HEADER);
    memcpy(dst + BLOCK_HEADER, src, m);
    return BLOCK_HEADER + m;
}

/*
 * One compressed block of m >= MIN_HUFFMAN literals whose highest symbol is
 * `top`, into dst; returns its size, or 0 when its weights cannot be written.
 */
static size_t huffman_block(const uint8_t *src, size_t m, int last, const uint8_t len[256],
                            unsigned longest, unsigned top, uint8_t *dst)
{
    code_t code[256];
    assign_codes(len, longest, code);

    /* The literals section goes after the block header and a 5-byte literals header
     * at most; a 4-byte header moves it back one byte at the end. */
    uint8_t *lit = dst + BLOCK_HEADER + 5, *p = lit;
    /* The weights of symbols 0..top-1; top's is implied. */
    uint8_t weight[256];
    for (unsigned s = 0; s < top; s++)
        weight[s] = (uint8_t)(len[s] ? longest + 1 - len[s] : 0);
    /* FSE-coded weights where they are shorter (as zstd's encoder chooses), direct
     * 4-bit weights otherwise; above MAX_DIRECT_SYMBOL, FSE or nothing. */
    uint8_t coded[128 + 8];
    size_t described = fse_weights(weight, top, coded);
    if (top <= MAX_DIRECT_SYMBOL && (described == 0 || described >= 1 + (top + 1) / 2)) {
        *p++ = (uint8_t)(127 + top);
        for (unsigned s = 0; s < top; s += 2)
            *p++ = (uint8_t)(weight[s] << 4 | (s + 1 < top ? weight[s + 1] : 0));
    } else if (described) {
        memcpy(p, coded, described);
        p += described;
    } else {
        return 0;
    }
    uint8_t *jump = p;
    p += 6;
    size_t q = (m + 3) / 4;
    for (unsigned t = 0; t < 4; t++) {
        size_t lo = t * q, n = t < 3 ? q : m - 3 * q;
        size_t size = encode_stream(src + lo, n, code, p);
        if (t < 3)
            put_le(jump + 2 * t, size, 2);
        p += size;
    }
    size_t lit_size = (size_t)(p - lit);
    *p++ = 0; /* sequences section: no sequences */

    /* Literals header: type 2 (compressed), size format 2 (14-bit sizes, 4 bytes) or
     * 3 (18-bit sizes, 5 bytes), both with four streams. */
    unsigned head;
    if (m < (1u << 14) && lit_size < (1u << 14)) {
        head = 4;
        memmove(lit - 1, lit, (size_t)(p - lit));
        p--;
        lit--;
        put_le(lit - head, 2u | 2u << 2 | (uint64_t)m << 4 | (uint64_t)lit_size << 18, head);
    } else {
        head = 5;
        put_le(lit - head, 2u | 3u << 2 | (uint64_t)m << 4 | (uint64_t)lit_size << 22, head);
    }
    size_t body = (size_t)(p - (lit - head));
    put_le(dst, (uint64_t)last | 2u << 1 | (uint64_t)body << 3, BLOCK_HEADER);
    return BLOCK_HEADER + body;
}

size_t fpc_zstd_literals(const uint8_t *src, size_t n, uint8_t *dst)
{
    if (n == 0 || n > UINT32_MAX)
        return FPC_NOT_SMALLER;
    /* Magic; frame header descriptor: 4-byte content size, single segment, no
     * checksum, no dictionary; the content size. */
    static const uint8_t magic[4] = {0x28, 0xb5, 0x2f, 0xfd};
    memcpy(dst, magic, 4);
    dst[4] = 2u << 6 | 1u << 5;
    put_le(dst + 5, n, 4);
    size_t pos = 9;

    for (size_t off = 0; off < n; off += BLOCK) {
        size_t m = n - off < BLOCK ? n - off : BLOCK;
        int last = off + m == n;
        const uint8_t *s = src + off;
        uint32_t count[256];
        histogram(s, m, count);
        unsigned distinct = 0, top = 0;
        for (unsigned c = 0; c < 256; c++)
            if (count[c]) {
                distinct++;
                top = c;
            }
        if (distinct == 1) { /* RLE: one byte, repeated m times */
            if (pos + BLOCK_HEADER + 1 >= n)
                return FPC_NOT_SMALLER;
            put_le(dst + pos, (uint64_t)last | 1u << 1 | (uint64_t)m << 3, BLOCK_HEADER);
            dst[pos + BLOCK_HEADER] = s[0];
            pos += BLOCK_HEADER + 1;
            continue;
        }
        size_t size = m + 1; /* what the Huffman block would take: too much by default */
        uint8_t len[256];
        unsigned longest = 0;
        if (m >= MIN_HUFFMAN) {
            longest = code_lengths(count, len);
            /* block and literals headers, the table, jump table, streams, end marks */
            size = BLOCK_HEADER + 5 + 1 + (top + 1) / 2 + 6 +
                   (size_t)((coded_bits(count, len) + 7 * 4) / 8) + 4 + 1;
        }
        /* The low mantissa bytes of trained weights are random: when the first block
         * of a long plane gains under 2%, so will the rest. */
        if (off == 0 && n >= 2 * BLOCK && size > m - m / 50)
            return FPC_NOT_SMALLER;
        if (size >= m) {
            if (pos + BLOCK_HEADER + m >= n)
                return FPC_NOT_SMALLER;
            pos += raw_block(s, m, last, dst + pos);
            continue;
        }
        if (top > MAX_DIRECT_SYMBOL)
            size += 128 - (top + 1) / 2; /* FSE-coded weights: up to 127 bytes */
        if (pos + size >= n)
            return FPC_NOT_SMALLER;
        size_t written = huffman_block(s, m, last, len, longest, top, dst + pos);
        if (written == 0)
            return FPC_UNSUPPORTED;
        pos += written;
    }
    return pos < n ? pos : FPC_NOT_SMALLER;
}
