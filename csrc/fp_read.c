/*
 * Reading a file: the entry point. It checks the request, opens the file,
 * plans the job (fp_read_job.c) for the descriptor it got (O_DIRECT or not),
 * runs it on the backend the options choose (fp_pool.c or fp_uring.c) and
 * folds the piece CRCs into segment CRCs.
 */
#define _GNU_SOURCE
#include "fp_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

static int read_once(const char *path, const fp_rseg *segs, size_t nsegs, const fp_rseg *region,
                     const fp_opts *opts, fp_direct_mode mode, fp_ring *ring, uint32_t *crcs,
                     int *used_direct)
{
    int fd = fp_open_for(AT_FDCWD, path, O_RDONLY, mode, used_direct);
    if (fd < 0) {
        fp_set_error("open %s for reading: %s", path, strerror(-fd));
        return fd;
    }
    fp_read_job job = {.fd = fd, .checksum = opts->checksum,
                    .bounce_size = opts->block_size + 2 * FP_ALIGN, .path = path};
    pthread_mutex_init(&job.st.lock, NULL);
    int rc = fp_read_plan(&job, segs, nsegs, region, opts->block_size, *used_direct,
                          *used_direct && opts->bounce);
    unsigned threads = (unsigned)fp_min(opts->threads ? opts->threads : 1,
                                        job.nios ? job.nios : 1);
    if (rc == 0 && !*used_direct && !ring)
        rc = fp_read_plan_streams(&job, threads);
    if (rc == 0) {
        if (ring)
            fp_uring_read(&job, ring, threads, opts->queue_depth);
        else
            fp_pool_read(&job, threads);
        if (job.st.err) {
            fp_set_error("%s: %s", path, job.st.msg);
            rc = -job.st.err;
        } else if (crcs) {
            fp_fold_piece_crcs(job.pieces, job.npieces, crcs, nsegs);
        }
    }
    fp_read_plan_free(&job);
    pthread_mutex_destroy(&job.st.lock);
    close(fd);
    return rc;
}

int fp_read_file(const char *path, const fp_rseg *segs, size_t nsegs, const fp_rseg *region,
                 const fp_opts *opts, uint32_t *crcs, int *used_direct)
{
    int rc = fp_check_opts(opts);
    if (rc < 0)
        return rc;
    for (size_t i = 0; i < nsegs; i++) {
        if (segs[i].off + segs[i].len < segs[i].off) {
            fp_set_error("segment %zu: offset + length overflows", i);
            return -FP_EBADARG;
        }
    }
    fp_ring *ring = NULL;
    rc = fp_ring_for(opts->backend, opts->queue_depth, &ring);
    if (rc < 0)
        return rc;
    rc = read_once(path, segs, nsegs, region, opts, opts->direct, ring, crcs, used_direct);
    if (rc == -EINVAL && opts->direct == FP_DIRECT_AUTO && *used_direct)
        rc = read_once(path, segs, nsegs, region, opts, FP_DIRECT_OFF, ring, crcs,
                       used_direct);
    fp_ring_close(ring);
    return rc;
}
