/* The draft sidecar's per-step work in compiled code. The client (draft_sidecar.py's
 * ``_Mirror.step`` + ``commit`` + ``encode_propose_records``, and ``decode_frame`` +
 * ``_check`` + ``_Mirror.drafted`` + ``_drop_rows_past_vocab`` for the answer) and the
 * sidecar (``draft_protocol._decode_propose``, ``_Session.propose``'s token update).
 *
 * Same results as those Python functions (tests compare both on randomized batches);
 * it exists because each Python or numpy operation costs a virtual machine's host
 * 0.5-7 us, and a step was a hundred of them. Built at first use by ``native_build``;
 * without a C compiler the Python path runs.
 *
 * Wire format: draft_protocol.py (little-endian; this file refuses other hosts). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the draft protocol is little-endian; this file assumes the host is too"
#endif

#define PAD INT64_MAX
#define KIND_PROPOSE 2
#define KIND_PROPOSAL 3
#define RECORD_SIZE 33 /* i64 seq_id, i32 keep, i32 num_new, i32 k, f32 temp, u8, u64 */
#define MAX_FRAME_BYTES (256u << 20)
#define PROPOSAL_HEADER 13 /* u8 kind, u32 B, u16 K, u16 M, u32 compute_us */

static PyObject *token_ids_name; /* interned "token_ids" */

/* The token at ``i`` of a list (or a sequence made fast): -1 with an exception set when
 * it is not an integer or does not fit int64 (the caller checks PyErr_Occurred). */
static inline long long item_at(PyObject **items, Py_ssize_t i) {
    return PyLong_AsLongLong(items[i]);
}

typedef struct {
    PyObject *fast; /* a new reference: the list itself or PySequence_Fast's result */
    PyObject **items;
    Py_ssize_t len;
    Py_ssize_t start, lead; /* send items[start + lead:] */
} Row;

static void release_rows(Row *rows, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) Py_XDECREF(rows[i].fast);
    PyMem_Free(rows);
}

static int writable(PyObject *obj, Py_buffer *view, Py_ssize_t nbytes, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len != nbytes) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", what, view->len, nbytes);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* propose_frame(requests, base, expect, records) -> bytes
 *
 * requests: list of B objects with a ``token_ids`` sequence of ints (DraftRequest);
 * base: int64 [B] (writable), the caller's tokens the sidecar holds per row;
 * expect: int64 [B, W] (writable), the token at base - 1 (if base > 0), the drafts, then
 *   PAD (at least once);
 * records: the PROPOSE's RECORD [B] (seq_id, k, temperature, seeds; keep and num_new
 *   are this function's).
 * Returns the whole PROPOSE frame (length prefix included) and commits it: base becomes
 * each list's length and expect[:, 0] its last token (PAD if empty). A row whose token
 * at base - 1 differs (a replaced sequence) is sent whole with keep 0. */
static PyObject *propose_frame(PyObject *self, PyObject *args) {
    PyObject *requests, *base_obj, *expect_obj, *records_obj;
    if (!PyArg_ParseTuple(args, "O!OOO", &PyList_Type, &requests, &base_obj, &expect_obj,
                          &records_obj))
        return NULL;
    Py_ssize_t b = PyList_GET_SIZE(requests);
    Py_buffer base_v, expect_v, rec_v;
    if (writable(base_obj, &base_v, 8 * b, "base") < 0) return NULL;
    if (PyObject_GetBuffer(expect_obj, &expect_v, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&base_v);
        return NULL;
    }
    if (PyObject_GetBuffer(records_obj, &rec_v, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&base_v);
        PyBuffer_Release(&expect_v);
        return NULL;
    }
    PyObject *frame = NULL;
    Row *rows = NULL;
    Py_ssize_t w = b ? expect_v.len / (8 * b) : 0;
    if ((b && expect_v.len != 8 * b * w) || (b && w < 1) || rec_v.len != RECORD_SIZE * b) {
        PyErr_Format(PyExc_ValueError, "expect (%zd bytes) or records (%zd bytes) do not fit B=%zd",
                     expect_v.len, rec_v.len, b);
        goto done;
    }
    int64_t *base = (int64_t *)base_v.buf, *expect = (int64_t *)expect_v.buf;
    rows = PyMem_Calloc(b ? b : 1, sizeof(Row));
    if (!rows) {
        PyErr_NoMemory();
        goto done;
    }
    /* pass 1: what each row sends */
    Py_ssize_t total = 0;
    for (Py_ssize_t r = 0; r < b; r++) {
        Row *row = &rows[r];
        PyObject *ids = PyObject_GetAttr(PyList_GET_ITEM(requests, r), token_ids_name);
        if (!ids) goto done;
        row->fast = PySequence_Fast(ids, "token_ids must be a sequence of ints");
        Py_DECREF(ids);
        if (!row->fast) goto done;
        row->items = PySequence_Fast_ITEMS(row->fast);
        row->len = PySequence_Fast_GET_SIZE(row->fast);
        int64_t *exp = expect + r * w;
        int chk = base[r] > 0;
        Py_ssize_t start = base[r] - chk;
        Py_ssize_t rowlen = row->len > start ? row->len - start : 0;
        Py_ssize_t lead = 0;
        while (lead < rowlen && lead < w) {
            long long t = item_at(row->items, start + lead);
            if (t == -1 && PyErr_Occurred()) goto done;
            if (t != exp[lead]) break;
            lead++;
        }
        if (chk && lead == 0) { /* replaced or shrunk: the sidecar's tokens are not these */
            for (Py_ssize_t j = 0; j < w; j++) exp[j] = PAD;
            base[r] = 0;
            start = 0;
        }
        row->start = start;
        row->lead = lead;
        total += row->len - start - lead;
    }
    if (total > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "a PROPOSE of more than 2**32 tokens");
        goto done;
    }
    size_t body = 9 + (size_t)RECORD_SIZE * b + 4 * (size_t)total;
    if (body > MAX_FRAME_BYTES) {
        PyErr_Format(PyExc_ValueError, "a frame of %zu bytes is over the %u limit", body,
                     MAX_FRAME_BYTES);
        goto done;
    }
    frame = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(4 + body));
    if (!frame) goto done;
    /* pass 2: the frame (prefix, header, records with keep and num_new, new tokens) */
    char *out = PyBytes_AS_STRING(frame);
    uint32_t u32 = (uint32_t)body;
    memcpy(out, &u32, 4);
    out[4] = KIND_PROPOSE;
    u32 = (uint32_t)b;
    memcpy(out + 5, &u32, 4);
    u32 = (uint32_t)total;
    memcpy(out + 9, &u32, 4);
    char *rec = out + 13;
    memcpy(rec, rec_v.buf, RECORD_SIZE * b);
    int32_t *tok = (int32_t *)(rec + RECORD_SIZE * b); /* unaligned is fine on x86/arm64 */
    for (Py_ssize_t r = 0; r < b; r++) {
        Row *row = &rows[r];
        /* a list changed by the conversions above (only an odd token object's __index__
         * runs Python code): its items may have moved */
        if (PySequence_Fast_GET_SIZE(row->fast) != row->len ||
            PySequence_Fast_ITEMS(row->fast) != row->items) {
            PyErr_Format(PyExc_ValueError, "row %zd: its token list changed during the call", r);
            goto fail;
        }
        int chk = base[r] > 0;
        long long keep = base[r] + row->lead - chk;
        long long num_new = row->len - row->start - row->lead;
        if (keep > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "row %zd: keep=%lld is outside [0, 2**31)", r, keep);
            goto fail;
        }
        int32_t k32 = (int32_t)keep, n32 = (int32_t)num_new;
        memcpy(rec + r * RECORD_SIZE + 8, &k32, 4);
        memcpy(rec + r * RECORD_SIZE + 12, &n32, 4);
        for (Py_ssize_t i = row->start + row->lead; i < row->len; i++) {
            long long t = item_at(row->items, i);
            if (t == -1 && PyErr_Occurred()) goto fail;
            if (t < 0 || t > INT32_MAX) {
                int64_t sid;
                memcpy(&sid, rec + r * RECORD_SIZE, 8);
                PyErr_Format(PyExc_ValueError,
                             "seq %lld: token id %lld is out of range: token ids must be in "
                             "[0, 2**31)",
                             (long long)sid, t);
                goto fail;
            }
            int32_t t32 = (int32_t)t;
            memcpy(tok++, &t32, 4);
        }
    }
    /* commit: the sidecar now holds each whole list */
    for (Py_ssize_t r = 0; r < b; r++) {
        Row *row = &rows[r];
        base[r] = row->len;
        if (row->len > 0) {
            long long t = item_at(row->items, row->len - 1);
            if (t == -1 && PyErr_Occurred()) goto fail;
            expect[r * w] = t;
        } else {
            expect[r * w] = PAD;
        }
    }
    goto done;
fail:
    Py_CLEAR(frame);
done:
    if (rows) release_rows(rows, b); /* calloc'd: rows not reached hold NULL */
    PyBuffer_Release(&base_v);
    PyBuffer_Release(&expect_v);
    PyBuffer_Release(&rec_v);
    return frame;
}

static PyObject *new_array(int nd, npy_intp *dims, int type) {
    return PyArray_SimpleNew(nd, dims, type);
}

/* parse_proposal(body, ks, expect, vocab_size) -> (tokens, num, q_ids, q_probs,
 *     compute_us, dropped) or None when the body is not a PROPOSAL
 *
 * body: a frame body (after the prefix); ks: list of B ints (the drafts asked for);
 * expect: int64 [B, W] (writable, W >= K + 2): columns 1.. get the drafts, then PAD;
 * vocab_size: -1 (no check) or the target's. Returns tokens/num as int64 ([B, K], [B]),
 * q_ids int32 / q_probs float32 [B, K, M] or None (M = 0); rows drafting or holding in q
 * an id >= vocab_size lose their drafts (``dropped``: whether any did). ValueError for a
 * malformed answer. */
static PyObject *parse_proposal(PyObject *self, PyObject *args) {
    Py_buffer body_v;
    PyObject *ks, *expect_obj;
    long long vocab;
    if (!PyArg_ParseTuple(args, "y*O!OL", &body_v, &PyList_Type, &ks, &expect_obj, &vocab))
        return NULL;
    PyObject *result = NULL, *tokens = NULL, *num = NULL, *q_ids = NULL, *q_probs = NULL;
    Py_buffer expect_v = {0};
    const unsigned char *p = body_v.buf;
    if (body_v.len < 1 || p[0] != KIND_PROPOSAL) {
        PyBuffer_Release(&body_v);
        Py_RETURN_NONE;
    }
    Py_ssize_t b = PyList_GET_SIZE(ks);
    if (body_v.len < PROPOSAL_HEADER) {
        PyErr_SetString(PyExc_ValueError, "PROPOSAL: truncated header");
        goto done;
    }
    uint32_t bb, us;
    uint16_t k, m;
    memcpy(&bb, p + 1, 4);
    memcpy(&k, p + 5, 2);
    memcpy(&m, p + 7, 2);
    memcpy(&us, p + 9, 4);
    Py_ssize_t kmax = 0;
    for (Py_ssize_t r = 0; r < b; r++) {
        Py_ssize_t kr = PyLong_AsSsize_t(PyList_GET_ITEM(ks, r));
        if (kr == -1 && PyErr_Occurred()) goto done;
        if (kr > kmax) kmax = kr;
    }
    if ((Py_ssize_t)bb != b || (Py_ssize_t)k != kmax) {
        PyErr_Format(PyExc_ValueError, "PROPOSAL of shape (%u, %u) for (%zd, %zd)", bb, k, b,
                     kmax);
        goto done;
    }
    size_t nq = (size_t)b * k * m;
    size_t need = PROPOSAL_HEADER + 4 * ((size_t)b * k + b) + 8 * nq;
    if ((size_t)body_v.len != need) {
        PyErr_Format(PyExc_ValueError, "PROPOSAL: the body is %zd bytes, expected %zu",
                     body_v.len, need);
        goto done;
    }
    if (PyObject_GetBuffer(expect_obj, &expect_v, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    Py_ssize_t w = b ? expect_v.len / (8 * b) : k + 2;
    if ((b && expect_v.len != 8 * b * w) || w < k + 2) {
        PyErr_Format(PyExc_ValueError, "expect (%zd bytes) must be [%zd, >= %u]", expect_v.len,
                     b, k + 2);
        goto done;
    }
    npy_intp dims[3] = {b, k, m};
    tokens = new_array(2, dims, NPY_INT64);
    num = new_array(1, dims, NPY_INT64);
    if (!tokens || !num) goto done;
    if (m) {
        q_ids = new_array(3, dims, NPY_INT32);
        q_probs = new_array(3, dims, NPY_FLOAT32);
        if (!q_ids || !q_probs) goto done;
    }
    const unsigned char *wire_tok = p + PROPOSAL_HEADER, *wire_num = wire_tok + 4 * b * k;
    const unsigned char *wire_qid = wire_num + 4 * b, *wire_qp = wire_qid + 4 * nq;
    int64_t *tk = PyArray_DATA((PyArrayObject *)tokens);
    int64_t *nm = PyArray_DATA((PyArrayObject *)num);
    int32_t *qi = q_ids ? PyArray_DATA((PyArrayObject *)q_ids) : NULL;
    float *qp = q_probs ? PyArray_DATA((PyArrayObject *)q_probs) : NULL;
    if (m) {
        memcpy(qi, wire_qid, 4 * nq);
        memcpy(qp, wire_qp, 4 * nq);
    }
    int64_t *expect = expect_v.buf;
    int dropped = 0;
    for (Py_ssize_t r = 0; r < b; r++) {
        int32_t n;
        memcpy(&n, wire_num + 4 * r, 4);
        Py_ssize_t kr = PyLong_AsSsize_t(PyList_GET_ITEM(ks, r));
        if (n < 0 || n > k) {
            PyErr_Format(PyExc_ValueError, "PROPOSAL: num_tokens outside [0, %u]", k);
            goto done;
        }
        if (n > kr) {
            PyErr_SetString(PyExc_ValueError, "PROPOSAL: more drafts than asked for");
            goto done;
        }
        nm[r] = n;
        int bad = 0;
        int64_t *exp = expect + r * w;
        for (Py_ssize_t j = 0; j < k; j++) {
            int32_t t;
            memcpy(&t, wire_tok + 4 * (r * k + j), 4);
            tk[r * k + j] = t;
            if (j >= n) continue;
            if (t < 0) {
                PyErr_SetString(PyExc_ValueError, "PROPOSAL: a negative draft token");
                goto done;
            }
            bad |= vocab >= 0 && t >= vocab;
            for (Py_ssize_t i = 0; i < m; i++) {
                int32_t id = qi[(r * k + j) * m + i];
                if (id < 0) {
                    PyErr_SetString(PyExc_ValueError, "PROPOSAL: a negative id in q");
                    goto done;
                }
                bad |= vocab >= 0 && id >= vocab;
            }
        }
        /* what the sidecar now holds after the row's tokens: its drafts */
        for (Py_ssize_t j = 1; j < w; j++) exp[j] = j <= n ? tk[r * k + j - 1] : PAD;
        if (bad) { /* the target could not verify them */
            dropped = 1;
            for (Py_ssize_t j = 0; j < k; j++) tk[r * k + j] = -1;
            nm[r] = 0;
            if (m) {
                memset(qi + r * k * m, 0, 4 * k * m);
                memset(qp + r * k * m, 0, 4 * k * m);
            }
        }
    }
    result = Py_BuildValue("(OOOOIO)", tokens, num, q_ids ? q_ids : Py_None,
                           q_probs ? q_probs : Py_None, us, dropped ? Py_True : Py_False);
done:
    Py_XDECREF(tokens);
    Py_XDECREF(num);
    Py_XDECREF(q_ids);
    Py_XDECREF(q_probs);
    if (expect_v.obj) PyBuffer_Release(&expect_v);
    PyBuffer_Release(&body_v);
    return result;
}

/* decode_propose(body) -> (seq_ids, keep, k, temperature, has_seed, offsets, tokens)
 *
 * A PROPOSE body (after the prefix) as Python lists (``draft_protocol._decode_propose``'s
 * columns: B each, offsets B + 1, tokens T); ValueError (the same checks) if malformed. */
static PyObject *decode_propose(PyObject *self, PyObject *args) {
    Py_buffer v;
    if (!PyArg_ParseTuple(args, "y*", &v)) return NULL;
    const unsigned char *p = v.buf;
    PyObject *cols[7] = {NULL}, *result = NULL;
    if (v.len < 9 || p[0] != KIND_PROPOSE) {
        PyErr_SetString(PyExc_ValueError, "PROPOSE: truncated header");
        goto done;
    }
    uint32_t b, t;
    memcpy(&b, p + 1, 4);
    memcpy(&t, p + 5, 4);
    size_t need = 9 + (size_t)RECORD_SIZE * b + 4 * (size_t)t;
    if ((size_t)v.len != need) {
        PyErr_Format(PyExc_ValueError, "PROPOSE: the body is %zd bytes, expected %zu", v.len,
                     need);
        goto done;
    }
    Py_ssize_t sizes[7] = {b, b, b, b, b, (Py_ssize_t)b + 1, t};
    for (int c = 0; c < 7; c++)
        if (!(cols[c] = PyList_New(sizes[c]))) goto done;
    const unsigned char *rec = p + 9, *tok = rec + (size_t)RECORD_SIZE * b;
    long long off = 0;
    PyList_SET_ITEM(cols[5], 0, PyLong_FromLong(0));
    for (uint32_t r = 0; r < b; r++) {
        const unsigned char *x = rec + (size_t)r * RECORD_SIZE;
        int64_t sid;
        int32_t keep, num, k;
        float temp;
        memcpy(&sid, x, 8);
        memcpy(&keep, x + 8, 4);
        memcpy(&num, x + 12, 4);
        memcpy(&k, x + 16, 4);
        memcpy(&temp, x + 20, 4);
        unsigned char has = x[24];
        if (keep < 0 || num < 0 || k < 0) {
            PyErr_SetString(PyExc_ValueError, "PROPOSE: a negative keep, token count or k");
            goto done;
        }
        if (!(temp >= 0 && temp <= 3.4028234663852886e38f)) { /* NaN fails too */
            PyErr_SetString(PyExc_ValueError, "PROPOSE: a temperature is negative or not finite");
            goto done;
        }
        if (has > 1) {
            PyErr_SetString(PyExc_ValueError, "PROPOSE: has_seed must be 0 or 1");
            goto done;
        }
        off += num;
        PyObject *items[6] = {PyLong_FromLongLong(sid), PyLong_FromLong(keep),
                              PyLong_FromLong(k),       PyFloat_FromDouble(temp),
                              PyLong_FromLong(has),     PyLong_FromLongLong(off)};
        for (int c = 0; c < 6; c++) {
            if (!items[c]) {
                for (int d = c + 1; d < 6; d++) Py_XDECREF(items[d]);
                goto done;
            }
            PyList_SET_ITEM(cols[c], c == 5 ? r + 1 : r, items[c]);
        }
    }
    if (off != (long long)t) {
        PyErr_Format(PyExc_ValueError, "PROPOSE: token counts add up to %lld, the frame has %u",
                     off, t);
        goto done;
    }
    for (uint32_t i = 0; i < t; i++) {
        int32_t x;
        memcpy(&x, tok + 4 * (size_t)i, 4);
        if (x < 0) {
            PyErr_SetString(PyExc_ValueError, "PROPOSE: a negative token id");
            goto done;
        }
        PyObject *o = PyLong_FromLong(x);
        if (!o) goto done;
        PyList_SET_ITEM(cols[6], i, o);
    }
    result = PyTuple_Pack(7, cols[0], cols[1], cols[2], cols[3], cols[4], cols[5], cols[6]);
done:
    for (int c = 0; c < 7; c++) Py_XDECREF(cols[c]); /* a list's unset items are NULL: fine */
    PyBuffer_Release(&v);
    return result;
}

/* apply_tokens(held, keep, tokens, offsets): for each row r, held[r][keep[r]:] =
 * tokens[offsets[r]:offsets[r + 1]] (all lists; the caller checked keep <= len). */
static PyObject *apply_tokens(PyObject *self, PyObject *args) {
    PyObject *held, *keep, *tokens, *offsets;
    if (!PyArg_ParseTuple(args, "O!O!O!O!", &PyList_Type, &held, &PyList_Type, &keep,
                          &PyList_Type, &tokens, &PyList_Type, &offsets))
        return NULL;
    Py_ssize_t b = PyList_GET_SIZE(held);
    if (PyList_GET_SIZE(keep) != b || PyList_GET_SIZE(offsets) != b + 1) {
        PyErr_SetString(PyExc_ValueError, "apply_tokens: held, keep and offsets disagree");
        return NULL;
    }
    for (Py_ssize_t r = 0; r < b; r++) {
        PyObject *h = PyList_GET_ITEM(held, r);
        if (!PyList_Check(h)) {
            PyErr_SetString(PyExc_TypeError, "apply_tokens: held rows must be lists");
            return NULL;
        }
        Py_ssize_t kp = PyLong_AsSsize_t(PyList_GET_ITEM(keep, r));
        Py_ssize_t a = PyLong_AsSsize_t(PyList_GET_ITEM(offsets, r));
        Py_ssize_t e = PyLong_AsSsize_t(PyList_GET_ITEM(offsets, r + 1));
        if (PyErr_Occurred()) return NULL;
        if (kp < 0 || kp > PyList_GET_SIZE(h) || a < 0 || e < a || e > PyList_GET_SIZE(tokens)) {
            PyErr_Format(PyExc_ValueError, "apply_tokens: row %zd is out of range", r);
            return NULL;
        }
        if (kp < PyList_GET_SIZE(h) && PyList_SetSlice(h, kp, PyList_GET_SIZE(h), NULL) < 0)
            return NULL;
        for (Py_ssize_t i = a; i < e; i++)
            if (PyList_Append(h, PyList_GET_ITEM(tokens, i)) < 0) return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"propose_frame", propose_frame, METH_VARARGS, "The PROPOSE frame of a step; commits it."},
    {"parse_proposal", parse_proposal, METH_VARARGS, "A PROPOSAL's arrays; records the drafts."},
    {"decode_propose", decode_propose, METH_VARARGS, "A PROPOSE body's columns as lists."},
    {"apply_tokens", apply_tokens, METH_VARARGS, "Each held list's tail replaced by its new tokens."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "sidecar_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit_sidecar_native(void) {
    import_array();
    token_ids_name = PyUnicode_InternFromString("token_ids");
    if (!token_ids_name) return NULL;
    return PyModule_Create(&module);
}
