/*
 * The io_uring backend: the write and read loops that keep up to queue_depth
 * I/Os in flight from each thread, every thread with its own ring (fp_ring.c
 * drives one ring; this file decides what is in flight on it).
 *
 * A pool thread sleeps in pwrite while its block is on the wire, so N writes
 * in flight cost N threads. A thread with a ring has block k+1 assembled
 * (copy and CRC, fp_block_source) while its earlier blocks are being written,
 * and queues reads ahead, finishing each (copy-out, CRC, fp_read_io_done) as
 * it completes. Threads are capped at the CPUs: the copying is theirs, the
 * waiting is the ring's. What each I/O holds is the job's (fp_write_job.c,
 * fp_read_job.c); this file only moves bytes.
 *
 * Each slot (a bounce buffer and one I/O) is its SQE's user_data, and there
 * are never more slots than SQ entries, so the SQ cannot overflow and the CQ
 * (twice the SQ) cannot either.
 */
#define _GNU_SOURCE
#include "fp_internal.h"

#include <errno.h>
#include <linux/io_uring.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

/* Errors that mean "no io_uring here", remembered so AUTO stops trying. */
static int refused_errno;

int fp_ring_for(fp_backend backend, unsigned queue_depth, fp_ring **ring)
{
    *ring = NULL;
    if (backend == FP_BACKEND_POOL)
        return 0;
    if ((backend != FP_BACKEND_URING && backend != FP_BACKEND_AUTO) || queue_depth < 1 ||
        queue_depth > FP_MAX_QUEUE_DEPTH) {
        fp_set_error("bad backend %d or queue depth %u (1..%u)", (int)backend, queue_depth,
                     FP_MAX_QUEUE_DEPTH);
        return -FP_EBADARG;
    }
    if (backend == FP_BACKEND_AUTO && __atomic_load_n(&refused_errno, __ATOMIC_RELAXED))
        return 0;
    int rc = fp_ring_open(ring, queue_depth);
    if (rc == 0)
        return 0;
    if (backend == FP_BACKEND_URING) {
        fp_set_error("io_uring is not available: %s", strerror(-rc));
        return rc;
    }
    /* ENOMEM or EMFILE may pass; a refusal by the kernel or a seccomp filter will not. */
    if (rc == -ENOSYS || rc == -EPERM || rc == -EACCES || rc == -EINVAL || rc == -EOPNOTSUPP)
        __atomic_store_n(&refused_errno, -rc, __ATOMIC_RELAXED);
    return 0;
}

/* One I/O in flight: the part of [base, base + got + left) still to move. */
typedef struct {
    char *buf;  /* this slot's bounce buffer, allocated on first use */
    char *base; /* where the I/O started: buf, or a piece's memory read in place */
    uint64_t off, left, got;
    size_t io;  /* reads: index of the planned io */
} slot;

typedef struct loop loop;
struct loop {
    fp_ring *ring;
    int fd, op, submit_each;
    fp_status *st;
    void *job;
    uint64_t buf_size;
    slot *slots;
    unsigned *idle; /* indices of the slots not in flight */
    unsigned nidle, busy;
    int more;     /* work may be left to claim */
    int stranded; /* the kernel may still use our buffers: never free them */
    /* Claim the next I/O into s: 1, or 0 when none is left or on failure. */
    int (*start)(loop *, slot *);
    void (*finish)(loop *, slot *);
};

static void queue_slot(loop *L, slot *s)
{
    fp_ring_prep(L->ring, L->op, L->fd, s->base + s->got, s->left, s->off, (uint64_t)(s - L->slots));
}

static void release_slot(loop *L, slot *s)
{
    L->idle[L->nidle++] = (unsigned)(s - L->slots);
    L->busy--;
}

static int refill(loop *L)
{
    while (L->more && L->nidle && !fp_failed(L->st)) {
        slot *s = &L->slots[L->idle[L->nidle - 1]];
        if (!L->start(L, s)) {
            L->more = 0;
            break;
        }
        L->nidle--;
        L->busy++;
        queue_slot(L, s);
        /* Writes: the disk starts on this block while the next one is copied. */
        if (L->submit_each) {
            int rc = fp_ring_enter(L->ring, 0);
            if (rc < 0)
                return rc;
        }
    }
    return fp_ring_enter(L->ring, 0);
}

static void complete(loop *L, slot *s, int32_t res)
{
    const char *what = L->op == IORING_OP_WRITE ? "write" : "read";
    if (res == -EAGAIN || res == -EINTR) {
        if (!fp_failed(L->st)) {
            queue_slot(L, s);
            return;
        }
    } else if (res < 0 || (res == 0 && L->op == IORING_OP_WRITE)) {
        int err = res < 0 ? -res : EIO;
        fp_fail(L->st, err, "%s of %llu bytes at offset %llu: %s", what,
                (unsigned long long)s->left, (unsigned long long)s->off, strerror(err));
    } else {
        s->got += (uint64_t)res;
        s->off += (uint64_t)res;
        s->left -= (uint64_t)res;
        /* Short: resubmit the rest. A read of 0 bytes is the end of the file. */
        if (res > 0 && s->left && !fp_failed(L->st)) {
            queue_slot(L, s);
            return;
        }
        if (!fp_failed(L->st))
            L->finish(L, s);
    }
    release_slot(L, s);
}

/* After a failed enter: wait for what the kernel took, so no buffer is in use. */
static void drain(loop *L)
{
    uint64_t data;
    int32_t res;
    while (fp_ring_in_kernel(L->ring)) {
        int rc = fp_ring_wait_one(L->ring);
        if (rc < 0 && rc != -EINTR) {
            L->stranded = 1;
            return;
        }
        while (fp_ring_next(L->ring, &data, &res))
            ;
    }
}

static void run_loop(loop *L, unsigned queue_depth)
{
    L->slots = calloc(queue_depth, sizeof *L->slots);
    L->idle = calloc(queue_depth, sizeof *L->idle);
    if (!L->slots || !L->idle) {
        fp_fail(L->st, ENOMEM, "allocating %u io_uring slots", queue_depth);
        goto out;
    }
    for (unsigned i = 0; i < queue_depth; i++)
        L->idle[i] = queue_depth - 1 - i;
    L->nidle = queue_depth;
    L->more = 1;
    int rc = refill(L);
    while (rc == 0 && L->busy) {
        rc = fp_ring_enter(L->ring, 1);
        uint64_t data;
        int32_t res;
        while (rc == 0 && fp_ring_next(L->ring, &data, &res))
            complete(L, &L->slots[data], res);
        if (rc == 0)
            rc = refill(L);
    }
    if (rc < 0) {
        fp_fail(L->st, -rc, "io_uring_enter: %s", strerror(-rc));
        drain(L);
    }
out:
    for (unsigned i = 0; L->slots && i < queue_depth && !L->stranded; i++)
        fp_bounce_put(L->slots[i].buf, L->buf_size);
    free(L->slots);
    free(L->idle);
}

static int write_start(loop *L, slot *s)
{
    fp_write_job *job = L->job;
    if (!s->buf && !(s->buf = fp_bounce_get(job->block_size))) {
        fp_fail(L->st, ENOMEM, "allocating a %llu-byte bounce buffer",
                (unsigned long long)job->block_size);
        return 0;
    }
    uint64_t k = __atomic_fetch_add(&job->next_block, 1, __ATOMIC_RELAXED);
    if (k >= job->nblocks)
        return 0;
    s->off = k * job->block_size;
    s->got = 0;
    s->base = (char *)fp_block_source(job, k, s->buf, &s->left);
    return s->base != NULL; /* NULL: failed (fp_fail'ed), no more blocks */
}

static void write_finish(loop *L, slot *s)
{
}

static int read_start(loop *L, slot *s)
{
    fp_read_job *job = L->job;
    size_t k = __atomic_fetch_add(&job->next_io, 1, __ATOMIC_RELAXED);
    if (k >= job->nios)
        return 0;
    const fp_read_io *io = &job->ios[k];
    if (!io->mem && !s->buf && !(s->buf = fp_bounce_get(job->bounce_size))) {
        fp_fail(L->st, ENOMEM, "allocating a bounce buffer");
        return 0;
    }
    s->io = k;
    s->base = io->mem ? io->mem : s->buf;
    s->off = io->off;
    s->got = 0;
    s->left = io->len;
    return 1;
}

static void read_finish(loop *L, slot *s)
{
    fp_read_job *job = L->job;
    fp_read_io_done(job, &job->ios[s->io], s->base, s->got);
}

typedef struct {
    loop proto;
    fp_ring *first;
    unsigned queue_depth;
    int first_taken;
} uring_run;

/* One thread: the caller's ring for whoever comes first, a new ring for the others. */
static void *uring_worker(void *arg)
{
    uring_run *run = arg;
    loop L = run->proto;
    fp_ring *own = NULL;
    if (!__atomic_exchange_n(&run->first_taken, 1, __ATOMIC_ACQ_REL))
        L.ring = run->first;
    else if (fp_ring_open(&own, run->queue_depth) == 0)
        L.ring = own;
    else
        return NULL; /* the threads that have a ring do the work */
    run_loop(&L, run->queue_depth);
    fp_ring_close(own);
    return NULL;
}

/*
 * Each io_uring thread copies and checksums for its own ring, so threads
 * beyond the CPUs we may run on only add switches: in-flight I/O comes from
 * the queue depth.
 */
static unsigned cap_to_cpus(unsigned threads)
{
    cpu_set_t set;
    unsigned cpus = 1;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
        cpus = (unsigned)CPU_COUNT(&set);
    return threads < cpus ? threads : cpus;
}

void fp_uring_write(fp_write_job *job, fp_ring *ring, unsigned threads, unsigned queue_depth)
{
    uring_run run = {.first = ring, .queue_depth = queue_depth,
                     .proto = {.fd = job->fd, .op = IORING_OP_WRITE, .submit_each = 1,
                               .st = &job->st, .job = job, .buf_size = job->block_size,
                               .start = write_start, .finish = write_finish}};
    fp_run_parallel(uring_worker, &run, cap_to_cpus(threads));
}

void fp_uring_read(fp_read_job *job, fp_ring *ring, unsigned threads, unsigned queue_depth)
{
    uring_run run = {.first = ring, .queue_depth = queue_depth,
                     .proto = {.fd = job->fd, .op = IORING_OP_READ, .st = &job->st, .job = job,
                               .buf_size = job->bounce_size, .start = read_start,
                               .finish = read_finish}};
    fp_run_parallel(uring_worker, &run, cap_to_cpus(threads));
}
