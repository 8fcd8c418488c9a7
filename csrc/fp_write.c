/*
 * Parallel direct-I/O writer: planning, block assembly and the thread pool.
 *
 * The file is cut into blocks of opts->block_size. A block is assembled in an
 * aligned bounce buffer: the segment pieces that fall in it are copied in
 * (and checksummed in the same pass, while the bytes are in cache), zeros in
 * the gaps, and the block is written with one large aligned write.
 *
 * Pool backend: each thread owns one bounce buffer and repeatedly claims the
 * next block, assembles it and pwrites it; one thread's copy overlaps the
 * others' writes. The io_uring backend (fp_uring.c) shares the plan and the
 * assembly and keeps several writes in flight from each of its threads.
 */
#define _GNU_SOURCE
#include "fp_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

uint64_t fp_fill_block(fp_write_job *job, uint64_t k, char *buf)
{
    uint64_t start = k * job->block_size;
    uint64_t end = fp_min(start + job->block_size, job->size);
    uint64_t cursor = start;
    for (size_t i = job->block_first[k]; i < job->block_first[k + 1]; i++) {
        fp_piece *p = &job->pieces[i];
        if (p->off > cursor)
            memset(buf + (cursor - start), 0, p->off - cursor);
        p->crc = fp_copy_with_crc(buf + (p->off - start), p->mem, p->len, 1);
        cursor = p->off + p->len;
    }
    uint64_t wlen = end - start;
    if (job->direct)
        wlen = fp_round_up(wlen, FP_ALIGN); /* truncated back after the last write */
    if (wlen > cursor - start)
        memset(buf + (cursor - start), 0, wlen - (cursor - start));
    return wlen;
}

/*
 * Block k straight from the caller's memory, when it is already laid out as
 * the file wants it (async-save staging buffers are): one run of contiguous
 * memory covering the whole block, aligned for O_DIRECT, nothing to pad. That
 * saves the bounce copy, a pass over memory that the trainer's cores would
 * otherwise pay; the pieces are still checksummed. NULL where it does not apply.
 */
static const char *in_place(fp_write_job *job, uint64_t k, uint64_t *wlen)
{
    size_t first = job->block_first[k], last = job->block_first[k + 1];
    if (first == last)
        return NULL;
    uint64_t start = k * job->block_size;
    uint64_t end = fp_min(start + job->block_size, job->size);
    const fp_piece *p0 = &job->pieces[first];
    if (p0->off != start)
        return NULL;
    if (job->direct && ((uintptr_t)p0->mem % FP_ALIGN || (end - start) % FP_ALIGN))
        return NULL;
    uint64_t cursor = start;
    const char *expect = p0->mem;
    for (size_t i = first; i < last; i++) {
        const fp_piece *p = &job->pieces[i];
        if (p->off != cursor || p->mem != expect)
            return NULL;
        cursor += p->len;
        expect += p->len;
    }
    if (cursor != end)
        return NULL;
    for (size_t i = first; i < last; i++)
        job->pieces[i].crc = fp_crc32c(0, job->pieces[i].mem, job->pieces[i].len);
    *wlen = end - start;
    return p0->mem;
}

typedef struct {
    fp_write_job *job;
    uint64_t k;
    char *buf;
    uint64_t wlen;
    const char *src;
} block_source_call;

static void block_source(void *arg)
{
    block_source_call *c = arg;
    c->src = in_place(c->job, c->k, &c->wlen);
    if (!c->src) {
        c->wlen = fp_fill_block(c->job, c->k, c->buf);
        c->src = c->buf;
    }
}

const char *fp_block_source(fp_write_job *job, uint64_t k, char *buf, uint64_t *wlen)
{
    block_source_call c = {.job = job, .k = k, .buf = buf};
    if (fp_guarded(block_source, &c) < 0) {
        fp_fail(&job->st, EFAULT,
                "reading the source memory of block %llu faulted (SIGBUS): was a shared-memory "
                "segment truncated while it was being written?", (unsigned long long)k);
        return NULL;
    }
    *wlen = c.wlen;
    return c.src;
}

static void *write_worker(void *arg)
{
    fp_write_job *job = arg;
    char *buf = fp_bounce_get(job->block_size);
    if (!buf) {
        fp_fail(&job->st, ENOMEM, "allocating a %llu-byte bounce buffer",
                (unsigned long long)job->block_size);
        return NULL;
    }
    while (!fp_failed(&job->st)) {
        uint64_t k = __atomic_fetch_add(&job->next_block, 1, __ATOMIC_RELAXED);
        if (k >= job->nblocks)
            break;
        uint64_t start = k * job->block_size, wlen;
        const char *src = fp_block_source(job, k, buf, &wlen);
        if (!src)
            break;
        int rc = fp_pwrite_full(job->fd, src, wlen, start);
        if (rc < 0)
            fp_fail(&job->st, -rc, "write of %llu bytes at offset %llu: %s",
                    (unsigned long long)wlen, (unsigned long long)start, strerror(-rc));
    }
    fp_bounce_put(buf, job->block_size);
    return NULL;
}

static int check_segments(const fp_wseg *segs, size_t nsegs, uint64_t size)
{
    uint64_t prev_end = 0;
    for (size_t i = 0; i < nsegs; i++) {
        if (segs[i].off < prev_end || segs[i].len > size || segs[i].off > size - segs[i].len) {
            fp_set_error("segment %zu (offset %llu, length %llu) overlaps its predecessor or "
                         "ends past the file size %llu",
                         i, (unsigned long long)segs[i].off, (unsigned long long)segs[i].len,
                         (unsigned long long)size);
            return -FP_EBADARG;
        }
        prev_end = segs[i].off + segs[i].len;
    }
    return 0;
}

/* Split segments at block boundaries into pieces, in file order. */
static int plan_pieces(fp_write_job *job, const fp_wseg *segs, size_t nsegs)
{
    uint64_t bs = job->block_size;
    size_t npieces = 0;
    for (size_t i = 0; i < nsegs; i++)
        if (segs[i].len)
            npieces += (segs[i].off + segs[i].len - 1) / bs - segs[i].off / bs + 1;
    job->pieces = calloc(npieces ? npieces : 1, sizeof *job->pieces);
    job->block_first = calloc(job->nblocks + 1, sizeof *job->block_first);
    if (!job->pieces || !job->block_first) {
        fp_set_error("out of memory planning %zu pieces", npieces);
        return -ENOMEM;
    }
    size_t n = 0;
    for (size_t i = 0; i < nsegs; i++) {
        for (uint64_t off = segs[i].off, end = segs[i].off + segs[i].len; off < end;) {
            uint64_t stop = fp_round_down(off, bs) + bs;
            if (stop > end)
                stop = end;
            job->pieces[n++] = (fp_piece){.mem = (char *)segs[i].buf + (off - segs[i].off),
                                          .off = off, .len = stop - off, .seg = i};
            off = stop;
        }
    }
    job->npieces = n;
    size_t j = 0;
    for (uint64_t k = 0; k <= job->nblocks; k++) {
        while (j < n && job->pieces[j].off / bs < k)
            j++;
        job->block_first[k] = j;
    }
    return 0;
}

static int write_once(fp_write_job *job, int dir_fd, const char *path, int flags,
                      const fp_opts *opts, fp_direct_mode mode, fp_ring *ring, int *used_direct)
{
    int fd = fp_open_for(dir_fd, path, flags, mode, used_direct);
    if (fd < 0) {
        fp_set_error("open %s for writing: %s", path, strerror(-fd));
        return fd;
    }
    job->fd = fd;
    job->direct = *used_direct;
    job->next_block = 0;
    job->st.err = 0;
    job->st.msg[0] = 0;
    /* Reserve the space first: a full disk fails here, before any copying. */
    if (job->size && fallocate(fd, 0, 0, (off_t)job->size) != 0 && errno != EOPNOTSUPP &&
        errno != ENOSYS)
        fp_fail(&job->st, errno, "reserving %llu bytes: %s", (unsigned long long)job->size,
                strerror(errno));
    if (!job->st.err) {
        unsigned threads = (unsigned)fp_min(opts->threads ? opts->threads : 1,
                                            job->nblocks ? job->nblocks : 1);
        if (ring)
            fp_uring_write(job, ring, threads, opts->queue_depth);
        else
            fp_run_parallel(write_worker, job, threads);
    }
    if (!job->st.err && job->direct && ftruncate(fd, (off_t)job->size) != 0)
        fp_fail(&job->st, errno, "truncate to %llu bytes: %s", (unsigned long long)job->size,
                strerror(errno));
    if (!job->st.err && opts->fsync && fsync(fd) != 0)
        fp_fail(&job->st, errno, "fsync: %s", strerror(errno));
    if (close(fd) != 0 && !job->st.err)
        fp_fail(&job->st, errno, "close: %s", strerror(errno));
    if (job->st.err) {
        fp_set_error("%s: %s", path, job->st.msg);
        return -job->st.err;
    }
    return 0;
}

int fp_write_file(const char *path, const fp_wseg *segs, size_t nsegs, uint64_t size,
                  const fp_opts *opts, uint32_t *crcs, int *used_direct)
{
    return fp_write_file_at(AT_FDCWD, path, segs, nsegs, size, opts, crcs, used_direct);
}

int fp_write_file_at(int dir_fd, const char *name, const fp_wseg *segs, size_t nsegs,
                     uint64_t size, const fp_opts *opts, uint32_t *crcs, int *used_direct)
{
    /* In a directory: a new file of ours, never through a link or a planted file. */
    int in_dir = dir_fd != AT_FDCWD;
    if (in_dir && (!name[0] || strchr(name, '/') || !strcmp(name, ".") || !strcmp(name, ".."))) {
        fp_set_error("%s is not a plain file name", name);
        return -FP_EBADARG;
    }
    int flags = O_WRONLY | (in_dir ? O_CREAT | O_EXCL | O_NOFOLLOW : O_CREAT | O_TRUNC);
    if (!opts->block_size || opts->block_size % FP_ALIGN) {
        fp_set_error("block size %zu is not a positive multiple of %u", opts->block_size,
                     FP_ALIGN);
        return -FP_EBADARG;
    }
    int rc = check_segments(segs, nsegs, size);
    if (rc < 0)
        return rc;
    fp_ring *ring = NULL;
    rc = fp_ring_for(opts->backend, opts->queue_depth, &ring);
    if (rc < 0)
        return rc;
    fp_write_job job = {.size = size, .block_size = opts->block_size};
    job.nblocks = (size + opts->block_size - 1) / opts->block_size;
    pthread_mutex_init(&job.st.lock, NULL);
    rc = plan_pieces(&job, segs, nsegs);
    if (rc == 0) {
        rc = write_once(&job, dir_fd, name, flags, opts, opts->direct, ring, used_direct);
        /* Some filesystems accept O_DIRECT at open and refuse the I/O. The file
         * is ours by now: the second try opens it again, without O_EXCL. */
        if (rc == -EINVAL && opts->direct == FP_DIRECT_AUTO && *used_direct)
            rc = write_once(&job, dir_fd, name, (flags & ~(O_CREAT | O_EXCL)) | O_TRUNC, opts,
                            FP_DIRECT_OFF, ring, used_direct);
    }
    if (rc == 0)
        fp_fold_piece_crcs(job.pieces, job.npieces, crcs, nsegs);
    free(job.pieces);
    free(job.block_first);
    pthread_mutex_destroy(&job.st.lock);
    fp_ring_close(ring);
    return rc;
}
