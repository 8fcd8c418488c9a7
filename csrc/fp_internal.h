/* Declarations shared by the engine's source files; not part of its API. */
#ifndef FP_INTERNAL_H
#define FP_INTERNAL_H

#include "fp_engine.h"

#include <pthread.h>
#include <stdint.h>

#define FP_MAX_THREADS 64

/* First failure of a parallel call, shared by its threads. */
typedef struct {
    pthread_mutex_t lock;
    int err; /* positive errno, 0 while all is well */
    char msg[400];
} fp_status;

/*
 * A piece is the part of one segment that one I/O job handles. Jobs compute
 * piece CRCs independently; the caller then folds them into segment CRCs in
 * piece order with fp_crc32c_combine().
 */
typedef struct {
    char *mem;    /* segment memory for this piece */
    uint64_t off; /* file offset */
    uint64_t len;
    uint64_t seg; /* index of the segment */
    uint32_t crc;
} fp_piece;

void fp_fold_piece_crcs(const fp_piece *pieces, size_t npieces, uint32_t *crcs, size_t nsegs);

/* memcpy that also returns the CRC32C of the bytes (when checksum is set). */
uint32_t fp_copy_with_crc(char *dst, const char *src, uint64_t len, int checksum);
int fp_pwrite_full(int fd, const char *buf, size_t len, uint64_t off);
/* Bytes read (short only at end of file), or -errno. */
int64_t fp_pread_full(int fd, char *buf, size_t len, uint64_t off);
void fp_run_parallel(void *(*fn)(void *), void *arg, unsigned threads);
void fp_fail(fp_status *st, int err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
int fp_failed(fp_status *st);
/* open(2) with O_DIRECT as the mode asks; returns fd or -errno. */
int fp_open_for(const char *path, int flags, fp_direct_mode mode, int *used_direct);

static inline uint64_t fp_round_down(uint64_t x, uint64_t a)
{
    return x - x % a;
}

static inline uint64_t fp_round_up(uint64_t x, uint64_t a)
{
    return fp_round_down(x + a - 1, a);
}

#endif
