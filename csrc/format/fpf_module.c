/* fastpersist._format: the Python face of fpf.h. */
#include "fpf.h"

static PyMethodDef methods[] = {
    {"scan_records", fpf_scan_records, METH_VARARGS,
     "scan_records(text, start, stop, files, itemsizes, record_type, raw, limits): the raw\n"
     "tensor records in text[start:stop], or None where that is not the writer's spelling or\n"
     "a record fails a check (format/record_scan.py)."},
    {"header_json", fpf_header_json, METH_VARARGS,
     "header_json(entries, prefix): prefix and the (name, dtype, shape, nbytes) entries back\n"
     "to back, as safetensors_file.header_json writes them, or None for an entry it leaves\n"
     "to Python (a name or dtype that is not plain ASCII, a number past 64 bits)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fastpersist._format",
    "The format's per-tensor loops in C (csrc/format/fpf.h).", -1, methods,
};

PyMODINIT_FUNC PyInit__format(void)
{
    if (fpf_records_init() < 0)
        return NULL;
    return PyModule_Create(&module);
}
