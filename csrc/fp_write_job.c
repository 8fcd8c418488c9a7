/*
 * The write job: what goes into each block of the file, independent of how
 * the block is written (fp_pool.c, fp_uring.c).
 *
 * The file is cut into blocks of opts->block_size. A block is assembled in an
 * aligned bounce buffer: the segment pieces that fall in it are copied in
 * (and checksummed in the same pass, while the bytes are in cache), zeros in
 * the gaps, and the backend writes it with one large aligned write. Where the
 * caller's memory is already laid out as the block, the backend writes from
 * it directly and only the checksum passes over it.
 */
#include "fp_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* Split segments at block boundaries into pieces, in file order. */
int fp_write_plan(fp_write_job *job, const fp_wseg *segs, size_t nsegs)
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

void fp_write_plan_free(fp_write_job *job)
{
    free(job->pieces);
    free(job->block_first);
    job->pieces = NULL;
    job->block_first = NULL;
}

/*
 * Copy block k's pieces into buf (block_size bytes), zeros in the gaps,
 * checksumming each piece in the same pass. Returns the bytes to write at
 * k * block_size: the block, rounded up to FP_ALIGN under O_DIRECT.
 */
static uint64_t fill_block(fp_write_job *job, uint64_t k, char *buf)
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
        c->wlen = fill_block(c->job, c->k, c->buf);
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
