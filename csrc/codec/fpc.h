/*
 * The codec's C core (fastpersist._codec): byte planes and a fast encoder of
 * literals-only zstd frames. Everything here is pure computation on caller
 * buffers: no allocation, no I/O, no Python.
 */
#ifndef FPC_H
#define FPC_H

#include <stddef.h>
#include <stdint.h>

/* Bytes past a frame's end that fpc_zstd_literals may scribble on: dst must
 * hold at least n + FPC_SLACK bytes for an n-byte plane. */
#define FPC_SLACK 64
/* fpc_zstd_literals' answers besides a frame's size (a frame is never empty). */
#define FPC_NOT_SMALLER ((size_t)0)
#define FPC_UNSUPPORTED ((size_t)-1)

/* Planes of `units` elements of `unit` (1, 2, 4 or 8) bytes: out[j*units + i]
 * is byte j (little-endian) of element i, rotated left one bit first when
 * `rotate` (planes.py says why). fpc_merge is the inverse, from one pointer
 * per plane. */
void fpc_split(const uint8_t *raw, size_t units, unsigned unit, int rotate, uint8_t *out);
void fpc_merge(const uint8_t *const *planes, size_t units, unsigned unit, int rotate,
               uint8_t *raw);

/* The n bytes at src as one zstd frame (RFC 8878) of Huffman-coded literals
 * and no matches, into dst (room for n + FPC_SLACK). Returns the frame's size
 * (< n), FPC_NOT_SMALLER when it would not be smaller than n, or
 * FPC_UNSUPPORTED when a block needs a Huffman table description this
 * encoder could not write: use a general zstd encoder then. */
size_t fpc_zstd_literals(const uint8_t *src, size_t n, uint8_t *dst);

#endif
