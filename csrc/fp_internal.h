/*
 * What the engine's source files share; not part of its API (fp_engine.h is).
 *
 * The files are layers, and a file calls functions of lower layers only, never
 * of its own layer or a higher one (tests/test_c_layout.py fails otherwise):
 *
 *   binding        fp_module.c                   Python objects <-> fp_engine.h
 *   entry points   fp_write.c     fp_read.c      check, open, plan, pick a backend, fsync
 *                  fp_dir.c                      directory fsync, exchange, openat2
 *                  fp_gather.c                   a snapshot's batched memcpy
 *   backends       fp_pool.c      fp_uring.c     keep I/Os in flight: threads or io_uring
 *   jobs           fp_write_job.c fp_read_job.c  plans; fill a block, finish a read (CRCs)
 *   shared         fp_util.c  fp_fault.c  fp_piece.c  fp_ring.c
 *                                                errors, buffers, threads, SIGBUS guard,
 *                                                pieces, one io_uring
 *   checksum       fp_crc32c.c
 *
 * A job knows what each I/O holds and never how it is issued; a backend knows
 * how to keep I/Os in flight and never what they hold. The declarations below
 * come bottom-up in the same order.
 *
 * Threading, for every job: the entry point builds the job on its own thread.
 * A backend runs it on threads that it joins before it returns (fp_run_parallel),
 * so everything the workers wrote is visible to the entry point afterwards.
 * While it runs, workers share only the claim counters (next_block, next_io,
 * next_stream: atomic adds) and st (fp_fail, locked); every other field is
 * read-only, except a piece's crc, written by the one thread that claimed the
 * block or io holding that piece.
 *
 * Memory: a piece's mem points into a caller's segment, which the caller of
 * fp_write_file/fp_read_file keeps alive and unchanged for the call
 * (fp_engine.h). Nothing here keeps such a pointer after the call returns.
 */
#ifndef FP_INTERNAL_H
#define FP_INTERNAL_H

#include "fp_engine.h"

#include <pthread.h>
#include <stdint.h>

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

/* ---- shared: fp_util.c --------------------------------------------------- */

#define FP_MAX_THREADS 64

/*
 * First failure of a parallel call, shared by its threads. The job's owner
 * initialises lock before the run and destroys it after; err and msg are read
 * by the owner only after the run's threads are joined.
 */
typedef struct {
    pthread_mutex_t lock;
    int err; /* positive errno, 0 while all is well */
    char msg[400];
} fp_status;

/* Record a failure from any thread; only the first is kept (later ones are
 * usually its consequences). fp_failed is a cheap check between I/Os. */
void fp_fail(fp_status *st, int err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
int fp_failed(fp_status *st);

/*
 * Blocking pwrite/pread of all len bytes, resumed after short transfers and
 * EINTR. buf is used only during the call (aligned, under O_DIRECT). Any thread.
 * fp_pwrite_full: 0 or -errno. fp_pread_full: bytes read (short only at end of
 * file), or -errno.
 */
int fp_pwrite_full(int fd, const char *buf, size_t len, uint64_t off);
int64_t fp_pread_full(int fd, char *buf, size_t len, uint64_t off);

/*
 * Run fn(arg) on `threads` threads (at most FP_MAX_THREADS; the calling thread
 * is one of them) and join them all before returning. Fewer threads run where
 * creating one fails, so fn must claim its work rather than count on a share.
 */
void fp_run_parallel(void *(*fn)(void *), void *arg, unsigned threads);

/* openat(2) with O_DIRECT as the mode asks; returns fd or -errno and sets
 * *used_direct. AUTO falls back to buffered where the filesystem refuses it. */
int fp_open_for(int dir_fd, const char *path, int flags, fp_direct_mode mode, int *used_direct);

/* ---- shared: fp_fault.c -------------------------------------------------- */

/*
 * Run fn(arg) on this thread, turning a SIGBUS raised by its reads into a
 * return of -EFAULT. fn must own no locks or allocations a jump out would
 * leak. Any thread: the guard is the calling thread's only, and does not nest.
 */
int fp_guarded(void (*fn)(void *), void *arg);

/* ---- shared: fp_piece.c -------------------------------------------------- */

/*
 * A piece is the part of one segment that one I/O handles. Jobs compute piece
 * CRCs independently; the entry point then folds them into segment CRCs in
 * piece order. mem is the caller's memory (see the top of this file).
 */
typedef struct {
    char *mem;    /* segment memory for this piece */
    uint64_t off; /* file offset */
    uint64_t len;
    uint64_t seg; /* index of the segment */
    uint32_t crc;
} fp_piece;

/* memcpy that also returns the CRC32C of the bytes (when checksum is set).
 * Reads src and writes dst only during the call; any thread. */
uint32_t fp_copy_with_crc(char *dst, const char *src, uint64_t len, int checksum);

/* crcs[s] = CRC32C of segment s, from the CRCs of its pieces (in file order).
 * On the owner's thread, after the run; crcs holds nsegs entries. */
void fp_fold_piece_crcs(const fp_piece *pieces, size_t npieces, uint32_t *crcs, size_t nsegs);

/* ---- shared: fp_ring.c --------------------------------------------------- */

/*
 * An io_uring. A ring belongs to the thread that submits to it: every
 * function below is called by that thread only.
 */
typedef struct fp_ring fp_ring;

/* A ring of at least `entries` SQEs (the CQ has twice as many) whose kernel
 * has IORING_OP_READ/WRITE; 0 or -errno, *out NULL on failure. */
int fp_ring_open(fp_ring **out, unsigned entries);
/* Unmap and close; NULL is accepted. The kernel must hold none of its I/Os. */
void fp_ring_close(fp_ring *ring);

/* Queue one read or write (op: IORING_OP_READ/WRITE) of at most 1 GiB of buf
 * at off, tagged `data`; buf must stay valid until its CQE is reaped. The
 * caller keeps no more I/Os in flight than the ring has SQEs. */
void fp_ring_prep(fp_ring *ring, int op, int fd, char *buf, uint64_t len, uint64_t off,
                  uint64_t data);
/* Submit every queued SQE, then wait until wait_nr CQEs are ready. Retries
 * EINTR, short submissions and, a while, EAGAIN/EBUSY. 0 or -errno. */
int fp_ring_enter(fp_ring *ring, unsigned wait_nr);
/* Wait for one CQE without submitting: 0 or -errno (EINTR included). */
int fp_ring_wait_one(fp_ring *ring);
/* Reap one CQE: 1 with its data and res, or 0 when none is ready. */
int fp_ring_next(fp_ring *ring, uint64_t *data, int32_t *res);
/* I/Os the kernel has taken and not yet completed into a reaped CQE. */
unsigned fp_ring_in_kernel(fp_ring *ring);

/* ---- jobs: fp_write_job.c ------------------------------------------------ */

/*
 * A write cut into blocks of block_size; backends claim block k with an
 * atomic add on next_block and get its bytes from fp_block_source(). The
 * entry point sets size, block_size and nblocks and plans; fd and direct once
 * the file is open.
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
 * Cut the segments (checked: sorted, within size) into pieces at block
 * boundaries. The pieces point into the segments' memory, so the plan is
 * valid only while the caller's buffers are. 0 or -ENOMEM (message set);
 * fp_write_plan_free frees what was allocated either way.
 */
int fp_write_plan(fp_write_job *job, const fp_wseg *segs, size_t nsegs);
void fp_write_plan_free(fp_write_job *job);

/*
 * Where block k's bytes are to be written from, and in *wlen how many:
 * the caller's own memory when it is laid out as the file (contiguous,
 * aligned, no padding), else buf, filled with the block's pieces and zeros
 * and rounded up to FP_ALIGN under O_DIRECT. Either way the block's piece
 * CRCs are set. buf is a bounce buffer of block_size bytes, FP_ALIGN-aligned,
 * owned by the calling thread; the pointer returned stays valid until that
 * thread reuses buf or the call to fp_write_file returns. NULL, with the job
 * failed (EFAULT), when reading the caller's memory faulted (a shared-memory
 * segment truncated under us). Any thread, each block by one thread once.
 */
const char *fp_block_source(fp_write_job *job, uint64_t k, char *buf, uint64_t *wlen);

/* ---- jobs: fp_read_job.c ------------------------------------------------- */

/* One planned read: a piece read in place, a group of bounce pieces, or a
 * block of a region (memory laid out as the file) holding pieces of several
 * segments, read in place. */
typedef enum { FP_IO_IN_PLACE, FP_IO_BOUNCE, FP_IO_REGION } fp_read_io_kind;

typedef struct {
    fp_read_io_kind kind;
    char *mem;       /* where the I/O reads to; NULL: the thread's bounce buffer */
    uint64_t off;    /* file offset of the I/O (aligned under O_DIRECT) */
    uint64_t len;
    size_t first;    /* in place: index into pieces; else index into group_idx */
    size_t count;
} fp_read_io;

/*
 * A read planned as ios; backends claim io k with an atomic add on next_io
 * (or, for the pool's buffered streams, stream t with one on next_stream) and
 * hand each completed io to fp_read_io_done(). The entry point sets fd,
 * checksum, bounce_size and path, then plans.
 */
typedef struct {
    int fd;
    int checksum;
    uint64_t bounce_size; /* bytes of a bounce buffer: the longest bounce io */
    fp_piece *pieces;
    size_t npieces;
    /* Pieces of bounce and region ios, each io's together: io k's are
     * group_idx[ios[k].first .. + ios[k].count). */
    size_t *group_idx;
    size_t ngroup;
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
 * Plan the ios for a descriptor opened with (direct) or without O_DIRECT:
 * in place into the segments' memory where alignment allows, else through
 * bounce buffers of bounce_size bytes. region (may be NULL) is memory laid out
 * as the file from region->off: the segments that lie in it at their own file
 * offsets are read with whole blocks of it in place, as if they were one
 * segment, and the rest as above. It must be phase-aligned (address - offset a
 * multiple of FP_ALIGN) for direct reads and cover its segments' aligned
 * span, or it is not used. bounce (direct only): nothing is read in place;
 * the region's blocks and every segment go through bounce buffers and are
 * copied into place as they are checksummed. The plan points into the
 * caller's buffers. 0 or -ENOMEM (message set); fp_read_plan_free frees
 * either way.
 */
int fp_read_plan(fp_read_job *job, const fp_rseg *segs, size_t nsegs, const fp_rseg *region,
                 uint64_t block_size, int direct, int bounce);
/* Buffered reads on the pool only: split the (in-place, file-ordered) ios into
 * `threads` streams of about equal bytes. 0 or -ENOMEM (message set). */
int fp_read_plan_streams(fp_read_job *job, unsigned threads);
void fp_read_plan_free(fp_read_job *job);

/*
 * Finish an io whose read returned `got` bytes into buf (the piece's own
 * memory for an in-place io, a bounce buffer of bounce_size bytes otherwise):
 * fail the job on a short file, copy bounce pieces out, checksum. buf is only
 * read during the call and may be reused after. Any thread, each io once.
 */
void fp_read_io_done(fp_read_job *job, const fp_read_io *io, const char *buf, uint64_t got);

/* ---- backends: fp_pool.c ------------------------------------------------- */

/*
 * Run the job on `threads` threads with one blocking I/O each; return when
 * all are joined, failures in job->st. Bounce buffers come from, and go back
 * to, the fp_bounce_get cache. fp_pool_read reads the streams where the plan
 * has them (fp_read_plan_streams), else the ios.
 */
void fp_pool_write(fp_write_job *job, unsigned threads);
void fp_pool_read(fp_read_job *job, unsigned threads);

/* ---- backends: fp_uring.c ------------------------------------------------ */

/*
 * The ring for a call with this backend and queue depth, or *ring = NULL
 * where the thread pool is to be used (POOL, or AUTO where io_uring is
 * refused). Fails only when URING is forced and refused, or the arguments are
 * bad. The caller closes the ring (fp_ring_close accepts NULL).
 */
int fp_ring_for(fp_backend backend, unsigned queue_depth, fp_ring **ring);

/*
 * Run the job on min(threads, CPUs) threads, each with up to queue_depth I/Os
 * (and bounce buffers) in flight; the calling thread uses `ring`, others open
 * their own. Return when all are joined, failures in job->st; the kernel then
 * holds none of the job's buffers, unless waiting for its I/Os failed after a
 * failed io_uring_enter: the bounce buffers it may still hold are then leaked,
 * never reused (the caller's own memory, written or read in place, cannot be
 * protected that way).
 */
void fp_uring_write(fp_write_job *job, fp_ring *ring, unsigned threads, unsigned queue_depth);
void fp_uring_read(fp_read_job *job, fp_ring *ring, unsigned threads, unsigned queue_depth);

#endif
