/*
 * Writing a file: the entry point. It checks the request, plans the job
 * (fp_write_job.c), opens and reserves the file, runs the job on the backend
 * the options choose (fp_pool.c or fp_uring.c), then truncates, fsyncs and
 * folds the piece CRCs into segment CRCs.
 */
#define _GNU_SOURCE
#include "fp_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

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
            fp_pool_write(job, threads);
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
    int rc = fp_check_opts(opts);
    if (rc == 0)
        rc = check_segments(segs, nsegs, size);
    if (rc < 0)
        return rc;
    fp_ring *ring = NULL;
    rc = fp_ring_for(opts->backend, opts->queue_depth, &ring);
    if (rc < 0)
        return rc;
    fp_write_job job = {.size = size, .block_size = opts->block_size};
    job.nblocks = (size + opts->block_size - 1) / opts->block_size;
    pthread_mutex_init(&job.st.lock, NULL);
    rc = fp_write_plan(&job, segs, nsegs);
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
    fp_write_plan_free(&job);
    pthread_mutex_destroy(&job.st.lock);
    fp_ring_close(ring);
    return rc;
}
