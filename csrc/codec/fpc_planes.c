/*
 * Byte planes (see fastpersist/codec/planes.py): one loop per unit size and
 * direction, without branches inside, so the compiler vectorizes them.
 */
#include "fpc.h"

#include <string.h>

#define ROTL(v, bits) ((v) << 1 | (v) >> ((bits) - 1))
#define ROTR(v, bits) ((v) >> 1 | (v) << ((bits) - 1))

#define SPLIT(T, BYTES)                                                                    \
    static void split_##BYTES(const uint8_t *raw, size_t units, int rotate, uint8_t *out)  \
    {                                                                                      \
        for (size_t i = 0; i < units; i++) {                                               \
            T v;                                                                           \
            memcpy(&v, raw + (BYTES) * i, sizeof v);                                       \
            if (rotate)                                                                    \
                v = (T)ROTL(v, 8 * (BYTES));                                               \
            for (unsigned j = 0; j < (BYTES); j++)                                         \
                out[j * units + i] = (uint8_t)(v >> (8 * j));                              \
        }                                                                                  \
    }

#define MERGE(T, BYTES)                                                                    \
    static void merge_##BYTES(const uint8_t *const *planes, size_t units, int rotate,      \
                              uint8_t *raw)                                                \
    {                                                                                      \
        for (size_t i = 0; i < units; i++) {                                               \
            T v = 0;                                                                       \
            for (unsigned j = 0; j < (BYTES); j++)                                         \
                v |= (T)((T)planes[j][i] << (8 * j));                                      \
            if (rotate)                                                                    \
                v = (T)ROTR(v, 8 * (BYTES));                                               \
            memcpy(raw + (BYTES) * i, &v, sizeof v);                                       \
        }                                                                                  \
    }

SPLIT(uint16_t, 2)
SPLIT(uint32_t, 4)
SPLIT(uint64_t, 8)
MERGE(uint16_t, 2)
MERGE(uint32_t, 4)
MERGE(uint64_t, 8)

void fpc_split(const uint8_t *raw, size_t units, unsigned unit, int rotate, uint8_t *out)
{
    /* `rotate` is hoisted out of the loops by the compiler (unswitching) at -O3. */
    switch (unit) {
    case 2: split_2(raw, units, rotate, out); break;
    case 4: split_4(raw, units, rotate, out); break;
    case 8: split_8(raw, units, rotate, out); break;
    default: memcpy(out, raw, units); break; /* one plane: the bytes as they are */
    }
}

void fpc_merge(const uint8_t *const *planes, size_t units, unsigned unit, int rotate,
               uint8_t *raw)
{
    switch (unit) {
    case 2: merge_2(planes, units, rotate, raw); break;
    case 4: merge_4(planes, units, rotate, raw); break;
    case 8: merge_8(planes, units, rotate, raw); break;
    default: memcpy(raw, planes[0], units); break;
    }
}
