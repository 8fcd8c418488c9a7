/*
 * The directory operations that a commit needs around the engine's writes:
 * fsync a directory, swap two entries atomically (renameat2 RENAME_EXCHANGE)
 * and open beneath a directory (openat2). Entry points of their own, called
 * by the binding only; no job, no backend.
 */
#define _GNU_SOURCE
#include "fp_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_openat2
#define SYS_openat2 437 /* the same number on every architecture */
#endif

int fp_fsync_dir(const char *path)
{
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) {
        int err = errno;
        fp_set_error("open directory %s: %s", path, strerror(err));
        return -err;
    }
    int rc = 0;
    if (fsync(fd) != 0) {
        rc = -errno;
        fp_set_error("fsync directory %s: %s", path, strerror(errno));
    }
    close(fd);
    return rc;
}

#ifndef RENAME_EXCHANGE
#define RENAME_EXCHANGE (1 << 1)
#endif

int fp_rename_exchange(const char *a, const char *b)
{
    return fp_rename_exchange_at(AT_FDCWD, a, AT_FDCWD, b);
}

int fp_rename_exchange_at(int a_dir, const char *a, int b_dir, const char *b)
{
    /* Through syscall(): glibc gained a renameat2 wrapper only in 2.28. */
    if (syscall(SYS_renameat2, a_dir, a, b_dir, b, RENAME_EXCHANGE) != 0) {
        int err = errno;
        fp_set_error("exchange %s and %s: %s", a, b, strerror(err));
        return -err;
    }
    return 0;
}

int fp_openat2(int dir_fd, const char *path, uint64_t flags, uint64_t mode, uint64_t resolve)
{
    struct open_how how = {.flags = flags, .mode = mode, .resolve = resolve};
    /* Through syscall(): glibc has no openat2 wrapper before 2.39. */
    long fd = syscall(SYS_openat2, dir_fd, path, &how, sizeof how);
    if (fd < 0) {
        int err = errno;
        fp_set_error("openat2 %s: %s", path, strerror(err));
        return -err;
    }
    return (int)fd;
}
