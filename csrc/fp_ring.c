/*
 * One io_uring, driven by raw syscalls (no liburing): set it up, queue an
 * SQE, submit and wait, reap a CQE. It knows nothing of jobs or threads; the
 * backend that keeps I/Os in flight with it is fp_uring.c.
 *
 * Memory ordering is liburing's: SQEs are published by a release store of the
 * SQ tail; the CQ tail is loaded with acquire before CQEs are read and the CQ
 * head is stored with release after.
 */
#define _GNU_SOURCE
#include "fp_internal.h"

#include <errno.h>
#include <linux/io_uring.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef __NR_io_uring_setup /* the same numbers on every architecture */
#define __NR_io_uring_setup 425
#define __NR_io_uring_enter 426
#define __NR_io_uring_register 427
#endif

/* sqe->len is 32 bits, and Linux moves at most ~2 GiB per call anyway. */
#define MAX_IO (1u << 30)
/* Retries of an enter refused for lack of kernel memory before giving up. */
#define MAX_BUSY_RETRIES 10000

struct fp_ring {
    int fd;
    unsigned *sq_head, *sq_tail, *cq_head, *cq_tail;
    unsigned sq_mask, cq_mask, entries;
    unsigned sq_local, cq_local; /* our copies of the tail we publish / head we consume */
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_map, *cq_map;
    size_t sq_len, cq_len, sqes_len;
};

/* IORING_OP_READ/WRITE came with 5.6, as did the probe; older kernels fall back. */
static int check_ops(int fd)
{
    size_t len = sizeof(struct io_uring_probe) + 256 * sizeof(struct io_uring_probe_op);
    struct io_uring_probe *probe = calloc(1, len);
    if (!probe)
        return -ENOMEM;
    int rc = 0;
    if (syscall(__NR_io_uring_register, fd, IORING_REGISTER_PROBE, probe, 256) < 0)
        rc = -errno;
    else if (probe->last_op < IORING_OP_WRITE ||
             !(probe->ops[IORING_OP_READ].flags & IO_URING_OP_SUPPORTED) ||
             !(probe->ops[IORING_OP_WRITE].flags & IO_URING_OP_SUPPORTED))
        rc = -EOPNOTSUPP;
    free(probe);
    return rc;
}

void fp_ring_close(fp_ring *r)
{
    if (!r)
        return;
    if (r->sqes)
        munmap(r->sqes, r->sqes_len);
    if (r->cq_map && r->cq_map != r->sq_map)
        munmap(r->cq_map, r->cq_len);
    if (r->sq_map)
        munmap(r->sq_map, r->sq_len);
    close(r->fd);
    free(r);
}

static void *map_ring(int fd, size_t len, uint64_t what)
{
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, (off_t)what);
    return p == MAP_FAILED ? NULL : p;
}

int fp_ring_open(fp_ring **out, unsigned entries)
{
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    *out = NULL;
    fp_ring *r = calloc(1, sizeof *r);
    if (!r)
        return -ENOMEM;
    r->fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (r->fd < 0) {
        int err = errno;
        free(r);
        return -err;
    }
    r->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    int single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single)
        r->sq_len = r->cq_len = r->sq_len > r->cq_len ? r->sq_len : r->cq_len;
    r->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sq_map = map_ring(r->fd, r->sq_len, IORING_OFF_SQ_RING);
    r->cq_map = single ? r->sq_map : map_ring(r->fd, r->cq_len, IORING_OFF_CQ_RING);
    r->sqes = map_ring(r->fd, r->sqes_len, IORING_OFF_SQES);
    int rc = !r->sq_map || !r->cq_map || !r->sqes ? -errno : check_ops(r->fd);
    if (rc < 0) {
        fp_ring_close(r);
        return rc;
    }
    char *sq = r->sq_map, *cq = r->cq_map;
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = *(unsigned *)(sq + p.sq_off.ring_mask);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = *(unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    r->entries = p.sq_entries;
    /* SQE i always sits in slot i of the index array; only the tail moves. */
    unsigned *array = (unsigned *)(sq + p.sq_off.array);
    for (unsigned i = 0; i < p.sq_entries; i++)
        array[i] = i;
    r->sq_local = *r->sq_tail;
    r->cq_local = *r->cq_head;
    *out = r;
    return 0;
}

int fp_uring_probe(void)
{
    fp_ring *r;
    int rc = fp_ring_open(&r, 1);
    fp_ring_close(r);
    return rc;
}

void fp_ring_prep(fp_ring *r, int op, int fd, char *buf, uint64_t len, uint64_t off,
                  uint64_t data)
{
    struct io_uring_sqe *sqe = &r->sqes[r->sq_local & r->sq_mask];
    memset(sqe, 0, sizeof *sqe);
    sqe->opcode = (uint8_t)op;
    sqe->fd = fd;
    sqe->addr = (uint64_t)(uintptr_t)buf;
    sqe->len = (uint32_t)fp_min(len, MAX_IO);
    sqe->off = off;
    sqe->user_data = data;
    r->sq_local++;
    __atomic_store_n(r->sq_tail, r->sq_local, __ATOMIC_RELEASE);
}

unsigned fp_ring_in_kernel(fp_ring *r)
{
    return __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE) - r->cq_local;
}

int fp_ring_enter(fp_ring *r, unsigned wait_nr)
{
    for (int busy = 0;;) {
        unsigned pending = r->sq_local - __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
        if (!pending && !wait_nr)
            return 0;
        long rc = syscall(__NR_io_uring_enter, r->fd, pending, wait_nr,
                          wait_nr ? IORING_ENTER_GETEVENTS : 0, NULL, 0);
        if (rc >= 0) {
            /* The kernel stops submitting (and does not wait) when it runs short. */
            if ((unsigned)rc >= pending)
                return 0;
            continue;
        }
        int err = errno;
        if (err == EINTR)
            continue;
        if ((err == EAGAIN || err == EBUSY) && busy++ < MAX_BUSY_RETRIES) {
            sched_yield();
            continue;
        }
        return -err;
    }
}

int fp_ring_wait_one(fp_ring *r)
{
    if (syscall(__NR_io_uring_enter, r->fd, 0, 1, IORING_ENTER_GETEVENTS, NULL, 0) < 0)
        return -errno;
    return 0;
}

int fp_ring_next(fp_ring *r, uint64_t *data, int32_t *res)
{
    if (r->cq_local == __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE))
        return 0;
    const struct io_uring_cqe *cqe = &r->cqes[r->cq_local & r->cq_mask];
    *data = cqe->user_data;
    *res = cqe->res;
    __atomic_store_n(r->cq_head, ++r->cq_local, __ATOMIC_RELEASE);
    return 1;
}
