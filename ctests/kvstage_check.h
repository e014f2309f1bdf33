/* Tiny check helpers shared by the ctests (C99 and C++11 compatible; header only). */
#ifndef KVSTAGE_CHECK_H
#define KVSTAGE_CHECK_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvstage.h"

/* Number of failed checks so far in this process. */
static inline int *kv_failures(void) {
    static int failures = 0;
    return &failures;
}

#define KV_FAIL_AT(file, line, ...)                                  \
    do {                                                             \
        fprintf(stderr, "%s:%d: FAILED: ", (file), (line));          \
        fprintf(stderr, __VA_ARGS__);                                \
        fputc('\n', stderr);                                         \
        ++*kv_failures();                                            \
    } while (0)

/* CHECK(cond): records a failure and goes on. */
#define CHECK(cond)                                                  \
    do {                                                             \
        if (!(cond)) KV_FAIL_AT(__FILE__, __LINE__, "%s", #cond);    \
    } while (0)

/* REQUIRE(cond): a failure ends the test at once. */
#define REQUIRE(cond)                                                \
    do {                                                             \
        if (!(cond)) {                                               \
            KV_FAIL_AT(__FILE__, __LINE__, "%s", #cond);             \
            exit(1);                                                 \
        }                                                            \
    } while (0)

#define CHECK_INT(actual, expected)                                                        \
    do {                                                                                   \
        long long kv_a_ = (long long)(actual), kv_e_ = (long long)(expected);              \
        if (kv_a_ != kv_e_)                                                                \
            KV_FAIL_AT(__FILE__, __LINE__, "%s == %lld, expected %s == %lld", #actual,     \
                       kv_a_, #expected, kv_e_);                                           \
    } while (0)

#define CHECK_STR(actual, expected)                                                        \
    do {                                                                                   \
        const char *kv_a_ = (actual), *kv_e_ = (expected);                                 \
        if (kv_a_ == NULL || strcmp(kv_a_, kv_e_) != 0)                                    \
            KV_FAIL_AT(__FILE__, __LINE__, "%s == \"%s\", expected \"%s\"", #actual,       \
                       kv_a_ ? kv_a_ : "(null)", kv_e_);                                   \
    } while (0)

#define CHECK_CONTAINS(haystack, needle)                                                   \
    do {                                                                                   \
        const char *kv_h_ = (haystack), *kv_n_ = (needle);                                 \
        if (kv_h_ == NULL || strstr(kv_h_, kv_n_) == NULL)                                 \
            KV_FAIL_AT(__FILE__, __LINE__, "%s == \"%s\" does not contain \"%s\"",         \
                       #haystack, kv_h_ ? kv_h_ : "(null)", kv_n_);                        \
    } while (0)

/* Prints this thread's last error (for the log of a failing test). Everything is read from the
 * struct before any other kvstage call: every call (kvstage_status_name included) replaces it. */
static inline void kv_print_last_error(const char *what) {
    const kvstage_error *e = kvstage_error_last();
    int code = (int)e->code;
    size_t i;
    fprintf(stderr, "%s: code %d class %d session \"%s\": %s\n", what, code, (int)e->klass,
            e->session, e->message);
    for (i = 0; i < e->cause_count; i++) fprintf(stderr, "  cause %u: %s\n", (unsigned)i, e->causes[i]);
    fprintf(stderr, "  (%s)\n", kvstage_status_name(code));
}

/* CHECK_OK(call): the call returns KVSTAGE_OK (prints the last error otherwise). */
#define CHECK_OK(call)                                                                     \
    do {                                                                                   \
        int kv_s_ = (int)(call);                                                           \
        if (kv_s_ != KVSTAGE_OK) {                                                         \
            KV_FAIL_AT(__FILE__, __LINE__, "%s returned %d", #call, kv_s_);                \
            kv_print_last_error(#call);                                                    \
        }                                                                                  \
    } while (0)

/* CHECK_ERR(call, code, needle): the call returns `code` and the last error's message or one of
 * its causes contains `needle` (prints the last error otherwise). */
static inline void kv_check_err(int got, int want, const char *needle, const char *call, const char *file, int line) {
    const kvstage_error *e = kvstage_error_last();
    int found = strstr(e->message, needle) != NULL;
    size_t i;
    for (i = 0; i < e->cause_count; i++) found = found || strstr(e->causes[i], needle) != NULL;
    if (got != want || !found) {
        KV_FAIL_AT(file, line, "%s returned %d, expected %d with \"%s\" in the error", call, got, want, needle);
        kv_print_last_error(call);
    }
}
#define CHECK_ERR(call, want, needle) kv_check_err((int)(call), (want), (needle), #call, __FILE__, __LINE__)

/* The end of main(): 0 when every check passed. */
static inline int kv_finish(const char *test) {
    if (*kv_failures() != 0) {
        fprintf(stderr, "%s: %d check(s) failed\n", test, *kv_failures());
        return 1;
    }
    printf("%s: all checks passed\n", test);
    return 0;
}

/* The transport KVSTAGE_TEST_TRANSPORT forces ("rdma", "tcp" or "shm"; ctest rdma_vm runs tests on
 * real verbs this way, the *_shm ctests on the same-host path), else `fallback`. Any other value
 * is a failure, not a quiet default. */
static inline int32_t kv_test_transport(int32_t fallback) {
    const char *forced = getenv("KVSTAGE_TEST_TRANSPORT");
    if (forced == NULL || forced[0] == 0) return fallback;
    if (strcmp(forced, "rdma") == 0) return KVSTAGE_TRANSPORT_RDMA;
    if (strcmp(forced, "tcp") == 0) return KVSTAGE_TRANSPORT_TCP;
    if (strcmp(forced, "shm") == 0) return KVSTAGE_TRANSPORT_SHM;
    fprintf(stderr, "KVSTAGE_TEST_TRANSPORT=%s is not rdma, tcp or shm\n", forced);
    exit(1);
}

/* --- API 0.4 in one call, for tests whose subject is not the call itself ---------------------- */

/* kvstage_room_open with a room descriptor of `pages` and `chunk_tokens` (0: the engine's
 * default) and `parts` (may be NULL), no cached prefix, a derived trace id. On success the
 * opening's chunk count (`num_chunks`, may be NULL) and key (`key`, may be NULL) are stored;
 * on failure neither is touched and the last error is the open's. */
static inline int kv_room_open(const kvstage_engine *engine, uint64_t room, const uint32_t *pages, size_t num_pages,
                               uint32_t chunk_tokens, const kvstage_request_parts *parts, uint32_t *num_chunks,
                               uint64_t *key) {
    kvstage_room_desc desc;
    kvstage_room_grid grid;
    int rc;
    if (kvstage_room_desc_init(&desc, sizeof desc) != KVSTAGE_OK) {
        kv_print_last_error("kvstage_room_desc_init");
        exit(1);
    }
    desc.room = room;
    desc.pages = pages;
    desc.num_pages = num_pages;
    desc.chunk_tokens = chunk_tokens;
    desc.parts = parts;
    memset(&grid, 0, sizeof grid);
    grid.struct_size = sizeof grid;
    rc = (int)kvstage_room_open(engine, &desc, &grid);
    if (rc == KVSTAGE_OK) {
        if (num_chunks != NULL) *num_chunks = grid.num_chunks;
        if (key != NULL) *key = grid.key;
    }
    return rc;
}

/* kvstage_staging_register of a host ring: `memory` (NULL: engine-owned) of `bytes`. */
static inline int kv_staging_register(const kvstage_engine *engine, void *memory, size_t bytes) {
    kvstage_staging_memory staging;
    if (kvstage_staging_memory_init(&staging, sizeof staging) != KVSTAGE_OK) {
        kv_print_last_error("kvstage_staging_memory_init");
        exit(1);
    }
    staging.memory = memory;
    staging.bytes = bytes;
    return (int)kvstage_staging_register(engine, &staging);
}

/* The engine's describe document (kvstage_engine_describe: a size query, then the text; again
 * if it grew in between), malloc'ed, NUL-terminated; the caller frees it. Exits on failure. */
static inline char *kv_engine_describe(const kvstage_engine *engine) {
    int attempt;
    for (attempt = 0; attempt < 8; ++attempt) {
        size_t needed = 0;
        char *doc;
        if (kvstage_engine_describe(engine, NULL, 0, &needed) != KVSTAGE_OK || needed == 0) break;
        needed += 256; /* room for a document that grows between the two calls */
        doc = (char *)malloc(needed);
        if (doc == NULL) break;
        if (kvstage_engine_describe(engine, doc, needed, NULL) == KVSTAGE_OK) return doc;
        free(doc);
    }
    kv_print_last_error("kvstage_engine_describe");
    exit(1);
}

/* The string value of top-level key `key` of the JSON object `json`, unescaped into `out` (of
 * `capacity` bytes, truncated to fit; \uXXXX escapes become '?'). 1 when found, else 0 with
 * `out` "". Only what a describe document needs: a top-level member whose value is a string. */
static inline int kv_json_top_string(const char *json, const char *key, char *out, size_t capacity) {
    size_t key_len = strlen(key), used = 0;
    int depth = 0, expect_key = 0;
    const char *p = json;
    if (capacity > 0) out[0] = 0;
    while (*p) {
        char c = *p;
        if (c == '"') {
            /* A string: at depth 1 where a key is due, compare it with `key`. */
            const char *start = ++p;
            while (*p && *p != '"') p += (*p == '\\' && p[1]) ? 2 : 1;
            if (!*p) return 0;
            if (depth == 1 && expect_key && (size_t)(p - start) == key_len && strncmp(start, key, key_len) == 0) {
                ++p;
                while (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r') ++p;
                if (*p++ != ':') return 0;
                while (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r') ++p;
                if (*p++ != '"') return 0; /* not a string value */
                while (*p && *p != '"') {
                    char ch = *p++;
                    if (ch == '\\') {
                        char esc = *p ? *p++ : 0;
                        switch (esc) {
                        case 'n': ch = '\n'; break;
                        case 't': ch = '\t'; break;
                        case 'r': ch = '\r'; break;
                        case 'b': ch = '\b'; break;
                        case 'f': ch = '\f'; break;
                        case 'u':
                            ch = '?';
                            for (int i = 0; i < 4 && *p; ++i) ++p;
                            break;
                        default: ch = esc; /* \" \\ \/ */
                        }
                    }
                    if (used + 1 < capacity) out[used++] = ch;
                }
                if (capacity > 0) out[used] = 0;
                return *p == '"';
            }
            expect_key = 0;
            ++p;
            continue;
        }
        if (c == '{') {
            ++depth;
            expect_key = depth == 1;
        } else if (c == '[') {
            ++depth;
        } else if (c == '}' || c == ']') {
            --depth;
        } else if (c == ',' && depth == 1) {
            expect_key = 1;
        }
        ++p;
    }
    return 0;
}

/* The engine's transport in one line: the "transport" member of kvstage_engine_describe's JSON
 * (what kvstage_engine_transport_describe returned before API 0.4), into `out`. A document
 * without it is a failed check (and `out` is ""). */
static inline void kv_engine_transport(const kvstage_engine *engine, char *out, size_t capacity) {
    char *doc = kv_engine_describe(engine);
    if (!kv_json_top_string(doc, "transport", out, capacity))
        KV_FAIL_AT(__FILE__, __LINE__, "no top-level string \"transport\" in the engine's describe document: %s", doc);
    free(doc);
}

/* The name of a `kvstage_transport` value, for test output. */
static inline const char *kv_transport_name(int32_t transport) {
    switch (transport) {
    case KVSTAGE_TRANSPORT_AUTO: return "auto";
    case KVSTAGE_TRANSPORT_TCP: return "tcp";
    case KVSTAGE_TRANSPORT_RDMA: return "rdma";
    case KVSTAGE_TRANSPORT_SHM: return "shm";
    default: return "unknown";
    }
}

#endif /* KVSTAGE_CHECK_H */
