/*
 * fastpersist._engine: the Python face of the C engine. It only converts:
 * Python arguments into fp_engine.h calls, and their results and errors back
 * into Python objects and exceptions; the checks and the I/O are the engine's.
 *
 * Buffers come in through the buffer protocol and are never copied here
 * (gather, a snapshot's batched memcpy, aside); the GIL is released for the
 * whole of every I/O call, so other Python threads (a training loop) run
 * while a checkpoint is written.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "fp_engine.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <stdlib.h>
#include <string.h>

/*
 * The segments of one call: each (buffer, offset) pair's buffer, held from
 * acquire_segments to release_segments, as the engine's fp_wseg (writes) or
 * fp_rseg (reads) list, with room for the CRC of each.
 */
typedef struct {
    Py_buffer *views;
    Py_ssize_t n; /* buffers held, and entries of segs and crcs */
    void *segs;   /* fp_wseg[n] or fp_rseg[n] */
    uint32_t *crcs;
} seg_list;

_Static_assert(sizeof(fp_wseg) == sizeof(fp_rseg), "one allocation serves both lists");

static void release_segments(seg_list *sl)
{
    for (Py_ssize_t i = 0; i < sl->n; i++)
        PyBuffer_Release(&sl->views[i]);
    PyMem_Free(sl->views);
    PyMem_Free(sl->segs);
    PyMem_Free(sl->crcs);
    *sl = (seg_list){0};
}

/* Acquire every (buffer, offset) pair of `seq`, writable ones for a read. A
 * read's segment may also be (None, offset, length): checksummed, not kept. */
static int acquire_segments(PyObject *seq, int writable, seg_list *sl)
{
    PyObject *fast = PySequence_Fast(seq, "segments must be a sequence of (buffer, offset)");
    if (!fast)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    size_t room = n ? (size_t)n : 1;
    sl->views = PyMem_Calloc(room, sizeof(Py_buffer));
    sl->segs = PyMem_Calloc(room, sizeof(fp_rseg));
    sl->crcs = PyMem_Calloc(room, sizeof(uint32_t));
    sl->n = 0;
    if (!sl->views || !sl->segs || !sl->crcs) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        PyObject *obj;
        unsigned long long off, len = 0;
        int unkept = writable && PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 3 &&
                     PyTuple_GET_ITEM(item, 0) == Py_None;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2 + unkept ||
            !PyArg_ParseTuple(item, "OK|K", &obj, &off, &len)) {
            PyErr_Format(PyExc_TypeError, "segment %zd must be a (buffer, offset) tuple%s", i,
                         writable ? " or (None, offset, length)" : "");
            goto fail;
        }
        if (unkept) { /* the view stays empty: release_segments skips it */
            sl->n = i + 1;
            ((fp_rseg *)sl->segs)[i] = (fp_rseg){NULL, off, (uint64_t)len};
            continue;
        }
        Py_buffer *v = &sl->views[i];
        if (PyObject_GetBuffer(obj, v, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
            goto fail;
        sl->n = i + 1;
        if (writable)
            ((fp_rseg *)sl->segs)[i] = (fp_rseg){v->buf, off, (uint64_t)v->len};
        else
            ((fp_wseg *)sl->segs)[i] = (fp_wseg){v->buf, off, (uint64_t)v->len};
    }
    Py_DECREF(fast);
    return 0;
fail:
    Py_DECREF(fast);
    release_segments(sl);
    return -1;
}

/* read_file's region: one writable (buffer, offset), held as a one-entry list. */
static int acquire_region(PyObject *region, seg_list *sl)
{
    PyObject *one = PyTuple_Pack(1, region);
    if (!one)
        return -1;
    int rc = acquire_segments(one, 1, sl);
    Py_DECREF(one);
    if (rc == 0 && !((fp_rseg *)sl->segs)[0].buf) { /* (None, offset, length) */
        release_segments(sl);
        PyErr_SetString(PyExc_TypeError, "region must be a (buffer, offset) tuple or None");
        return -1;
    }
    if (rc < 0 && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "region must be a (buffer, offset) tuple or None");
    }
    return rc;
}

/*
 * Keyword defaults of write_file/read_file. Pool: medians of 11 interleaved
 * 2 GiB runs, 8 MiB blocks, 64 MiB of buffers: pool x8 write 1.80 / cold read
 * 2.42 GB/s vs io_uring 2 threads x4 1.66 / 2.23 (x8: 1.85 / 2.22).
 */
#define DEFAULT_BACKEND FP_BACKEND_POOL
#define DEFAULT_QUEUE_DEPTH 8

/* Out-of-range values (negative ones included) fail the engine's check. */
static int parse_opts(fp_opts *o, Py_ssize_t block_size, int threads, int direct, int backend,
                      int queue_depth)
{
    o->block_size = block_size > 0 ? (size_t)block_size : 0;
    o->threads = (unsigned)threads;
    o->direct = (fp_direct_mode)direct;
    o->backend = (fp_backend)backend;
    o->queue_depth = (unsigned)queue_depth;
    if (fp_check_opts(o) < 0) {
        PyErr_SetString(PyExc_ValueError, fp_last_error());
        return -1;
    }
    return 0;
}

static PyObject *raise_engine_error(int rc, PyObject *path)
{
    if (rc == -FP_ETRUNCATED) {
        PyErr_SetString(PyExc_EOFError, fp_last_error());
        return NULL;
    }
    if (rc == -FP_EBADARG) {
        PyErr_SetString(PyExc_ValueError, fp_last_error());
        return NULL;
    }
    /* OSError(errno, message, filename) becomes the matching subclass. */
    PyObject *args = Py_BuildValue("(isO)", -rc, fp_last_error(), path);
    if (args) {
        PyErr_SetObject(PyExc_OSError, args);
        Py_DECREF(args);
    }
    return NULL;
}

/* What write_file and read_file return: (the segments' CRCs, or None without
 * them, whether O_DIRECT was used), or the engine's error raised. */
static PyObject *io_result(int rc, PyObject *path, const seg_list *sl, int with_crcs,
                           int used_direct)
{
    if (rc < 0)
        return raise_engine_error(rc, path);
    PyObject *direct = used_direct ? Py_True : Py_False;
    if (!with_crcs)
        return Py_BuildValue("(OO)", Py_None, direct);
    PyObject *list = PyList_New(sl->n);
    for (Py_ssize_t i = 0; list && i < sl->n; i++) {
        PyObject *v = PyLong_FromUnsignedLong(sl->crcs[i]);
        if (!v) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, v);
    }
    return list ? Py_BuildValue("(NO)", list, direct) : NULL;
}

PyDoc_STRVAR(write_file_doc,
             "write_file(path, segments, size, block_size, threads, direct, fsync=True, *,\n"
             "           backend=BACKEND_POOL, queue_depth=8, dir_fd=AT_FDCWD)\n"
             "--\n\n"
             "Write `size` bytes to `path`: each (buffer, offset) segment at its offset,\n"
             "zeros in gaps. Segments must be sorted and must not overlap. Returns\n"
             "(crc32c of each segment, whether O_DIRECT was used). With fsync the file\n"
             "is durable on return; its directory entry is not (see fsync_dir).\n"
             "With dir_fd (an open directory), `path` is a new file's plain name in it,\n"
             "created with O_EXCL | O_NOFOLLOW (FileExistsError if it exists).\n"
             "backend: BACKEND_POOL (threads, one blocking I/O each), BACKEND_URING\n"
             "(min(threads, CPUs) threads, each with its own io_uring and queue_depth\n"
             "I/Os in flight) or BACKEND_AUTO (io_uring unless it is refused here).");

static PyObject *py_write_file(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"path", "segments", "size", "block_size", "threads", "direct",
                             "fsync", "backend", "queue_depth", "dir_fd", NULL};
    PyObject *path = NULL, *seq;
    unsigned long long size;
    Py_ssize_t block_size;
    int threads, direct, do_fsync = 1, backend = DEFAULT_BACKEND;
    int queue_depth = DEFAULT_QUEUE_DEPTH, dir_fd = AT_FDCWD;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&OKnii|p$iii", kwlist, PyUnicode_FSConverter,
                                     &path, &seq, &size, &block_size, &threads, &direct,
                                     &do_fsync, &backend, &queue_depth, &dir_fd))
        return NULL;
    fp_opts opts = {.fsync = do_fsync, .checksum = 1};
    seg_list sl = {0};
    PyObject *result = NULL;
    if (parse_opts(&opts, block_size, threads, direct, backend, queue_depth) == 0 &&
        acquire_segments(seq, 0, &sl) == 0) {
        int rc, used_direct = 0;
        Py_BEGIN_ALLOW_THREADS
        rc = fp_write_file_at(dir_fd, PyBytes_AS_STRING(path), sl.segs, (size_t)sl.n, size,
                              &opts, sl.crcs, &used_direct);
        Py_END_ALLOW_THREADS
        result = io_result(rc, path, &sl, 1, used_direct);
    }
    release_segments(&sl);
    Py_XDECREF(path);
    return result;
}

PyDoc_STRVAR(read_file_doc,
             "read_file(path, segments, block_size, threads, direct, checksum=True, *,\n"
             "          backend=BACKEND_POOL, queue_depth=8, region=None, bounce=False)\n"
             "--\n\n"
             "Fill each writable (buffer, offset) segment with the file's bytes at that\n"
             "offset, in parallel. Returns (crc32c of each segment or None, whether\n"
             "O_DIRECT was used). Raises EOFError if the file is too short. backend and\n"
             "queue_depth as for write_file. region: a writable (buffer, offset) laid\n"
             "out as the file from offset; segments that are views of it at their own\n"
             "offsets are read with large I/Os straight into it (bytes between them too).\n"
             "A segment (None, offset, length) is read through bounce buffers for its\n"
             "CRC32C only (a verify): no memory of the caller's holds its bytes.\n"
             "bounce: with O_DIRECT, read nothing in place (the region included): every\n"
             "block lands in a bounce buffer and is copied into place as it is checksummed.");

static PyObject *py_read_file(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"path", "segments", "block_size", "threads", "direct", "checksum",
                             "backend", "queue_depth", "region", "bounce", NULL};
    PyObject *path = NULL, *seq, *region_arg = Py_None;
    Py_ssize_t block_size;
    int threads, direct, checksum = 1, backend = DEFAULT_BACKEND, bounce = 0;
    int queue_depth = DEFAULT_QUEUE_DEPTH;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&Onii|p$iiOp", kwlist, PyUnicode_FSConverter,
                                     &path, &seq, &block_size, &threads, &direct, &checksum,
                                     &backend, &queue_depth, &region_arg, &bounce))
        return NULL;
    fp_opts opts = {.checksum = checksum, .bounce = bounce};
    seg_list sl = {0}, region = {0};
    PyObject *result = NULL;
    if (parse_opts(&opts, block_size, threads, direct, backend, queue_depth) == 0 &&
        acquire_segments(seq, 1, &sl) == 0 &&
        (region_arg == Py_None || acquire_region(region_arg, &region) == 0)) {
        int rc, used_direct = 0;
        Py_BEGIN_ALLOW_THREADS
        rc = fp_read_file(PyBytes_AS_STRING(path), sl.segs, (size_t)sl.n,
                          region.n ? region.segs : NULL, &opts, checksum ? sl.crcs : NULL,
                          &used_direct);
        Py_END_ALLOW_THREADS
        result = io_result(rc, path, &sl, checksum, used_direct);
    }
    release_segments(&region);
    release_segments(&sl);
    Py_XDECREF(path);
    return result;
}

static PyObject *py_crc32c(PyObject *self, PyObject *args)
{
    Py_buffer view;
    unsigned int value = 0;
    if (!PyArg_ParseTuple(args, "y*|I:crc32c", &view, &value))
        return NULL;
    uint32_t crc;
    Py_BEGIN_ALLOW_THREADS
    crc = fp_crc32c(value, view.buf, (size_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *py_crc32c_combine(PyObject *self, PyObject *args)
{
    unsigned int a, b;
    unsigned long long len2;
    if (!PyArg_ParseTuple(args, "IIK:crc32c_combine", &a, &b, &len2))
        return NULL;
    return PyLong_FromUnsignedLong(fp_crc32c_combine(a, b, len2));
}

static PyObject *path_call(PyObject *args, const char *fmt, int (*fn)(const char *))
{
    PyObject *path = NULL;
    if (!PyArg_ParseTuple(args, fmt, PyUnicode_FSConverter, &path))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = fn(PyBytes_AS_STRING(path));
    Py_END_ALLOW_THREADS
    PyObject *res = rc < 0 ? raise_engine_error(rc, path) : Py_NewRef(Py_None);
    Py_DECREF(path);
    return res;
}

static PyObject *py_fsync_dir(PyObject *self, PyObject *args)
{
    return path_call(args, "O&:fsync_dir", fp_fsync_dir);
}

static PyObject *py_rename_exchange(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"a", "b", "dir_fd", NULL};
    PyObject *a = NULL, *b = NULL;
    int dir_fd = AT_FDCWD;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&O&|$i:rename_exchange", kwlist,
                                     PyUnicode_FSConverter, &a, PyUnicode_FSConverter, &b,
                                     &dir_fd)) {
        Py_XDECREF(a);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = fp_rename_exchange_at(dir_fd, PyBytes_AS_STRING(a), dir_fd, PyBytes_AS_STRING(b));
    Py_END_ALLOW_THREADS
    PyObject *res = rc < 0 ? raise_engine_error(rc, a) : Py_NewRef(Py_None);
    Py_DECREF(a);
    Py_DECREF(b);
    return res;
}

static PyObject *py_openat2(PyObject *self, PyObject *args)
{
    PyObject *path = NULL;
    int dir_fd;
    unsigned long long flags, mode, resolve;
    if (!PyArg_ParseTuple(args, "iO&KKK:openat2", &dir_fd, PyUnicode_FSConverter, &path, &flags,
                          &mode, &resolve))
        return NULL;
    int fd;
    Py_BEGIN_ALLOW_THREADS
    fd = fp_openat2(dir_fd, PyBytes_AS_STRING(path), flags, mode, resolve);
    Py_END_ALLOW_THREADS
    PyObject *res;
    if (fd < 0) {
        errno = -fd; /* OSError's subclass for the errno, as os.open raises */
        res = PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
    } else {
        res = PyLong_FromLong(fd);
    }
    Py_DECREF(path);
    return res;
}

/* The i-th int of a PySequence_Fast as a size_t (-1 and an exception if it is
 * not a non-negative int). */
static int fast_size(PyObject *fast, Py_ssize_t i, size_t *out)
{
    PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
    size_t v = PyLong_AsSize_t(item);
    if (v == (size_t)-1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

/*
 * gather(dst, addresses, offsets, lengths, threads=1): fp_gather of
 * (addresses[i], offsets[i], lengths[i]) for every i, with the GIL released.
 * A snapshot of many small tensors copies them all in one call instead of one
 * torch copy_ (and one view) each. The source addresses are the caller's
 * promise (live, contiguous CPU memory of at least that length).
 */
static PyObject *py_gather(PyObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"dst", "addresses", "offsets", "lengths", "threads", NULL};
    Py_buffer dst;
    PyObject *addresses, *offsets, *lengths;
    int threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "w*OOO|i:gather", kwlist, &dst, &addresses,
                                     &offsets, &lengths, &threads))
        return NULL;
    PyObject *fa = PySequence_Fast(addresses, "addresses must be a sequence of ints");
    PyObject *fo = fa ? PySequence_Fast(offsets, "offsets must be a sequence of ints") : NULL;
    PyObject *fl = fo ? PySequence_Fast(lengths, "lengths must be a sequence of ints") : NULL;
    PyObject *res = NULL;
    fp_gather_item *items = NULL;
    if (!fl)
        goto done;
    if (threads < 1) {
        PyErr_Format(PyExc_ValueError, "gather: threads must be at least 1, not %d", threads);
        goto done;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fa);
    if (PySequence_Fast_GET_SIZE(fo) != n || PySequence_Fast_GET_SIZE(fl) != n) {
        PyErr_SetString(PyExc_ValueError, "addresses, offsets and lengths differ in length");
        goto done;
    }
    items = PyMem_Malloc((n ? (size_t)n : 1) * sizeof *items);
    if (!items) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        size_t src;
        if (fast_size(fa, i, &src) < 0 || fast_size(fo, i, &items[i].dst_off) < 0 ||
            fast_size(fl, i, &items[i].len) < 0)
            goto done;
        items[i].src = (const void *)src;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = fp_gather(dst.buf, (size_t)dst.len, items, (size_t)n, (unsigned)threads);
    Py_END_ALLOW_THREADS
    res = rc < 0 ? raise_engine_error(rc, Py_None) : Py_NewRef(Py_None);
done:
    PyMem_Free(items);
    Py_XDECREF(fa);
    Py_XDECREF(fo);
    Py_XDECREF(fl);
    PyBuffer_Release(&dst);
    return res;
}

/*
 * copy(dst, src) -> CRC32C: dst[:] = src, with the GIL released, where reading
 * src may fault (fastpersistd reads its clients' shared memory, which a client
 * may truncate): a SIGBUS raises OSError(EFAULT) instead of killing the
 * process. Returns the CRC32C of the bytes, computed as they are copied.
 */
static PyObject *py_copy(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*:copy", &dst, &src))
        return NULL;
    PyObject *res = NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy: the destination holds %zd bytes, the source %zd",
                     dst.len, src.len);
        goto done;
    }
    int rc;
    uint32_t crc;
    Py_BEGIN_ALLOW_THREADS
    rc = fp_copy_guarded(dst.buf, src.buf, (size_t)src.len, &crc);
    Py_END_ALLOW_THREADS
    res = rc < 0 ? raise_engine_error(rc, Py_None) : PyLong_FromUnsignedLong(crc);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return res;
}

static PyObject *py_uring_available(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(fp_uring_probe() == 0);
}

static PyObject *py_release_buffers(PyObject *self, PyObject *unused)
{
    fp_bounce_release_all();
    Py_RETURN_NONE;
}

static PyObject *py_set_huge_buffers(PyObject *self, PyObject *arg)
{
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    fp_bounce_set_huge(on);
    Py_RETURN_NONE;
}

static PyObject *py_cached_buffer_bytes(PyObject *self, PyObject *unused)
{
    return PyLong_FromSize_t(fp_bounce_cached_bytes());
}

static PyMethodDef methods[] = {
    {"write_file", (PyCFunction)(void (*)(void))py_write_file, METH_VARARGS | METH_KEYWORDS,
     write_file_doc},
    {"read_file", (PyCFunction)(void (*)(void))py_read_file, METH_VARARGS | METH_KEYWORDS,
     read_file_doc},
    {"crc32c", py_crc32c, METH_VARARGS, "crc32c(data, value=0): CRC32C of data, continuing value."},
    {"crc32c_combine", py_crc32c_combine, METH_VARARGS,
     "crc32c_combine(crc1, crc2, len2): CRC32C of A+B from crc(A), crc(B), len(B)."},
    {"fsync_dir", py_fsync_dir, METH_VARARGS, "fsync_dir(path): make a directory's entries durable."},
    {"rename_exchange", (PyCFunction)(void (*)(void))py_rename_exchange,
     METH_VARARGS | METH_KEYWORDS,
     "rename_exchange(a, b, *, dir_fd=AT_FDCWD): atomically swap two paths (renameat2\n"
     "RENAME_EXCHANGE), both relative to dir_fd."},
    {"openat2", py_openat2, METH_VARARGS,
     "openat2(dir_fd, path, flags, mode, resolve) -> fd: openat2(2), e.g. with\n"
     "RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS. OSError (ENOSYS where it is missing)."},
    {"gather", (PyCFunction)(void (*)(void))py_gather, METH_VARARGS | METH_KEYWORDS,
     "gather(dst, addresses, offsets, lengths, threads=1): copy lengths[i] bytes from raw\n"
     "address addresses[i] into dst at offsets[i], for every i (GIL released), on up to\n"
     "`threads` threads (one for a batch of a few MiB)."},
    {"copy", py_copy, METH_VARARGS,
     "copy(dst, src) -> CRC32C: dst[:] = src; a SIGBUS reading src raises OSError(EFAULT)."},
    {"uring_available", py_uring_available, METH_NOARGS,
     "Whether io_uring works here (BACKEND_AUTO falls back to the thread pool if not)."},
    {"release_buffers", py_release_buffers, METH_NOARGS, "Free the cached bounce buffers."},
    {"set_huge_buffers", py_set_huge_buffers, METH_O,
     "set_huge_buffers(on): whether bounce buffers allocated from now on ask for\n"
     "transparent huge pages (the default; cached ones keep what they have)."},
    {"cached_buffer_bytes", py_cached_buffer_bytes, METH_NOARGS,
     "Bytes of bounce buffers kept for the next call."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fastpersist._engine", "fastpersist's C direct-I/O engine.", -1, methods,
};

PyMODINIT_FUNC PyInit__engine(void)
{
    fp_crc32c_init();
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    if (PyModule_AddIntConstant(m, "DIRECT_OFF", FP_DIRECT_OFF) < 0 ||
        PyModule_AddIntConstant(m, "DIRECT_ON", FP_DIRECT_ON) < 0 ||
        PyModule_AddIntConstant(m, "DIRECT_AUTO", FP_DIRECT_AUTO) < 0 ||
        PyModule_AddIntConstant(m, "BACKEND_POOL", FP_BACKEND_POOL) < 0 ||
        PyModule_AddIntConstant(m, "BACKEND_URING", FP_BACKEND_URING) < 0 ||
        PyModule_AddIntConstant(m, "BACKEND_AUTO", FP_BACKEND_AUTO) < 0 ||
        PyModule_AddIntConstant(m, "MAX_QUEUE_DEPTH", FP_MAX_QUEUE_DEPTH) < 0 ||
        PyModule_AddIntConstant(m, "ALIGNMENT", FP_ALIGN) < 0 ||
        PyModule_AddIntConstant(m, "AT_FDCWD", AT_FDCWD) < 0 ||
        PyModule_AddIntConstant(m, "RESOLVE_NO_XDEV", RESOLVE_NO_XDEV) < 0 ||
        PyModule_AddIntConstant(m, "RESOLVE_NO_MAGICLINKS", RESOLVE_NO_MAGICLINKS) < 0 ||
        PyModule_AddIntConstant(m, "RESOLVE_NO_SYMLINKS", RESOLVE_NO_SYMLINKS) < 0 ||
        PyModule_AddIntConstant(m, "RESOLVE_BENEATH", RESOLVE_BENEATH) < 0 ||
        PyModule_AddStringConstant(m, "CRC32C_IMPL", fp_crc32c_impl()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
