/*
 * The read job: which I/Os read which pieces, and how a completed I/O is
 * finished, independent of how the I/Os are issued (fp_pool.c, fp_uring.c).
 *
 * A segment whose memory and file offset have the same alignment phase is
 * read straight into its memory with O_DIRECT for its aligned middle; its
 * unaligned head and tail, and segments whose phases differ, go through
 * bounce buffers. Bounce pieces that lie close together in the file are read
 * with one I/O (the tail of one tensor and the head of the next usually share
 * a block), so a checkpoint of many small tensors costs few reads.
 *
 * Buffered reads (no O_DIRECT) read every piece in place; for the thread pool
 * the ios are also split into one contiguous span (stream) per thread, which
 * fp_pool.c reads in order through its own descriptor.
 */
#include "fp_internal.h"

#include <errno.h>
#include <stdlib.h>

/* Below this a segment is bounced: one copy is cheaper than three I/Os. */
#define DIRECT_MIN (256u * 1024u)
/* Bounce pieces further apart than this are not read with one I/O. */
#define MAX_GAP (64u * 1024u)

typedef struct {
    fp_read_job *job;
    int direct;
    uint64_t block_size;
    fp_read_io *group; /* bounce group being filled, or NULL */
    uint64_t group_end;
} planner;

static void add_direct(planner *pl, fp_piece piece)
{
    fp_read_job *job = pl->job;
    job->pieces[job->npieces] = piece;
    job->ios[job->nios++] = (fp_read_io){.off = piece.off, .len = piece.len,
                                      .first = job->npieces++, .count = 1};
}

static void add_bounce(planner *pl, fp_piece piece)
{
    fp_read_job *job = pl->job;
    uint64_t end = piece.off + piece.len;
    fp_read_io *g = pl->group;
    /* Segments may overlap, so a piece can start before the open group. */
    if (g && (piece.off < g->off || fp_round_up(end, FP_ALIGN) - g->off > job->bounce_size ||
              piece.off > pl->group_end + MAX_GAP))
        g = NULL;
    if (!g) {
        g = pl->group = &job->ios[job->nios++];
        *g = (fp_read_io){.bounce = 1, .off = fp_round_down(piece.off, FP_ALIGN),
                       .first = job->nbounce};
        pl->group_end = 0;
    }
    if (end > pl->group_end)
        pl->group_end = end;
    g->len = fp_round_up(pl->group_end, FP_ALIGN) - g->off;
    g->count++;
    job->bounce_idx[job->nbounce++] = job->npieces;
    job->pieces[job->npieces++] = piece;
}

/* Add [off, end) of segment s in pieces of at most one block. */
static void add_range(planner *pl, const fp_rseg *seg, size_t s, uint64_t off, uint64_t end,
                      int in_place)
{
    while (off < end) {
        uint64_t n = end - off < pl->block_size ? end - off : pl->block_size;
        fp_piece piece = {.mem = (char *)seg->buf + (off - seg->off), .off = off, .len = n,
                          .seg = s};
        if (in_place)
            add_direct(pl, piece);
        else
            add_bounce(pl, piece);
        off += n;
    }
}

static void plan_segment(planner *pl, const fp_rseg *seg, size_t s)
{
    uint64_t off = seg->off, end = seg->off + seg->len;
    if (!pl->direct) {
        add_range(pl, seg, s, off, end, 1); /* buffered: pread straight into place */
        return;
    }
    uint64_t head = fp_round_up(off, FP_ALIGN), tail = fp_round_down(end, FP_ALIGN);
    int same_phase = (uintptr_t)seg->buf % FP_ALIGN == off % FP_ALIGN;
    if (!same_phase || seg->len < DIRECT_MIN || head >= tail) {
        add_range(pl, seg, s, off, end, 0);
        return;
    }
    add_range(pl, seg, s, off, head, 0);
    add_range(pl, seg, s, head, tail, 1);
    add_range(pl, seg, s, tail, end, 0);
}

typedef struct {
    uint64_t off;
    size_t seg;
} seg_order;

static int by_offset(const void *a, const void *b)
{
    uint64_t x = ((const seg_order *)a)->off, y = ((const seg_order *)b)->off;
    return x < y ? -1 : x > y;
}

int fp_read_plan(fp_read_job *job, const fp_rseg *segs, size_t nsegs, uint64_t block_size,
                 int direct)
{
    size_t maxpieces = 0;
    for (size_t i = 0; i < nsegs; i++)
        maxpieces += segs[i].len / block_size + 3; /* head, tail, rounding */
    seg_order *order = malloc((nsegs ? nsegs : 1) * sizeof *order);
    job->pieces = calloc(maxpieces + 1, sizeof *job->pieces);
    job->bounce_idx = calloc(maxpieces + 1, sizeof *job->bounce_idx);
    job->ios = calloc(maxpieces + 1, sizeof *job->ios);
    if (!order || !job->pieces || !job->bounce_idx || !job->ios) {
        free(order);
        fp_set_error("out of memory planning the reads of %zu segments", nsegs);
        return -ENOMEM;
    }
    for (size_t i = 0; i < nsegs; i++)
        order[i] = (seg_order){.off = segs[i].off, .seg = i};
    qsort(order, nsegs, sizeof *order, by_offset);
    planner pl = {.job = job, .direct = direct, .block_size = block_size};
    for (size_t i = 0; i < nsegs; i++)
        plan_segment(&pl, &segs[order[i].seg], order[i].seg);
    free(order);
    return 0;
}

void fp_read_plan_free(fp_read_job *job)
{
    free(job->stream_first);
    job->stream_first = NULL;
    free(job->pieces);
    free(job->bounce_idx);
    free(job->ios);
    job->pieces = NULL;
    job->bounce_idx = NULL;
    job->ios = NULL;
    job->npieces = job->nbounce = job->nios = 0;
}

/* Split the (in-place, file-ordered) ios of a buffered read into `threads`
 * spans of about equal bytes. */
int fp_read_plan_streams(fp_read_job *job, unsigned threads)
{
    job->stream_first = calloc(threads + 1, sizeof *job->stream_first);
    if (!job->stream_first) {
        fp_set_error("out of memory planning %u read streams", threads);
        return -ENOMEM;
    }
    uint64_t total = 0, done = 0;
    for (size_t k = 0; k < job->nios; k++)
        total += job->ios[k].len;
    size_t k = 0;
    for (unsigned t = 1; t < threads; t++) {
        uint64_t goal = total / threads * t;
        while (k < job->nios && done < goal)
            done += job->ios[k++].len;
        job->stream_first[t] = k;
    }
    job->stream_first[threads] = job->nios;
    job->nstreams = threads;
    return 0;
}

static void fail_short(fp_read_job *job, const fp_piece *p, uint64_t got_end)
{
    fp_fail(&job->st, FP_ETRUNCATED,
            "file is truncated: it ends at byte %llu but bytes %llu..%llu are needed",
            (unsigned long long)got_end, (unsigned long long)p->off,
            (unsigned long long)(p->off + p->len));
}

void fp_read_io_done(fp_read_job *job, const fp_read_io *io, const char *buf, uint64_t got)
{
    if (!io->bounce) {
        fp_piece *p = &job->pieces[io->first];
        if (got < p->len)
            fail_short(job, p, p->off + got);
        else if (job->checksum)
            p->crc = fp_crc32c(0, p->mem, p->len);
        return;
    }
    for (size_t i = io->first; i < io->first + io->count; i++) {
        fp_piece *p = &job->pieces[job->bounce_idx[i]];
        uint64_t rel = p->off - io->off;
        if (rel + p->len > got) {
            fail_short(job, p, io->off + got);
            return;
        }
        p->crc = fp_copy_with_crc(p->mem, buf + rel, p->len, job->checksum);
    }
}
