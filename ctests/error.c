/* The error model from C: status codes and names, and the thread-local last error
 * (never NULL; "no error" after a success; code, class, session, message and causes after a
 * failure; replaced by the next call; kvstage_error_clear). Also built as C++17. */
#include "kvstage_check.h"

/* The "no error" state: code OK, class NONE, empty session, no causes. */
static void check_no_error(int line) {
    const kvstage_error *e = kvstage_error_last();
    if (e == NULL) {
        KV_FAIL_AT(__FILE__, line, "kvstage_error_last() returned NULL");
        return;
    }
    if (e->code != KVSTAGE_OK || e->klass != KVSTAGE_CLASS_NONE || e->session == NULL ||
        e->session[0] != '\0' || e->message == NULL || e->cause_count != 0 ||
        e->struct_size != sizeof(kvstage_error)) {
        KV_FAIL_AT(__FILE__, line, "expected the \"no error\" state");
        kv_print_last_error("last error");
    }
}
#define CHECK_NO_ERROR() check_no_error(__LINE__)

struct named_code {
    int code;
    const char *name;
};

int main(void) {
    /* Codes are stable once released: the values and names below are part of the ABI. */
    static const struct named_code codes[] = {
        {0, "KVSTAGE_OK"},
        {1, "KVSTAGE_PENDING"},
        {2, "KVSTAGE_FALLBACK"},
        {-1, "KVSTAGE_E_INVALID_ARG"},
        {-2, "KVSTAGE_E_UNSUPPORTED"},
        {-3, "KVSTAGE_E_OUT_OF_MEMORY"},
        {-10, "KVSTAGE_E_GEOMETRY_MISMATCH"},
        {-11, "KVSTAGE_E_GEOMETRY_INVALID"},
        {-12, "KVSTAGE_E_STAGING_TOO_SMALL"},
        {-13, "KVSTAGE_E_OVERSIZED"},
        {-20, "KVSTAGE_E_TIMEOUT"},
        {-21, "KVSTAGE_E_CANCELED"},
        {-22, "KVSTAGE_E_STALE_ROOM"},
        {-30, "KVSTAGE_E_TRANSPORT"},
        {-31, "KVSTAGE_E_PEER_GONE"},
        {-40, "KVSTAGE_E_PROTOCOL"},
        {-41, "KVSTAGE_E_INTEGRITY"},
        {-42, "KVSTAGE_E_AUTH"},
        {-50, "KVSTAGE_E_CUDA"},
        {-51, "KVSTAGE_E_RDMA"},
        {-52, "KVSTAGE_E_NO_DEVICE"},
        {-90, "KVSTAGE_E_PANIC"},
        {-91, "KVSTAGE_E_POISONED"},
        {-92, "KVSTAGE_E_INTERNAL"},
    };
    size_t i;
    const kvstage_error *e;
    kvstage_engine_options options;
    kvstage_engine *engine = NULL;
    char first_message[512];
    int rc;

    /* The header's enum agrees with the table. */
    CHECK_INT(KVSTAGE_OK, 0);
    CHECK_INT(KVSTAGE_PENDING, 1);
    CHECK_INT(KVSTAGE_FALLBACK, 2);
    CHECK_INT(KVSTAGE_E_INVALID_ARG, -1);
    CHECK_INT(KVSTAGE_E_GEOMETRY_MISMATCH, -10);
    CHECK_INT(KVSTAGE_E_STAGING_TOO_SMALL, -12);
    CHECK_INT(KVSTAGE_E_OVERSIZED, -13);
    CHECK_INT(KVSTAGE_E_TIMEOUT, -20);
    CHECK_INT(KVSTAGE_E_CANCELED, -21);
    CHECK_INT(KVSTAGE_E_STALE_ROOM, -22);
    CHECK_INT(KVSTAGE_E_TRANSPORT, -30);
    CHECK_INT(KVSTAGE_E_PEER_GONE, -31);
    CHECK_INT(KVSTAGE_E_PROTOCOL, -40);
    CHECK_INT(KVSTAGE_E_INTEGRITY, -41);
    CHECK_INT(KVSTAGE_E_CUDA, -50);
    CHECK_INT(KVSTAGE_E_RDMA, -51);
    CHECK_INT(KVSTAGE_E_NO_DEVICE, -52);
    CHECK_INT(KVSTAGE_E_PANIC, -90);
    CHECK_INT(KVSTAGE_E_POISONED, -91);
    for (i = 0; i < sizeof codes / sizeof codes[0]; i++) CHECK_STR(kvstage_status_name(codes[i].code), codes[i].name);
    CHECK_STR(kvstage_status_name(-1000), "KVSTAGE_UNKNOWN");
    CHECK_STR(kvstage_status_name(3), "KVSTAGE_UNKNOWN");
    CHECK_STR(kvstage_status_name(INT32_MIN), "KVSTAGE_UNKNOWN");

    /* Never NULL, "no error" before anything failed on this thread. */
    REQUIRE(kvstage_error_last() != NULL);
    CHECK_NO_ERROR();
    CHECK_STR(kvstage_error_last()->message, "no error");

    /* A failing call: code, class, message naming the argument, empty session, no causes. */
    rc = kvstage_engine_options_init(NULL, sizeof(kvstage_engine_options));
    CHECK_INT(rc, KVSTAGE_E_INVALID_ARG);
    e = kvstage_error_last();
    REQUIRE(e != NULL);
    CHECK_INT(e->struct_size, sizeof(kvstage_error));
    CHECK_INT(e->code, KVSTAGE_E_INVALID_ARG);
    CHECK_INT(e->klass, KVSTAGE_CLASS_CONFIG);
    CHECK_CONTAINS(e->message, "options");
    CHECK_CONTAINS(e->message, "NULL");
    REQUIRE(e->session != NULL);
    CHECK_STR(e->session, "");
    CHECK_INT(e->cause_count, 0);
    CHECK(strchr(e->message, '\n') == NULL); /* one line */
    snprintf(first_message, sizeof first_message, "%s", e->message);

    /* Reading it does not change it. */
    CHECK(kvstage_error_last() == e);
    CHECK_STR(kvstage_error_last()->message, first_message);

    /* The next successful call clears it. */
    CHECK_OK(kvstage_engine_options_init(&options, sizeof options));
    CHECK_NO_ERROR();

    /* The next failing call replaces it. */
    options.worker_threads = 0;
    engine = NULL;
    rc = kvstage_engine_new(&options, &engine);
    CHECK(rc < 0);
    CHECK_INT(rc, KVSTAGE_E_INVALID_ARG);
    CHECK(engine == NULL);
    e = kvstage_error_last();
    CHECK_INT(e->code, rc);
    CHECK_INT(e->klass, KVSTAGE_CLASS_CONFIG);
    CHECK_CONTAINS(e->message, "options->worker_threads");
    CHECK_CONTAINS(e->message, "0");
    CHECK(strcmp(e->message, first_message) != 0);
    CHECK_STR(e->session, "");
    CHECK(e->cause_count == 0 || e->causes != NULL);
    for (i = 0; i < e->cause_count; i++) CHECK(e->causes[i] != NULL);

    /* kvstage_error_clear resets it, and keeps returning the sentinel. */
    kvstage_error_clear();
    CHECK_NO_ERROR();
    kvstage_error_clear();
    CHECK_NO_ERROR();

    /* Any later call starts from a clean state: a failure then a success. */
    CHECK_INT(kvstage_engine_new(&options, NULL), KVSTAGE_E_INVALID_ARG);
    CHECK_CONTAINS(kvstage_error_last()->message, "out");
    options.worker_threads = 1;
    CHECK_OK(kvstage_engine_new(&options, &engine));
    CHECK_NO_ERROR();
    REQUIRE(engine != NULL);
    kvstage_engine_free(engine);
    CHECK_NO_ERROR();

    return kv_finish("error");
}
