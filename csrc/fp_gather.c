/*
 * fp_gather: a snapshot's batched memcpy. Many small copies (the tensors of a
 * state of 100,000 small ones) into one destination, in one call, on up to
 * `threads` threads: a large batch is cut into runs of consecutive items of
 * about GATHER_RUN bytes each, which the threads claim one at a time. A small
 * batch is copied on the calling thread alone (a thread costs more to start
 * than a few MiB cost to copy).
 */
#include "fp_internal.h"

#include <stdlib.h>
#include <string.h>

/* Bytes per claimed run; also the least a batch must hold for a second thread. */
#define GATHER_RUN (4u << 20)

typedef struct {
    char *dst;
    const fp_gather_item *items;
    size_t *run_first; /* run r copies items [run_first[r], run_first[r + 1]) */
    size_t nruns;
    size_t next_run; /* claim counter (atomic) */
} gather_job;

static void copy_items(char *dst, const fp_gather_item *items, size_t first, size_t last)
{
    for (size_t i = first; i < last; i++)
        if (items[i].len)
            memcpy(dst + items[i].dst_off, items[i].src, items[i].len);
}

static void *gather_worker(void *arg)
{
    gather_job *job = arg;
    for (;;) {
        size_t r = __atomic_fetch_add(&job->next_run, 1, __ATOMIC_RELAXED);
        if (r >= job->nruns)
            return NULL;
        copy_items(job->dst, job->items, job->run_first[r], job->run_first[r + 1]);
    }
}

int fp_gather(void *dst, size_t dst_len, const fp_gather_item *items, size_t n, unsigned threads)
{
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        const fp_gather_item *it = &items[i];
        if (it->dst_off > dst_len || it->len > dst_len - it->dst_off) {
            fp_set_error("gather: bytes [%zu, +%zu) of item %zu lie outside the %zu-byte "
                         "destination", it->dst_off, it->len, i, dst_len);
            return -FP_EBADARG;
        }
        if (it->len && !it->src) {
            fp_set_error("gather: item %zu has a null source address", i);
            return -FP_EBADARG;
        }
        total = it->len > UINT64_MAX - total ? UINT64_MAX : total + it->len; /* (saturates) */
    }
    if (threads > FP_MAX_THREADS)
        threads = FP_MAX_THREADS;
    if (threads > total / GATHER_RUN)
        threads = (unsigned)(total / GATHER_RUN);
    if (threads < 2) {
        copy_items(dst, items, 0, n);
        return 0;
    }
    /* Runs of consecutive items, cut once GATHER_RUN bytes are reached: counted
     * first, then recorded. */
    size_t nruns = 1;
    uint64_t in_run = 0;
    for (size_t i = 0; i + 1 < n; i++) {
        in_run += items[i].len;
        if (in_run >= GATHER_RUN) {
            nruns++;
            in_run = 0;
        }
    }
    size_t *run_first = malloc((nruns + 1) * sizeof *run_first);
    if (!run_first) {
        copy_items(dst, items, 0, n); /* no room to plan: one thread still copies */
        return 0;
    }
    size_t r = 0;
    in_run = 0;
    run_first[0] = 0;
    for (size_t i = 0; i + 1 < n; i++) {
        in_run += items[i].len;
        if (in_run >= GATHER_RUN) {
            run_first[++r] = i + 1;
            in_run = 0;
        }
    }
    run_first[nruns] = n;
    gather_job job = {dst, items, run_first, nruns, 0};
    fp_run_parallel(gather_worker, &job, threads);
    free(run_first);
    return 0;
}
