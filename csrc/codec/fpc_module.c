/*
 * fastpersist._codec: the Python face of the codec's C core (fpc.h). It
 * converts buffers and results only; the GIL is released for all the work,
 * so the codec's threads run in parallel.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "fpc.h"

static int check_unit(unsigned unit)
{
    if (unit == 1 || unit == 2 || unit == 4 || unit == 8)
        return 0;
    PyErr_Format(PyExc_ValueError, "a unit of %u bytes (expected 1, 2, 4 or 8)", unit);
    return -1;
}

static PyObject *py_split(PyObject *self, PyObject *args)
{
    Py_buffer raw, out;
    unsigned unit;
    int rotate;
    if (!PyArg_ParseTuple(args, "y*Ipw*:split", &raw, &unit, &rotate, &out))
        return NULL;
    PyObject *result = NULL;
    if (check_unit(unit) == 0) {
        if (raw.len % unit || out.len != raw.len)
            PyErr_Format(PyExc_ValueError, "split: %zd raw bytes in %u-byte units into %zd bytes",
                         raw.len, unit, out.len);
        else {
            Py_BEGIN_ALLOW_THREADS
            fpc_split(raw.buf, (size_t)raw.len / unit, unit, rotate, out.buf);
            Py_END_ALLOW_THREADS
            result = Py_NewRef(Py_None);
        }
    }
    PyBuffer_Release(&raw);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *py_merge(PyObject *self, PyObject *args)
{
    PyObject *seq;
    unsigned unit;
    int rotate;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "OIpw*:merge", &seq, &unit, &rotate, &out))
        return NULL;
    Py_buffer views[8];
    const uint8_t *planes[8];
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    PyObject *fast = PySequence_Fast(seq, "merge: planes must be a sequence of buffers");
    if (fast == NULL || check_unit(unit) < 0)
        goto done;
    if (PySequence_Fast_GET_SIZE(fast) != (Py_ssize_t)unit || out.len % unit) {
        PyErr_Format(PyExc_ValueError, "merge: %zd planes into %zd bytes of %u-byte units",
                     PySequence_Fast_GET_SIZE(fast), out.len, unit);
        goto done;
    }
    Py_ssize_t units = out.len / unit;
    for (; held < (Py_ssize_t)unit; held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, held), &views[held],
                               PyBUF_SIMPLE) < 0)
            goto done;
        if (views[held].len != units) {
            PyErr_Format(PyExc_ValueError, "merge: plane %zd holds %zd bytes, expected %zd",
                         held, views[held].len, units);
            held++;
            goto done;
        }
        planes[held] = views[held].buf;
    }
    Py_BEGIN_ALLOW_THREADS
    fpc_merge(planes, (size_t)units, unit, rotate, out.buf);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    Py_XDECREF(fast);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *py_zstd_literals(PyObject *self, PyObject *args)
{
    Py_buffer src;
    if (!PyArg_ParseTuple(args, "y*:zstd_literals", &src))
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, src.len + FPC_SLACK);
    if (out == NULL) {
        PyBuffer_Release(&src);
        return NULL;
    }
    size_t size;
    Py_BEGIN_ALLOW_THREADS
    size = fpc_zstd_literals(src.buf, (size_t)src.len, (uint8_t *)PyBytes_AS_STRING(out));
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    if (size == FPC_NOT_SMALLER || size == FPC_UNSUPPORTED) {
        Py_DECREF(out);
        return PyLong_FromLong(size == FPC_NOT_SMALLER ? 0 : 1);
    }
    if (_PyBytes_Resize(&out, (Py_ssize_t)size) < 0)
        return NULL;
    return out;
}

static PyMethodDef methods[] = {
    {"split", py_split, METH_VARARGS,
     "split(raw, unit, rotate, out): raw's byte planes into out (same length)."},
    {"merge", py_merge, METH_VARARGS,
     "merge(planes, unit, rotate, out): the units that `unit` planes hold, into out."},
    {"zstd_literals", py_zstd_literals, METH_VARARGS,
     "zstd_literals(plane) -> bytes | int: a zstd frame of Huffman-coded literals, or "
     "NOT_SMALLER, or UNSUPPORTED (use a general zstd encoder)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fastpersist._codec",
    "The codec's C core: byte planes and literals-only zstd frames.", -1, methods,
};

PyMODINIT_FUNC PyInit__codec(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "NOT_SMALLER", 0) < 0 ||
        PyModule_AddIntConstant(m, "UNSUPPORTED", 1) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
