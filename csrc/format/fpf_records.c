/*
 * scan_records: a manifest's raw tensor records, parsed from the exact
 * text fastpersist writes (one record a line, keys in one order, compact
 * separators, printable ASCII strings without escapes) and checked as
 * format/records.py checks them, at C speed: with 100,000 small tensors,
 * Python's JSON decoder (with its duplicate-key hook) and the record checks
 * were most of a load's time.
 *
 * It accepts a subset of what the general parser accepts and returns None,
 * not an error, for anything else (another spelling, a compressed record, a
 * value out of bounds, two records sharing a name or a byte): the caller
 * then parses the manifest the general way, which decides and words the
 * error. So it never changes what a manifest means, only how fast a
 * manifest of the usual spelling is read.
 */
#include "fpf.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *p;
    const char *end;
} cursor;

typedef struct {
    /* The bounds of format/bounds.py, passed in so that they live in one place. */
    unsigned long long max_dims, max_elements, max_file_bytes, crc_max;
} limits;

typedef struct {
    Py_ssize_t file; /* index of the record's file, for the overlap check */
    unsigned long long start, end;
} span;

static int literal(cursor *c, const char *text, size_t n)
{
    if ((size_t)(c->end - c->p) < n || memcmp(c->p, text, n) != 0)
        return 0;
    c->p += n;
    return 1;
}

#define LITERAL(c, text) literal((c), (text), sizeof(text) - 1)

/* A JSON string of printable ASCII without escapes: [*s, *s + *n). */
static int string(cursor *c, const char **s, Py_ssize_t *n)
{
    if (c->p >= c->end || *c->p != '"')
        return 0;
    const char *start = ++c->p;
    for (; c->p < c->end; c->p++) {
        unsigned char ch = (unsigned char)*c->p;
        if (ch == '"') {
            *s = start;
            *n = c->p - start;
            c->p++;
            return 1;
        }
        if (ch < 0x20 || ch > 0x7e || ch == '\\')
            return 0;
    }
    return 0;
}

/* A non-negative JSON integer of at most 19 digits (so it fits in 64 bits). */
static int integer(cursor *c, unsigned long long *value)
{
    const char *start = c->p;
    unsigned long long v = 0;
    while (c->p < c->end && *c->p >= '0' && *c->p <= '9' && c->p - start < 20)
        v = v * 10 + (unsigned long long)(*c->p++ - '0');
    Py_ssize_t digits = c->p - start;
    if (digits == 0 || digits > 19 || (digits > 1 && *start == '0'))
        return 0; /* none, too long, or a leading zero (not JSON) */
    *value = v;
    return 1;
}

static int compare_spans(const void *a, const void *b)
{
    const span *x = a, *y = b;
    if (x->file != y->file)
        return x->file < y->file ? -1 : 1;
    if (x->start != y->start)
        return x->start < y->start ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return 0;
}

/* Interned field names of format/records.py's TensorRecord, in its order. */
enum { NAME, FILE_, OFFSET, LENGTH, DTYPE, SHAPE, CRC32C, ENCODING, STORED_LENGTH, FRAMES, FIELDS };
static const char *const FIELD_NAMES[FIELDS] = {
    "name", "file", "offset", "length", "dtype", "shape", "crc32c", "encoding",
    "stored_length", "frames",
};
static PyObject *field[FIELDS];

int fpf_records_init(void)
{
    for (size_t i = 0; i < FIELDS; i++) {
        if (field[i] == NULL && (field[i] = PyUnicode_InternFromString(FIELD_NAMES[i])) == NULL)
            return -1;
    }
    return 0;
}

/* A str of the manifest's text and what it was looked up to, kept while the
 * next records name the same file or dtype (they mostly do). */
typedef struct {
    PyObject *text;
    unsigned long long a, b, c;
} cached;

/* 1 with *obj (a new reference) and cache->a.. filled for the text [s, s + n),
 * looked up in `table` (a miss: 0) and converted by `convert` (0: refuse). */
static int lookup(const char *s, Py_ssize_t n, PyObject *table, cached *cache,
                  int (*convert)(PyObject *, cached *), PyObject **obj)
{
    PyObject *last = cache->text;
    if (last != NULL && PyUnicode_GET_LENGTH(last) == n &&
        memcmp(PyUnicode_DATA(last), s, (size_t)n) == 0) {
        *obj = Py_NewRef(last);
        return 1;
    }
    PyObject *text = PyUnicode_DecodeASCII(s, n, NULL);
    if (text == NULL)
        return -1;
    PyObject *value = PyDict_GetItemWithError(table, text);
    int got = value == NULL ? (PyErr_Occurred() ? -1 : 0) : convert(value, cache);
    if (got != 1) {
        Py_DECREF(text);
        return got;
    }
    Py_XSETREF(cache->text, Py_NewRef(text));
    *obj = text;
    return 1;
}

static int file_entry(PyObject *value, cached *cache)
{
    Py_ssize_t index;
    if (!PyArg_ParseTuple(value, "nKK", &index, &cache->b, &cache->c))
        return -1;
    cache->a = (unsigned long long)index;
    return 1;
}

static int dtype_entry(PyObject *value, cached *cache)
{
    cache->a = PyLong_AsUnsignedLongLong(value);
    return PyErr_Occurred() ? -1 : 1;
}

typedef struct {
    PyObject *files;     /* name -> (index, data_start, size) */
    PyObject *itemsizes; /* dtype name -> bytes an element */
    PyObject *type;      /* TensorRecord */
    PyObject *raw;       /* the "raw" encoding's str */
    limits lim;
    cached file, dtype;  /* file: a index, b data_start, c size; dtype: a itemsize */
} context;

/* 1 with *out (a new record) and *name (borrowed from it) for a record in the
 * usual spelling that passes every check; 0 for anything else; -1 with an
 * exception on a Python error. */
static int record(cursor *c, context *x, span *where, PyObject **out, PyObject **name_out)
{
    const char *name, *file, *dtype;
    Py_ssize_t name_n, file_n, dtype_n;
    unsigned long long offset, length, crc, dims[64];
    size_t ndims = 0;
    if (!LITERAL(c, "{\"name\":") || !string(c, &name, &name_n) ||
        !LITERAL(c, ",\"file\":") || !string(c, &file, &file_n) ||
        !LITERAL(c, ",\"offset\":") || !integer(c, &offset) ||
        !LITERAL(c, ",\"length\":") || !integer(c, &length) ||
        !LITERAL(c, ",\"dtype\":") || !string(c, &dtype, &dtype_n) ||
        !LITERAL(c, ",\"shape\":["))
        return 0;
    if (!LITERAL(c, "]")) {
        do {
            if (ndims >= x->lim.max_dims || ndims >= sizeof(dims) / sizeof(dims[0]) ||
                !integer(c, &dims[ndims]))
                return 0;
            ndims++;
        } while (LITERAL(c, ","));
        if (!LITERAL(c, "]"))
            return 0;
    }
    if (!LITERAL(c, ",\"crc32c\":") || !integer(c, &crc) ||
        !LITERAL(c, ",\"encoding\":\"raw\"}"))
        return 0;
    if (offset > x->lim.max_file_bytes || length > x->lim.max_file_bytes || crc > x->lim.crc_max)
        return 0;
    /* Elements, and their product with each 0 counted as 1 (what bounds strides). */
    unsigned __int128 elements = 1, extent = 1;
    for (size_t i = 0; i < ndims; i++) {
        if (dims[i] > x->lim.max_elements)
            return 0;
        elements *= dims[i];
        extent *= dims[i] ? dims[i] : 1;
        if (extent > x->lim.max_elements)
            return 0;
    }

    PyObject *values[FIELDS] = {NULL};
    int got = lookup(file, file_n, x->files, &x->file, file_entry, &values[FILE_]);
    if (got == 1)
        got = lookup(dtype, dtype_n, x->itemsizes, &x->dtype, dtype_entry, &values[DTYPE]);
    if (got == 1 && (elements * x->dtype.a != length || offset < x->file.b ||
                     offset + length > x->file.c))
        got = 0; /* length is not elements x itemsize, or bytes outside the data section */
    if (got != 1) {
        Py_XDECREF(values[FILE_]);
        Py_XDECREF(values[DTYPE]);
        return got;
    }
    where->file = (Py_ssize_t)x->file.a;
    where->start = offset;
    where->end = offset + length;

    values[NAME] = PyUnicode_DecodeASCII(name, name_n, NULL);
    values[OFFSET] = PyLong_FromUnsignedLongLong(offset);
    values[LENGTH] = PyLong_FromUnsignedLongLong(length);
    values[SHAPE] = PyTuple_New((Py_ssize_t)ndims);
    values[CRC32C] = PyLong_FromUnsignedLongLong(crc);
    values[ENCODING] = Py_NewRef(x->raw);
    values[STORED_LENGTH] = Py_NewRef(Py_None);
    values[FRAMES] = Py_NewRef(Py_None);
    int ok = 1;
    for (size_t i = 0; i < FIELDS; i++)
        ok &= values[i] != NULL;
    for (size_t i = 0; ok && i < ndims; i++) {
        PyObject *d = PyLong_FromUnsignedLongLong(dims[i]);
        ok = d != NULL;
        if (ok)
            PyTuple_SET_ITEM(values[SHAPE], (Py_ssize_t)i, d);
    }
    /* As object.__new__ and object.__setattr__ make a frozen dataclass's
     * instance (its own __setattr__ refuses). */
    PyObject *obj = NULL;
    if (ok) {
        PyObject *no_args = PyTuple_New(0);
        obj = no_args ? PyBaseObject_Type.tp_new((PyTypeObject *)x->type, no_args, NULL) : NULL;
        Py_XDECREF(no_args);
    }
    for (size_t i = 0; obj != NULL && i < FIELDS; i++) {
        if (PyObject_GenericSetAttr(obj, field[i], values[i]) < 0)
            Py_CLEAR(obj);
    }
    *name_out = values[NAME]; /* (the record holds it) */
    for (size_t i = 0; i < FIELDS; i++)
        Py_XDECREF(values[i]);
    if (obj == NULL)
        return -1;
    *out = obj;
    return 1;
}

PyObject *fpf_scan_records(PyObject *self, PyObject *args)
{
    Py_buffer text;
    Py_ssize_t start, stop;
    context x = {0};
    if (!PyArg_ParseTuple(args, "y*nnO!O!OU(KKKK):scan_records", &text, &start, &stop,
                          &PyDict_Type, &x.files, &PyDict_Type, &x.itemsizes, &x.type, &x.raw,
                          &x.lim.max_dims, &x.lim.max_elements, &x.lim.max_file_bytes,
                          &x.lim.crc_max))
        return NULL;
    PyObject *result = NULL, *records = NULL, *names = NULL;
    span *spans = NULL;
    size_t capacity = 1024, count = 0;
    if (!PyType_Check(x.type) || start < 0 || stop < start || stop > text.len) {
        PyErr_SetString(PyExc_ValueError, "scan_records: a type and 0 <= start <= stop <= len");
        goto done;
    }
    if (PyUnicode_CompareWithASCIIString(x.raw, "raw") != 0) {
        PyErr_SetString(PyExc_ValueError, "scan_records: the raw encoding's name is 'raw'");
        goto done;
    }
    cursor c = {(const char *)text.buf + start, (const char *)text.buf + stop};
    records = PyList_New(0);
    names = PySet_New(NULL);
    spans = malloc(capacity * sizeof(*spans));
    if (records == NULL || names == NULL || spans == NULL) {
        if (spans == NULL)
            PyErr_NoMemory();
        goto done;
    }
    for (;;) {
        if (count == capacity) {
            span *grown = realloc(spans, 2 * capacity * sizeof(*spans));
            if (grown == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            spans = grown;
            capacity *= 2;
        }
        PyObject *rec = NULL, *name = NULL;
        int got = record(&c, &x, &spans[count], &rec, &name);
        if (got < 0)
            goto done;
        if (got == 0)
            goto refuse;
        Py_ssize_t before = PySet_GET_SIZE(names);
        if (PySet_Add(names, name) < 0 || PyList_Append(records, rec) < 0) {
            Py_DECREF(rec);
            goto done;
        }
        Py_DECREF(rec);
        if (PySet_GET_SIZE(names) == before)
            goto refuse; /* a name twice */
        if (spans[count].end > spans[count].start)
            count++; /* (an empty tensor shares no byte) */
        if (c.p == c.end)
            break;
        if (!LITERAL(&c, ",\n  "))
            goto refuse;
    }
    qsort(spans, count, sizeof(*spans), compare_spans);
    for (size_t i = 1; i < count; i++) {
        if (spans[i].file == spans[i - 1].file && spans[i].start < spans[i - 1].end)
            goto refuse; /* two records share a byte */
    }
    result = Py_NewRef(records);
    goto done;
refuse:
    result = Py_NewRef(Py_None);
done:
    free(spans);
    Py_XDECREF(records);
    Py_XDECREF(names);
    Py_XDECREF(x.file.text);
    Py_XDECREF(x.dtype.text);
    PyBuffer_Release(&text);
    return result;
}
