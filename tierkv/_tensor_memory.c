/* See _tensor_memory.h. */
#include "_tensor_memory.h"

/* The tensor methods and attributes tierkv_tensor_memory calls, interned once */
static struct {
    PyObject *numel, *data_ptr, *is_contiguous, *is_cpu, *dtype;
} tensor_attrs;

static int intern_tensor_attrs(void) {
    if (tensor_attrs.dtype != NULL) {
        return 0;
    }
    PyObject **slots[] = {&tensor_attrs.numel, &tensor_attrs.data_ptr, &tensor_attrs.is_contiguous,
                          &tensor_attrs.is_cpu, &tensor_attrs.dtype};
    const char *names[] = {"numel", "data_ptr", "is_contiguous", "is_cpu", "dtype"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (*slots[i] == NULL && (*slots[i] = PyUnicode_InternFromString(names[i])) == NULL) {
            return -1;
        }
    }
    return 0;
}

/* 1 when calling ``name`` on ``obj`` (or reading it, when ``call`` is 0) gives True, 0 when not, -1 on error */
static int truth_of(PyObject *obj, PyObject *name, int call) {
    PyObject *v = call ? PyObject_CallMethodNoArgs(obj, name) : PyObject_GetAttr(obj, name);
    if (v == NULL) {
        return -1;
    }
    int t = v == Py_True ? 1 : (v == Py_False ? 0 : PyObject_IsTrue(v));
    Py_DECREF(v);
    return t;
}

int tierkv_tensor_memory(PyObject *t, PyObject *dtype, const int64_t **data, Py_ssize_t *numel) {
    if (intern_tensor_attrs() < 0) {
        return -1;
    }
    PyObject *d = PyObject_GetAttr(t, tensor_attrs.dtype);
    if (d == NULL) {
        return -1;
    }
    Py_DECREF(d);  /* compared by identity only: torch's dtypes are singletons */
    int ok = d == dtype ? truth_of(t, tensor_attrs.is_cpu, 0) : 0;
    ok = ok == 1 ? truth_of(t, tensor_attrs.is_contiguous, 1) : ok;
    if (ok != 1) {
        return ok;
    }
    PyObject *n = PyObject_CallMethodNoArgs(t, tensor_attrs.numel);
    PyObject *ptr = n == NULL ? NULL : PyObject_CallMethodNoArgs(t, tensor_attrs.data_ptr);
    *numel = n == NULL ? -1 : PyLong_AsSsize_t(n);
    *data = ptr == NULL ? NULL : (const int64_t *)PyLong_AsVoidPtr(ptr);
    Py_XDECREF(n);
    Py_XDECREF(ptr);
    return PyErr_Occurred() ? -1 : 1;
}
