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
