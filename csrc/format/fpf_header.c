/*
 * header_json: a safetensors data file's header JSON, as
 * format/safetensors_file.py's header_json writes it: the caller's prefix
 * ('{"__metadata__":{...}'), then for each (name, dtype, shape, nbytes) entry
 * ',"NAME":{"dtype":"DT","shape":[D,...],"data_offsets":[BEGIN,END]}' with
 * the entries back to back from 0, then '}'. A save writes it and a load
 * rebuilds it to compare with the file's own header; with 100,000 tensors
 * the Python loop was a fifth of either.
 *
 * Names and dtypes must be printable ASCII without '"' or '\' (what JSON
 * writes as is); for anything else it returns None and Python writes the
 * header (json's escapes are its own to get right).
 */
#include "fpf.h"

#include <stdio.h>
#include <string.h>

typedef struct {
    char *data;
    size_t len, cap;
} buffer;

static int grow(buffer *b, size_t more)
{
    if (b->len + more <= b->cap)
        return 0;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + more)
        cap *= 2;
    char *data = PyMem_Realloc(b->data, cap);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->cap = cap;
    return 0;
}

static int put(buffer *b, const char *s, size_t n)
{
    if (n == 0)  /* memcpy into a buffer not yet allocated (NULL) is undefined, even of 0 bytes */
        return 0;
    if (grow(b, n) < 0)
        return -1;
    memcpy(b->data + b->len, s, n);
    b->len += n;
    return 0;
}

#define PUT(b, text) put((b), (text), sizeof(text) - 1)

static int put_number(buffer *b, long long v)
{
    char digits[24];
    int n = snprintf(digits, sizeof(digits), "%lld", v);
    return put(b, digits, (size_t)n);
}

/* 1 after writing str `s` as a JSON string; 0 where JSON would escape something. */
static int put_plain_string(buffer *b, PyObject *s)
{
    if (!PyUnicode_Check(s) || !PyUnicode_IS_ASCII(s))
        return 0;
    const char *text = (const char *)PyUnicode_DATA(s);
    Py_ssize_t n = PyUnicode_GET_LENGTH(s);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (text[i] < 0x20 || text[i] == 0x7f || text[i] == '"' || text[i] == '\\')
            return 0;
    }
    if (PUT(b, "\"") < 0 || put(b, text, (size_t)n) < 0 || PUT(b, "\"") < 0)
        return -1;
    return 1;
}

/* 1 with *v for an int in 64 bits (not a bool); 0 otherwise; -1 on error. */
static int as_number(PyObject *o, long long *v)
{
    if (!PyLong_CheckExact(o))
        return 0;
    int overflow;
    *v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (*v == -1 && PyErr_Occurred())
        return -1;
    return overflow == 0;
}

/* One entry; 1 written, 0 for Python to write, -1 on error. */
static int entry(buffer *b, PyObject *e, long long *cursor)
{
    if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 4)
        return 0;
    PyObject *shape = PyTuple_GET_ITEM(e, 2);
    long long nbytes;
    int got = as_number(PyTuple_GET_ITEM(e, 3), &nbytes);
    if (got != 1 || !(PyTuple_Check(shape) || PyList_Check(shape)))
        return got;
    if (nbytes < 0 || *cursor > LLONG_MAX - nbytes)
        return 0;
    if (PUT(b, ",") < 0 || (got = put_plain_string(b, PyTuple_GET_ITEM(e, 0))) != 1)
        return got;
    if (PUT(b, ":{\"dtype\":") < 0 || (got = put_plain_string(b, PyTuple_GET_ITEM(e, 1))) != 1)
        return got;
    if (PUT(b, ",\"shape\":[") < 0)
        return -1;
    Py_ssize_t ndims = PySequence_Fast_GET_SIZE(shape);
    PyObject **dims = PySequence_Fast_ITEMS(shape);
    for (Py_ssize_t i = 0; i < ndims; i++) {
        long long d;
        if ((got = as_number(dims[i], &d)) != 1)
            return got;
        if ((i && PUT(b, ",") < 0) || put_number(b, d) < 0)
            return -1;
    }
    long long end = *cursor + nbytes;
    if (PUT(b, "],\"data_offsets\":[") < 0 || put_number(b, *cursor) < 0 || PUT(b, ",") < 0 ||
        put_number(b, end) < 0 || PUT(b, "]}") < 0)
        return -1;
    *cursor = end;
    return 1;
}

PyObject *fpf_header_json(PyObject *self, PyObject *args)
{
    PyObject *entries;
    Py_buffer prefix;
    if (!PyArg_ParseTuple(args, "Oy*:header_json", &entries, &prefix))
        return NULL;
    PyObject *result = NULL;
    buffer b = {0};
    PyObject *fast = PySequence_Fast(entries, "header_json: entries must be a sequence");
    if (fast == NULL || put(&b, prefix.buf, (size_t)prefix.len) < 0)
        goto done;
    long long cursor = 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        int got = entry(&b, PySequence_Fast_GET_ITEM(fast, i), &cursor);
        if (got < 0)
            goto done;
        if (got == 0) {
            result = Py_NewRef(Py_None);
            goto done;
        }
    }
    if (PUT(&b, "}") == 0)
        result = PyBytes_FromStringAndSize(b.data, (Py_ssize_t)b.len);
done:
    PyMem_Free(b.data);
    Py_XDECREF(fast);
    PyBuffer_Release(&prefix);
    return result;
}
