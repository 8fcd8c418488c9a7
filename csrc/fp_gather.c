/*
 * fp_copy_guarded: one memcpy from memory that may fault (under fp_guarded).
 *
 * fp_gather: a snapshot's batched memcpy. Many copies (the tensors of a state,
 * small or large) into one destination, in one call, on up to `threads`
 * threads: a large batch is cut into pieces of at most GATHER_RUN bytes (a
 * large item into several) and the pieces into runs of about GATHER_RUN bytes
 * of consecutive ones, which the threads claim one at a time. A small batch
 * is copied on the calling thread alone (a thread costs more to start than a
 * few MiB cost to copy).
 */
#include "fp_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* Bytes per claimed run, and the most of one item a piece holds; also the
 * least a batch must hold per thread. */
#define GATHER_RUN (4u << 20)

typedef struct {
    char *dst;
    const fp_gather_item *pieces;
    size_t *run_first; /* run r copies pieces [run_first[r], run_first[r + 1]) */
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
        copy_items(job->dst, job->pieces, job->run_first[r], job->run_first[r + 1]);
    }
}

/* Items cut into pieces of at most GATHER_RUN bytes (empty ones left out);
 * NULL if there is no memory for them. */
static fp_gather_item *cut_pieces(const fp_gather_item *items, size_t n, size_t *npieces)
{
    size_t count = 0;
    for (size_t i = 0; i < n; i++)
        count += (items[i].len + GATHER_RUN - 1) / GATHER_RUN;
    fp_gather_item *pieces = malloc((count ? count : 1) * sizeof *pieces);
    if (!pieces)
        return NULL;
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        for (size_t done = 0; done < items[i].len; done += GATHER_RUN) {
            size_t len = items[i].len - done < GATHER_RUN ? items[i].len - done : GATHER_RUN;
            pieces[k++] = (fp_gather_item){(const char *)items[i].src + done,
                                           items[i].dst_off + done, len};
        }
    *npieces = count;
    return pieces;
}

/* The first piece of each run of about GATHER_RUN bytes, and n at the end; NULL
 * if there is no memory for them. */
static size_t *cut_runs(const fp_gather_item *pieces, size_t n, size_t *nruns)
{
    size_t count = 1;
    uint64_t in_run = 0;
    for (size_t i = 0; i + 1 < n; i++) {
        in_run += pieces[i].len;
        if (in_run >= GATHER_RUN) {
            count++;
            in_run = 0;
        }
    }
    size_t *first = malloc((count + 1) * sizeof *first);
    if (!first)
        return NULL;
    size_t r = 0;
    in_run = 0;
    first[0] = 0;
    for (size_t i = 0; i + 1 < n; i++) {
        in_run += pieces[i].len;
        if (in_run >= GATHER_RUN) {
            first[++r] = i + 1;
            in_run = 0;
        }
    }
    first[count] = n;
    *nruns = count;
    return first;
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
    size_t npieces = 0, nruns = 0;
    fp_gather_item *pieces = threads >= 2 ? cut_pieces(items, n, &npieces) : NULL;
    size_t *run_first = pieces ? cut_runs(pieces, npieces, &nruns) : NULL;
    if (!run_first) { /* one thread (or no memory to plan more: one still copies) */
        free(pieces);
        copy_items(dst, items, 0, n);
        return 0;
    }
    gather_job job = {dst, pieces, run_first, nruns, 0};
    fp_run_parallel(gather_worker, &job, threads);
    free(run_first);
    free(pieces);
    return 0;
}

/* Bytes copied before they are checksummed: the CRC reads them from L1/L2. */
#define COPY_RUN (64u << 10)

typedef struct {
    char *dst;
    const char *src;
    size_t len;
    uint32_t crc;
} copy_call;

static void copy_once(void *arg)
{
    copy_call *c = arg;
    for (size_t done = 0; done < c->len; done += COPY_RUN) {
        size_t n = c->len - done < COPY_RUN ? c->len - done : COPY_RUN;
        memcpy(c->dst + done, c->src + done, n);
        c->crc = fp_crc32c(c->crc, c->dst + done, n);
    }
}

int fp_copy_guarded(void *dst, const void *src, size_t len, uint32_t *crc)
{
    copy_call c = {dst, src, len, 0};
    *crc = 0;
    if (len && fp_guarded(copy_once, &c) < 0) {
        fp_set_error("copying %zu bytes: reading the source memory faulted (SIGBUS): was a "
                     "shared-memory segment truncated while it was being read?", len);
        return -EFAULT;
    }
    *crc = c.crc;
    return 0;
}
