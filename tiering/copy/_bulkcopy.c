/* tiering.copy._bulkcopy: a table of memory-to-memory copies in one call, the GIL
 * released once for all of them.
 *
 * Optional: built at install where a C compiler exists (setup.py marks it
 * optional); tiering/copy/bulk.py falls back to a ctypes memmove loop without it.
 * Nothing here depends on the CPU it was built on: libc's memmove (which picks
 * its own instructions at run time), and on x86-64 SSE2, which every x86-64 CPU
 * has.
 *
 * Why not one memmove per region: regions of a few KiB at scattered addresses
 * are bound by memory latency (each one a new stream for the hardware
 * prefetcher, a TLB miss per page) and by the read-for-ownership of every
 * destination line. Measured on these machines for 8 KiB regions, % of one
 * large memcpy: memmove loop 54-63 %, with the next regions' pages prefetched
 * 65-68 %, with non-temporal stores too 92-93 %. So large calls prefetch a few
 * regions ahead and write with non-temporal stores (as glibc's memcpy does for
 * one large copy); small calls, whose bytes a reader may still find in cache,
 * use memmove.
 *
 * Regions of 64 KiB or more (a tier's blocks) are streamed in any call, and
 * each source line is evicted from the caches once read (CLFLUSHOPT where
 * the CPU has it, else CLFLUSH, which is part of SSE2). Otherwise the lines
 * read pass through the shared last-level cache and push out the lines of
 * whatever runs on the other cores. Measured here: a scheduler thread that
 * sleeps 2 ms per step (a GPU's forward pass) ran its steps 1.26-1.42x slower
 * beside a process copying random 256 KiB regions at 17-19 GB/s, and
 * 0.99-1.06x once the source lines were flushed. Random destinations with
 * sequential sources cost 1.10x, so it is the reads that evict. The bytes
 * stay in memory: a flush writes a dirty line back and drops the cached copy.
 *
 * copy_regions(src, dst, lengths, release_gil_from_bytes)
 *   src, dst: addresses, as a C-contiguous buffer of 8-byte integers or a
 *             sequence of ints, of one size;
 *   lengths:  one int for every region, or a buffer/sequence like src;
 *   release_gil_from_bytes: the GIL is released for the copies when they
 *             total at least this many bytes (below it, handing the GIL over
 *             costs more than the copies).
 * The caller guarantees every region lies inside memory it holds for the
 * call; no region's destination may overlap another region's source.
 *
 * evict_lines(buffer, release_gil_from_bytes)
 *   the same line flush over a whole contiguous buffer a tier has read for
 *   good (a block once checksummed: tiering/copy/caches.py), the GIL released
 *   for buffers of at least release_gil_from_bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__SSE2__) && defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#define HAVE_LINE_FLUSH 1
#endif

/* Calls moving at least this many bytes write with non-temporal stores: their
 * destination would not stay in the caches anyway. */
#define NONTEMPORAL_MIN_BYTES (4u << 20)
/* Regions of at least this many bytes (a tier's whole blocks) are streamed in any
 * call, and their source lines flushed once read. Smaller regions (a model's
 * layer pages) are not flushed: there the flush cost 8-23 points of copy speed
 * (16 KiB regions 88-97 % -> 74-79 % of memcpy), against 0-10 points at 64 KiB
 * and more, still 116-143 % of memcpy. */
#define LARGE_REGION_BYTES (64u << 10)
/* Prefetch the pages of the region this many regions ahead (first 16 KiB). */
#define PREFETCH_AHEAD 4
#define PREFETCH_MAX_BYTES (16u << 10)
/* A region of at most this many bytes whose source does not continue the one
 * before it has every source line prefetched one region ahead: too short for
 * the hardware prefetcher to ramp up in. Measured here for 8 layers x 8 KiB
 * pages of random blocks, % of one large memcpy: stores (scattered sources)
 * 84-103 % -> 101-110 %; loads (one row's slots, contiguous) lost 30 points
 * when prefetched this way too, hence the continuation test. 32 KiB regions
 * were no faster (docs/copy-engine.md has the variants). */
#define PREFETCH_LINES_MAX_BYTES (16u << 10)

/* How regions of LARGE_REGION_BYTES or more evict the source lines they have read:
 * chosen once, at import. */
enum source_flush { FLUSH_NONE, FLUSH_CLFLUSH, FLUSH_CLFLUSHOPT };
static enum source_flush source_flush = FLUSH_NONE;
static const char *const source_flush_names[] = {"none", "clflush", "clflushopt"};

static enum source_flush detect_source_flush(void) {
#if defined(HAVE_LINE_FLUSH)
    unsigned int a, b, c, d;
    /* CPUID leaf 7, EBX bit 23: CLFLUSHOPT (weakly ordered, so flushes overlap). */
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & (1u << 23))) {
        return FLUSH_CLFLUSHOPT;
    }
    return FLUSH_CLFLUSH; /* part of SSE2: every x86-64 CPU has it */
#else
    return FLUSH_NONE;
#endif
}

#if defined(HAVE_LINE_FLUSH)
/* Drop the line holding ``p`` from every cache (written back first if dirty). */
static inline void flush_line(const char *p, enum source_flush how) {
    if (how == FLUSH_CLFLUSHOPT) {
        /* By mnemonic, not intrinsic: no CPU-specific build flag; run only where CPUID says so. */
        __asm__ volatile("clflushopt %0" : "+m"(*(volatile char *)p));
    } else if (how == FLUSH_CLFLUSH) {
        _mm_clflush(p);
    }
}
#endif

/* Drop every line of [start, start + n) from the caches (a no-op without a line flush). */
static void evict_range(const char *start, size_t n, enum source_flush how) {
#if defined(HAVE_LINE_FLUSH)
    for (uintptr_t line = (uintptr_t)start & ~(uintptr_t)63; line < (uintptr_t)start + n;
         line += 64) {
        flush_line((const char *)line, how);
    }
#else
    (void)start;
    (void)n;
    (void)how;
#endif
}

typedef struct {
    Py_buffer view;    /* held when from a buffer */
    uint64_t *owned;   /* allocated when from a sequence */
    const uint64_t *values;
    Py_ssize_t count;
} u64_table;

static void table_release(u64_table *t) {
    if (t->view.obj != NULL) {
        PyBuffer_Release(&t->view);
    }
    PyMem_Free(t->owned);
    t->owned = NULL;
}

static int is_8_byte_integer_format(const char *format) {
    if (format == NULL) {
        return 0;
    }
    if (*format == '<' || *format == '=' || *format == '@') {
        format++;
    }
    return strlen(format) == 1 && strchr("qQlL", *format) != NULL;
}

/* Fill ``t`` from a buffer of 8-byte integers or a sequence of ints. */
static int table_from(PyObject *obj, const char *what, u64_table *t) {
    memset(t, 0, sizeof(*t));
    if (PyObject_CheckBuffer(obj)) {
        if (PyObject_GetBuffer(obj, &t->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            return -1;
        }
        if (t->view.itemsize != 8 || t->view.ndim > 1 ||
            !is_8_byte_integer_format(t->view.format)) {
            PyErr_Format(PyExc_TypeError,
                         "%s must be a 1-D buffer of 8-byte integers (format %s, itemsize %zd)",
                         what, t->view.format ? t->view.format : "?", t->view.itemsize);
            table_release(t);
            return -1;
        }
        t->values = (const uint64_t *)t->view.buf;
        t->count = t->view.len / 8;
        return 0;
    }
    PyObject *seq = PySequence_Fast(obj, what);
    if (seq == NULL) {
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    t->owned = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(uint64_t));
    if (t->owned == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long v = PyLong_AsUnsignedLongLong(items[i]);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            table_release(t);
            PyErr_Format(PyExc_ValueError, "%s[%zd] must be a non-negative int", what, i);
            return -1;
        }
        t->owned[i] = (uint64_t)v;
    }
    Py_DECREF(seq);
    t->values = t->owned;
    t->count = n;
    return 0;
}

#if defined(__SSE2__)
/* memcpy with non-temporal 16-byte stores (the destination aligned first), each
 * source line flushed from the caches once read as ``how`` says (see the top of
 * this file). */
static void copy_streaming(char *d, const char *s, size_t n, enum source_flush how) {
    const char *const s_start = s, *const s_end = s + n;
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > n) {
        head = n;
    }
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    for (; n >= 64; n -= 64, s += 64, d += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
#if defined(HAVE_LINE_FLUSH)
        /* The line before this chunk's: fully read now, whatever the alignment. */
        if (s >= s_start + 64) {
            flush_line(s - 64, how);
        }
#endif
    }
    memcpy(d, s, n);
#if defined(HAVE_LINE_FLUSH)
    /* The head's line, and the last lines read: from the line before where the
     * loop stopped to the end (a line never crosses a page, so its aligned
     * address is mapped wherever any byte of it is). */
    if (how != FLUSH_NONE && s_end > s_start) {
        flush_line(s_start, how);
        const char *from = s >= s_start + 64 ? s - 64 : s_start;
        evict_range(from, (size_t)(s_end - from), how);
    }
#else
    (void)s_start;
    (void)s_end;
    (void)how;
#endif
}
#endif

static void prefetch_region(const char *s, char *d, uint64_t len) {
#if defined(__GNUC__)
    uint64_t upto = len < PREFETCH_MAX_BYTES ? len : PREFETCH_MAX_BYTES;
    for (uint64_t off = 0; off < upto; off += 4096) {
        __builtin_prefetch(s + off, 0, 0);
        __builtin_prefetch(d + off, 1, 0);
    }
#else
    (void)s;
    (void)d;
    (void)len;
#endif
}

/* Every source line of a short region into the L2 (locality 1: prefetcht2 on
 * x86; into the L1 or non-temporal measured 20 points slower than no prefetch). */
static void prefetch_source_lines(const char *s, uint64_t len) {
#if defined(__GNUC__)
    for (uint64_t off = 0; off < len; off += 64) {
        __builtin_prefetch(s + off, 0, 1);
    }
#else
    (void)s;
    (void)len;
#endif
}

static void copy_all(const uint64_t *s, const uint64_t *d, const uint64_t *l, uint64_t same,
                     Py_ssize_t n, int streaming) {
    int streamed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) {
            Py_ssize_t j = i + PREFETCH_AHEAD;
            prefetch_region((const char *)(uintptr_t)s[j], (char *)(uintptr_t)d[j],
                            l ? l[j] : same);
        }
        char *dst = (char *)(uintptr_t)d[i];
        const char *src = (const char *)(uintptr_t)s[i];
        size_t len = (size_t)(l ? l[i] : same);
        if (i + 1 < n) {
            uint64_t next_len = l ? l[i + 1] : same;
            if (next_len <= PREFETCH_LINES_MAX_BYTES && s[i + 1] != s[i] + len) {
                prefetch_source_lines((const char *)(uintptr_t)s[i + 1], next_len);
            }
        }
#if defined(__SSE2__)
        int large = len >= LARGE_REGION_BYTES;
        /* A region overlapping itself needs memmove's direction handling. */
        if ((streaming || large) && (dst >= src + len || src >= dst + len)) {
            copy_streaming(dst, src, len, large ? source_flush : FLUSH_NONE);
            streamed = 1;
            continue;
        }
#endif
        memmove(dst, src, len);
    }
#if defined(__SSE2__)
    if (streamed) {
        _mm_sfence(); /* the streamed bytes are visible before the call returns */
    }
#else
    (void)streaming;
    (void)streamed;
#endif
}

static PyObject *copy_regions(PyObject *self, PyObject *args) {
    PyObject *src_obj, *dst_obj, *len_obj;
    Py_ssize_t release_from;
    if (!PyArg_ParseTuple(args, "OOOn:copy_regions", &src_obj, &dst_obj, &len_obj,
                          &release_from)) {
        return NULL;
    }
    u64_table src, dst, lens;
    memset(&lens, 0, sizeof(lens));
    if (table_from(src_obj, "src", &src) < 0) {
        return NULL;
    }
    if (table_from(dst_obj, "dst", &dst) < 0) {
        table_release(&src);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = src.count;
    uint64_t same = 0;
    int uniform = PyLong_Check(len_obj);
    if (dst.count != n) {
        PyErr_Format(PyExc_ValueError, "src has %zd addresses, dst %zd: they must be of one size",
                     n, dst.count);
        goto done;
    }
    if (uniform) {
        long long v = PyLong_AsLongLong(len_obj);
        if (v == -1 && PyErr_Occurred()) {
            goto done;
        }
        if (v < 0) {
            PyErr_Format(PyExc_ValueError, "lengths must be non-negative, got %lld", v);
            goto done;
        }
        same = (uint64_t)v;
    } else {
        if (table_from(len_obj, "lengths", &lens) < 0) {
            goto done;
        }
        if (lens.count != n) {
            PyErr_Format(PyExc_ValueError, "%zd regions but %zd lengths", n, lens.count);
            goto done;
        }
    }
    /* Lengths are read as unsigned: a negative int64 length would be enormous. */
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t len = uniform ? same : lens.values[i];
        if (len > (uint64_t)PY_SSIZE_T_MAX || total + len < total) {
            PyErr_Format(PyExc_ValueError, "region %zd has an impossible length", i);
            goto done;
        }
        total += len;
    }
    const uint64_t *s = src.values, *d = dst.values, *l = uniform ? NULL : lens.values;
    int streaming = total >= NONTEMPORAL_MIN_BYTES;
    if (release_from >= 0 && total >= (uint64_t)release_from) {
        Py_BEGIN_ALLOW_THREADS
        copy_all(s, d, l, same, n, streaming);
        Py_END_ALLOW_THREADS
    } else {
        copy_all(s, d, l, same, n, streaming);
    }
    result = Py_NewRef(Py_None);
done:
    table_release(&src);
    table_release(&dst);
    table_release(&lens);
    return result;
}

static PyObject *evict_lines(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_ssize_t release_from;
    if (!PyArg_ParseTuple(args, "On:evict_lines", &obj, &release_from)) {
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_ANY_CONTIGUOUS) < 0) {
        return NULL;
    }
    if (source_flush != FLUSH_NONE && view.len > 0) {
        if (release_from >= 0 && view.len >= release_from) {
            Py_BEGIN_ALLOW_THREADS
            evict_range((const char *)view.buf, (size_t)view.len, source_flush);
            Py_END_ALLOW_THREADS
        } else {
            evict_range((const char *)view.buf, (size_t)view.len, source_flush);
        }
    }
    PyBuffer_Release(&view);
    return Py_NewRef(Py_None);
}

static PyMethodDef methods[] = {
    {"copy_regions", copy_regions, METH_VARARGS,
     "copy_regions(src, dst, lengths, release_gil_from_bytes): memmove each region; the GIL "
     "is released once for all of them when they total at least release_gil_from_bytes."},
    {"evict_lines", evict_lines, METH_VARARGS,
     "evict_lines(buffer, release_gil_from_bytes): drop every cache line of a contiguous "
     "buffer from the CPU caches (a dirty line is written back first; the bytes stay in "
     "memory), as the copies evict their sources' lines (SOURCE_FLUSH says how; a no-op "
     "where it is 'none'). The GIL is released from release_gil_from_bytes on."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_bulkcopy",
    "Memory-to-memory copies by address, the GIL released once per call (see bulk.py).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__bulkcopy(void) {
    source_flush = detect_source_flush();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL &&
        PyModule_AddStringConstant(m, "SOURCE_FLUSH", source_flush_names[source_flush]) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
