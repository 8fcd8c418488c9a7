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
 * A caller that reads a whole file can pass a region: one buffer laid out as
 * the file, in which the segments lie at their own offsets. Those segments
 * are then read as one: block-sized I/Os straight into the region, with no
 * bounce copies and no small reads at tensor boundaries, and each I/O
 * checksums the pieces of the segments it holds.
 *
 * Buffered reads (no O_DIRECT) read every piece in place; for the thread pool
 * the ios are also split into one contiguous span (stream) per thread, which
 * fp_pool.c reads in order through its own descriptor.
 *
 * A segment without memory (buf NULL) is only checksummed: its bytes go
 * through bounce buffers, direct or not, and are dropped after their CRC.
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
    int bounce; /* nothing in place: every io through a bounce buffer */
    uint64_t block_size;
    fp_read_io *group; /* bounce group being filled, or NULL */
    uint64_t group_end;
} planner;

static void add_direct(planner *pl, fp_piece piece)
{
    fp_read_job *job = pl->job;
    job->pieces[job->npieces] = piece;
    job->ios[job->nios++] = (fp_read_io){.kind = FP_IO_IN_PLACE, .mem = piece.mem,
                                         .off = piece.off, .len = piece.len,
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
        *g = (fp_read_io){.kind = FP_IO_BOUNCE, .off = fp_round_down(piece.off, FP_ALIGN),
                          .first = job->ngroup};
        pl->group_end = 0;
    }
    if (end > pl->group_end)
        pl->group_end = end;
    g->len = fp_round_up(pl->group_end, FP_ALIGN) - g->off;
    g->count++;
    job->group_idx[job->ngroup++] = job->npieces;
    job->pieces[job->npieces++] = piece;
}

/* Add [off, end) of segment s in pieces of at most one block. */
static void add_range(planner *pl, const fp_rseg *seg, size_t s, uint64_t off, uint64_t end,
                      int in_place)
{
    while (off < end) {
        uint64_t n = end - off < pl->block_size ? end - off : pl->block_size;
        fp_piece piece = {.mem = seg->buf ? (char *)seg->buf + (off - seg->off) : NULL,
                          .off = off, .len = n, .seg = s};
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
    if (!seg->buf) {
        add_range(pl, seg, s, off, end, 0);
        return;
    }
    if (!pl->direct) {
        add_range(pl, seg, s, off, end, 1); /* buffered: pread straight into place */
        return;
    }
    uint64_t head = fp_round_up(off, FP_ALIGN), tail = fp_round_down(end, FP_ALIGN);
    int same_phase = (uintptr_t)seg->buf % FP_ALIGN == off % FP_ALIGN;
    if (pl->bounce || !same_phase || seg->len < DIRECT_MIN || head >= tail) {
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

/* Whether segment s lies in region r at its own file offset. */
static int in_region(const fp_rseg *r, const fp_rseg *s)
{
    return s->len && s->off >= r->off && s->len <= r->len && s->off - r->off <= r->len - s->len &&
           (char *)s->buf == (char *)r->buf + (s->off - r->off);
}

/* The span [*lo, *hi) of the region's ios for its member segments: 0 when
 * none is a member, or the region cannot be read in place (direct reads need
 * its phase to match the file's and its memory to cover the aligned span). */
static int region_span(const fp_rseg *r, const fp_rseg *segs, size_t nsegs, int direct,
                       uint64_t *lo, uint64_t *hi)
{
    int any = 0;
    for (size_t i = 0; i < nsegs; i++) {
        if (!in_region(r, &segs[i]))
            continue;
        uint64_t end = segs[i].off + segs[i].len;
        *lo = any && *lo < segs[i].off ? *lo : segs[i].off;
        *hi = any && *hi > end ? *hi : end;
        any = 1;
    }
    if (!any || !direct)
        return any;
    *lo = fp_round_down(*lo, FP_ALIGN);
    *hi = fp_round_up(*hi, FP_ALIGN);
    return (uintptr_t)r->buf % FP_ALIGN == r->off % FP_ALIGN && *lo >= r->off &&
           *hi - r->off <= r->len;
}

/* The first and last block (of the region's ios from lo) that [off, end) touches. */
static void blocks_of(uint64_t lo, uint64_t block, uint64_t off, uint64_t end, size_t *first,
                      size_t *last)
{
    *first = (size_t)((off - lo) / block);
    *last = (size_t)((end - 1 - lo) / block);
}

/* The region's ios, one a block from lo, and the pieces of its member
 * segments cut at those blocks; each io's pieces are listed together in
 * group_idx (counted first, then placed: overlapping segments may interleave). */
static int plan_region(planner *pl, const fp_rseg *r, const fp_rseg *segs, const seg_order *order,
                       size_t nsegs, uint64_t lo, uint64_t hi)
{
    fp_read_job *job = pl->job;
    uint64_t block = pl->block_size;
    size_t nblocks = (size_t)((hi - lo + block - 1) / block), base = job->nios;
    size_t *fill = calloc(nblocks, sizeof *fill);
    if (!fill) {
        fp_set_error("out of memory planning a read of %zu blocks", nblocks);
        return -ENOMEM;
    }
    for (size_t i = 0; i < nsegs; i++) {
        const fp_rseg *seg = &segs[order[i].seg];
        size_t first, last;
        if (!in_region(r, seg))
            continue;
        blocks_of(lo, block, seg->off, seg->off + seg->len, &first, &last);
        for (size_t k = first; k <= last; k++)
            fill[k]++;
    }
    size_t at = job->ngroup;
    for (size_t k = 0; k < nblocks; k++) {
        uint64_t off = lo + k * block, len = hi - off < block ? hi - off : block;
        /* Bounced, the block lands in a bounce buffer (block_size fits one) and
         * its pieces are copied into the region as they are checksummed. */
        job->ios[job->nios++] = pl->bounce
            ? (fp_read_io){.kind = FP_IO_BOUNCE, .off = off, .len = len, .first = at}
            : (fp_read_io){.kind = FP_IO_REGION, .mem = (char *)r->buf + (off - r->off),
                           .off = off, .len = len, .first = at};
        at += fill[k];
    }
    job->ngroup = at;
    for (size_t i = 0; i < nsegs; i++) {
        size_t s = order[i].seg;
        const fp_rseg *seg = &segs[s];
        size_t first, last;
        if (!in_region(r, seg))
            continue;
        blocks_of(lo, block, seg->off, seg->off + seg->len, &first, &last);
        for (size_t k = first; k <= last; k++) {
            fp_read_io *io = &job->ios[base + k];
            uint64_t a = seg->off > io->off ? seg->off : io->off;
            uint64_t b = seg->off + seg->len < io->off + io->len ? seg->off + seg->len
                                                                 : io->off + io->len;
            job->group_idx[io->first + io->count++] = job->npieces;
            job->pieces[job->npieces++] = (fp_piece){.mem = (char *)seg->buf + (a - seg->off),
                                                     .off = a, .len = b - a, .seg = s};
        }
    }
    free(fill);
    return 0;
}

static int by_io_offset(const void *a, const void *b)
{
    uint64_t x = ((const fp_read_io *)a)->off, y = ((const fp_read_io *)b)->off;
    return x < y ? -1 : x > y;
}

int fp_read_plan(fp_read_job *job, const fp_rseg *segs, size_t nsegs, const fp_rseg *region,
                 uint64_t block_size, int direct, int bounce)
{
    uint64_t lo = 0, hi = 0;
    if (region && !region_span(region, segs, nsegs, direct, &lo, &hi))
        region = NULL;
    size_t maxpieces = 0, region_ios = region ? (size_t)((hi - lo) / block_size + 1) : 0;
    for (size_t i = 0; i < nsegs; i++)
        maxpieces += segs[i].len / block_size + 3; /* head, tail, rounding */
    seg_order *order = malloc((nsegs ? nsegs : 1) * sizeof *order);
    job->pieces = calloc(maxpieces + 1, sizeof *job->pieces);
    job->group_idx = calloc(maxpieces + 1, sizeof *job->group_idx);
    job->ios = calloc(maxpieces + region_ios + 1, sizeof *job->ios);
    if (!order || !job->pieces || !job->group_idx || !job->ios) {
        free(order);
        fp_set_error("out of memory planning the reads of %zu segments", nsegs);
        return -ENOMEM;
    }
    for (size_t i = 0; i < nsegs; i++)
        order[i] = (seg_order){.off = segs[i].off, .seg = i};
    qsort(order, nsegs, sizeof *order, by_offset);
    planner pl = {.job = job, .direct = direct, .bounce = bounce, .block_size = block_size};
    int rc = region ? plan_region(&pl, region, segs, order, nsegs, lo, hi) : 0;
    for (size_t i = 0; rc == 0 && i < nsegs; i++) {
        if (!region || !in_region(region, &segs[order[i].seg]))
            plan_segment(&pl, &segs[order[i].seg], order[i].seg);
    }
    free(order);
    /* Buffered streams read their ios in file order. */
    if (rc == 0 && region && !direct)
        qsort(job->ios, job->nios, sizeof *job->ios, by_io_offset);
    return rc;
}

void fp_read_plan_free(fp_read_job *job)
{
    free(job->stream_first);
    job->stream_first = NULL;
    free(job->pieces);
    free(job->group_idx);
    free(job->ios);
    job->pieces = NULL;
    job->group_idx = NULL;
    job->ios = NULL;
    job->npieces = job->ngroup = job->nios = 0;
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
    if (io->kind == FP_IO_IN_PLACE) {
        fp_piece *p = &job->pieces[io->first];
        if (got < p->len)
            fail_short(job, p, p->off + got);
        else if (job->checksum)
            p->crc = fp_crc32c(0, p->mem, p->len);
        return;
    }
    for (size_t i = io->first; i < io->first + io->count; i++) {
        fp_piece *p = &job->pieces[job->group_idx[i]];
        uint64_t rel = p->off - io->off;
        if (rel + p->len > got) {
            fail_short(job, p, io->off + got);
            return;
        }
        if (io->kind == FP_IO_REGION) /* already in place: buf + rel is p->mem */
            p->crc = job->checksum ? fp_crc32c(0, p->mem, p->len) : 0;
        else if (!p->mem) /* checksum only */
            p->crc = job->checksum ? fp_crc32c(0, buf + rel, p->len) : 0;
        else
            p->crc = fp_copy_with_crc(p->mem, buf + rel, p->len, job->checksum);
    }
}
