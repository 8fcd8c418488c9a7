/*
 * fastpersist._format: the format's per-tensor loops in C, for states of many
 * tensors. Each function does what a Python function of fastpersist/format/
 * does, byte for byte, for the inputs fastpersist usually makes, and returns
 * None for any other input: the Python function then does the work (and
 * words any error), so the two can never disagree on what a file means.
 */
#ifndef FPF_H
#define FPF_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* format/record_scan.py: a manifest's "tensors" array in the writer's spelling. */
PyObject *fpf_scan_records(PyObject *self, PyObject *args);
int fpf_records_init(void);

/* format/safetensors_file.py's header_json: a data file's header JSON. */
PyObject *fpf_header_json(PyObject *self, PyObject *args);

#endif
