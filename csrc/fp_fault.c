/*
 * Surviving SIGBUS while reading the caller's memory.
 *
 * fastpersistd writes straight from its clients' shared-memory segments. A
 * client that truncates a segment after handing it over makes the daemon's
 * reads of that mapping fault with SIGBUS, whose default action kills the
 * daemon, and every other client's checkpoint with it. The engine's reads of
 * caller memory (the copy and checksum of a block) therefore run inside
 * fp_guarded(): a SIGBUS there jumps back out and fails only that write with
 * EFAULT. A SIGBUS anywhere else is passed on to whatever handler was there
 * before ours (Python's faulthandler, say) or gets the default action.
 */
#define _GNU_SOURCE
#include "fp_internal.h"

#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <string.h>

/* Set only while this thread runs a guarded function; cleared before the jump. */
static __thread sigjmp_buf *guard;
static struct sigaction previous;
static pthread_once_t install_once = PTHREAD_ONCE_INIT;

static void on_sigbus(int sig, siginfo_t *info, void *ucontext)
{
    sigjmp_buf *jb = guard;
    if (jb) {
        guard = NULL;
        siglongjmp(*jb, 1);
    }
    if (previous.sa_flags & SA_SIGINFO) {
        previous.sa_sigaction(sig, info, ucontext);
        return;
    }
    if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(sig);
        return;
    }
    /* Not ours and nobody else's: the default action. The raised signal is
     * blocked until this handler returns, then it terminates the process. */
    signal(sig, SIG_DFL);
    raise(sig);
}

static void install(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &previous);
}

int fp_guarded(void (*fn)(void *), void *arg)
{
    pthread_once(&install_once, install);
    sigjmp_buf jb;
    /* savemask=1: the jump leaves the signal handler, which had SIGBUS blocked. */
    if (sigsetjmp(jb, 1))
        return -EFAULT;
    guard = &jb;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    fn(arg);
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    guard = NULL;
    return 0;
}
