/*
 * Pieces: the unit that both the write and the read jobs copy and checksum.
 *
 * A segment is cut into pieces at block (write) or I/O (read) boundaries so
 * that threads can checksum the parts of one segment independently; the
 * entry point folds the piece CRCs back into one CRC per segment. This file
 * is what the two jobs share, so that neither has to call the other.
 */
#include "fp_internal.h"

#include <string.h>

/* Copy and checksum in cache-sized steps, so the checksum pulls the bytes into
 * cache for the copy and memory is read once. */
#define COPY_STEP (96u * 1024u)

uint32_t fp_copy_with_crc(char *dst, const char *src, uint64_t len, int checksum)
{
    uint32_t crc = 0;
    for (uint64_t done = 0; done < len;) {
        uint64_t n = len - done < COPY_STEP ? len - done : COPY_STEP;
        if (checksum)
            crc = fp_crc32c(crc, src + done, n);
        memcpy(dst + done, src + done, n);
        done += n;
    }
    return crc;
}

void fp_fold_piece_crcs(const fp_piece *pieces, size_t npieces, uint32_t *crcs, size_t nsegs)
{
    memset(crcs, 0, nsegs * sizeof *crcs);
    for (size_t i = 0; i < npieces; i++)
        crcs[pieces[i].seg] = fp_crc32c_combine(crcs[pieces[i].seg], pieces[i].crc, pieces[i].len);
}
