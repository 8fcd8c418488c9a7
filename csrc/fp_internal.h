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

/* fp_piece.c: what the read and the write paths share about pieces. */
void fp_fold_piece_crcs(const fp_piece *pieces, size_t npieces, uint32_t *crcs, size_t nsegs);
/* memcpy that also returns the CRC32C of the bytes (when checksum is set). */
uint32_t fp_copy_with_crc(char *dst, const char *src, uint64_t len, int checksum);

int fp_pwrite_full(int fd, const char *buf, size_t len, uint64_t off);
/* Bytes read (short only at end of file), or -errno. */
int64_t fp_pread_full(int fd, char *buf, size_t len, uint64_t off);
void fp_run_parallel(void *(*fn)(void *), void *arg, unsigned threads);
void fp_fail(fp_status *st, int err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
int fp_failed(fp_status *st);
/* openat(2) with O_DIRECT as the mode asks; returns fd or -errno. */
int fp_open_for(int dir_fd, const char *path, int flags, fp_direct_mode mode, int *used_direct);

/*
 * A write cut into blocks of block_size; both backends claim blocks with an
 * atomic add on next_block and assemble each with fp_fill_block().
 */
typedef struct {
    int fd;
    int direct;
    uint64_t size;
    uint64_t block_size;
    uint64_t nblocks;
    fp_piece *pieces;
    size_t npieces;
    size_t *block_first; /* pieces of block k: [block_first[k], block_first[k+1]) */
    uint64_t next_block;
    fp_status st;
} fp_write_job;

/*
 * Copy block k's pieces into buf (block_size bytes), zeros in the gaps,
 * checksumming each piece in the same pass. Returns the bytes to write at
 * k * block_size: the block, rounded up to FP_ALIGN under O_DIRECT.
 */
uint64_t fp_fill_block(fp_write_job *job, uint64_t k, char *buf);

/*
 * Where block k's bytes are to be written from: the caller's own memory when
 * it is laid out as the file (contiguous, aligned, no padding), else `buf`
 * after fp_fill_block. *wlen receives the bytes to write. NULL when reading
 * the caller's memory faulted (a shared-memory segment truncated under us).
 */
const char *fp_block_source(fp_write_job *job, uint64_t k, char *buf, uint64_t *wlen);

/*
 * Run fn(arg), turning a SIGBUS raised by its reads into a return of -EFAULT
 * (fp_fault.c). fn must own no locks or allocations a jump out would leak.
 */
int fp_guarded(void (*fn)(void *), void *arg);

/* One planned read: a piece read in place, or a group of bounce pieces. */
typedef struct {
    int bounce;      /* 0: one piece read in place; 1: a group of bounce pieces */
    uint64_t off;    /* aligned file offset of the I/O */
    uint64_t len;
    size_t first;    /* direct: index into pieces; bounce: index into bounce_idx */
    size_t count;
} fp_read_io;

typedef struct {
    int fd;
    int checksum;
    uint64_t bounce_size; /* bytes of a bounce buffer: the longest bounce io */
    fp_piece *pieces;
    size_t npieces;
    size_t *bounce_idx; /* bounce pieces, in file order */
    size_t nbounce;
    fp_read_io *ios;
    size_t nios;
    size_t next_io; /* claimed with an atomic add */
    fp_status st;
    /* Buffered reads: thread t reads ios [stream_first[t], stream_first[t+1])
     * in order through its own descriptor of `path`. */
    const char *path;
    size_t *stream_first;
    unsigned nstreams;
    unsigned next_stream;
} fp_read_job;

/*
 * Finish an io whose read returned `got` bytes into buf (the piece's own
 * memory for an in-place io, a bounce buffer otherwise): check for a short
 * file, copy bounce pieces out, checksum.
 */
void fp_read_io_done(fp_read_job *job, const fp_read_io *io, const char *buf, uint64_t got);

/* io_uring (fp_uring.c). A ring belongs to the thread that submits to it. */
typedef struct fp_ring fp_ring;

/*
 * The ring for a call with this backend and queue depth, or *ring = NULL
 * where the thread pool is to be used (POOL, or AUTO where io_uring is
 * refused). Fails only when URING is forced and refused.
 */
int fp_ring_for(fp_backend backend, unsigned queue_depth, fp_ring **ring);
void fp_ring_close(fp_ring *ring);
/* Run the job on `threads` threads; the caller's thread uses `ring`, others open their own. */
void fp_uring_write(fp_write_job *job, fp_ring *ring, unsigned threads, unsigned queue_depth);
void fp_uring_read(fp_read_job *job, fp_ring *ring, unsigned threads, unsigned queue_depth);

static inline uint64_t fp_min(uint64_t a, uint64_t b)
{
    return a < b ? a : b;
}

static inline uint64_t fp_round_down(uint64_t x, uint64_t a)
{
    return x - x % a;
}

static inline uint64_t fp_round_up(uint64_t x, uint64_t a)
{
    return fp_round_down(x + a - 1, a);
}

#endif
