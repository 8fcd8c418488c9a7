/*
 * fastpersist engine: parallel direct-I/O reads and writes of
 * (buffer, file offset, length) lists, with CRC32C computed in the same pass.
 *
 * The engine knows nothing about tensors or the checkpoint format. Every
 * function returns 0 or a negative errno; on failure fp_last_error() gives a
 * thread-local message naming the operation and the file offset.
 *
 * Buffer lifetime: the caller keeps every segment's memory alive and
 * unchanged for the whole call; the engine keeps no pointer afterwards.
 */
#ifndef FP_ENGINE_H
#define FP_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#define FP_ALIGN 4096u /* O_DIRECT alignment we honour for offsets, lengths, buffers */
#define FP_MAX_QUEUE_DEPTH 1024u

/* Returned when a read finds the file shorter than a segment needs. */
#define FP_ETRUNCATED 10001
/* Returned for a malformed request (bad segment list or options). */
#define FP_EBADARG 10002

typedef struct {
    const void *buf;
    uint64_t off; /* file offset */
    uint64_t len;
} fp_wseg;

typedef struct {
    void *buf; /* NULL: the bytes are read and checksummed, not kept (a verify) */
    uint64_t off;
    uint64_t len;
} fp_rseg;

typedef enum { FP_DIRECT_OFF = 0, FP_DIRECT_ON = 1, FP_DIRECT_AUTO = 2 } fp_direct_mode;

/*
 * How I/Os are kept in flight. POOL: `threads` threads, each with one bounce
 * buffer and one blocking pread/pwrite at a time. URING: min(`threads`, CPUs)
 * threads, each driving its own io_uring with up to `queue_depth` I/Os (and
 * bounce buffers) in flight. AUTO: URING where io_uring_setup succeeds, POOL
 * where it is refused (ENOSYS, a seccomp filter, kernel.io_uring_disabled).
 */
typedef enum { FP_BACKEND_POOL = 0, FP_BACKEND_URING = 1, FP_BACKEND_AUTO = 2 } fp_backend;

typedef struct {
    size_t block_size;    /* bytes per I/O; a multiple of FP_ALIGN */
    unsigned threads;     /* I/O threads (see fp_backend) */
    fp_direct_mode direct;
    int fsync;            /* fsync the file before returning (writes) */
    int checksum;         /* compute per-segment CRC32C (reads; writes always do) */
    int bounce;           /* reads, direct: every byte through bounce buffers, none in place */
    fp_backend backend;
    unsigned queue_depth; /* io_uring: I/Os in flight per thread, each with a bounce buffer */
} fp_opts;

/*
 * 0 if every option is in range, else -FP_EBADARG with a message naming the
 * first bad one: block_size a positive multiple of FP_ALIGN, threads 1..64,
 * direct and backend one of their values, queue_depth 1..FP_MAX_QUEUE_DEPTH.
 * fp_write_file and fp_read_file check their options with it.
 */
int fp_check_opts(const fp_opts *opts);

/*
 * Write `size` bytes to `path` (created or truncated): each segment's bytes at
 * its offset, zeros in any gap. Segments must be sorted by offset, must not
 * overlap and must end at or before `size`. crcs[i] receives the CRC32C of
 * segment i. *used_direct says whether O_DIRECT was used (AUTO falls back to
 * buffered I/O where the filesystem refuses it).
 */
int fp_write_file(const char *path, const fp_wseg *segs, size_t nsegs, uint64_t size,
                  const fp_opts *opts, uint32_t *crcs, int *used_direct);

/*
 * fp_write_file of `name` in the open directory `dir_fd` (AT_FDCWD: `name` is a
 * path, as fp_write_file). With a directory, `name` must be a plain file name
 * and must not exist: it is created with O_EXCL | O_NOFOLLOW, so that neither a
 * symbolic link nor a file planted in the directory is written through.
 */
int fp_write_file_at(int dir_fd, const char *name, const fp_wseg *segs, size_t nsegs,
                     uint64_t size, const fp_opts *opts, uint32_t *crcs, int *used_direct);

/*
 * Read each segment's bytes from `path` into its buffer, in any order and in
 * parallel. crcs (may be NULL when opts->checksum is 0) receives each
 * segment's CRC32C. Returns -FP_ETRUNCATED if the file is too short.
 * region (may be NULL): a buffer laid out as the file from region->off, in
 * which (some of) the segments lie at their offsets; those are then read with
 * large I/Os straight into it (bytes between them included), so that a file
 * read whole needs no bounce copies and no small reads.
 */
int fp_read_file(const char *path, const fp_rseg *segs, size_t nsegs, const fp_rseg *region,
                 const fp_opts *opts, uint32_t *crcs, int *used_direct);

/*
 * 0 if io_uring can be used here (setup succeeds and the kernel has
 * IORING_OP_READ/WRITE), else the negative errno that refused it.
 */
int fp_uring_probe(void);

/* fsync a directory, so that entries created or renamed in it are durable. */
int fp_fsync_dir(const char *path);

/* Atomically swap two paths (renameat2 RENAME_EXCHANGE). */
int fp_rename_exchange(const char *a, const char *b);
/* The same, each path relative to its directory fd (AT_FDCWD: as a path). */
int fp_rename_exchange_at(int a_dir, const char *a, int b_dir, const char *b);

/*
 * openat2(2): open `path` relative to `dir_fd` with `flags` and `mode`, resolved
 * as `resolve` says (RESOLVE_BENEATH, RESOLVE_NO_SYMLINKS...). Returns the fd
 * or -errno; -ENOSYS where the kernel (or a seccomp filter) lacks it.
 */
int fp_openat2(int dir_fd, const char *path, uint64_t flags, uint64_t mode, uint64_t resolve);

/* One copy of fp_gather: len bytes from src to the destination at dst_off. */
typedef struct {
    const void *src;
    size_t dst_off;
    size_t len;
} fp_gather_item;

/*
 * Copy every item into dst (dst_len bytes), on up to `threads` threads (the
 * calling thread included; one where the batch is small). Every item is
 * checked against dst before anything is copied: -FP_EBADARG for an item that
 * would land outside it or that has a null source. The sources are the
 * caller's promise (live memory of at least len bytes, not overlapping dst).
 */
int fp_gather(void *dst, size_t dst_len, const fp_gather_item *items, size_t n, unsigned threads);

/*
 * memcpy of len bytes from src to dst, on the calling thread, and *crc the
 * CRC32C of those bytes (computed in the same pass, as a write's), where src
 * may be memory that faults: a client's shared-memory segment that it
 * truncated after handing it over (fastpersistd compresses from such
 * mappings). A SIGBUS while reading src is caught (fp_fault.c) and returns
 * -EFAULT with dst partly written; any other fault is not ours and kills as
 * ever.
 */
int fp_copy_guarded(void *dst, const void *src, size_t len, uint32_t *crc);

/* CRC32C of buf, continuing from crc (0 to start). */
uint32_t fp_crc32c(uint32_t crc, const void *buf, size_t len);
/* CRC32C of A||B from crc(A), crc(B) and len(B). */
uint32_t fp_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2);
void fp_crc32c_init(void);
const char *fp_crc32c_impl(void);

/* Bounce buffers: 2 MiB-aligned mappings (huge pages unless turned off),
 * cached across calls up to a budget. */
void *fp_bounce_get(size_t size);
void fp_bounce_set_huge(int on);
void fp_bounce_put(void *buf, size_t size);
void fp_bounce_release_all(void);
size_t fp_bounce_cached_bytes(void);

const char *fp_last_error(void);
void fp_set_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
