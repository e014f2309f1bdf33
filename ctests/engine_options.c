/* Engine options from C: defaults, valid variations, and every bad option rejected with a
 * negative code, nothing written to *out, and a message that names the option and its value.
 * Also NULL arguments and kvstage_engine_free(NULL). Also built as C++17. */
#include "kvstage_check.h"

/* A non-NULL marker: kvstage_engine_new must leave *out alone when it fails. */
static int marker_storage;
#define MARKER ((kvstage_engine *)(void *)&marker_storage)

/* engine_new(options) must fail with `code`, naming `field` and `value`. */
static void expect_rejected(int line, const kvstage_engine_options *options, int code,
                            const char *field, const char *value) {
    kvstage_engine *engine = MARKER;
    int rc = kvstage_engine_new(options, &engine);
    const kvstage_error *e = kvstage_error_last();
    if (rc >= 0 || rc != code || engine != MARKER || e->code != rc ||
        e->klass != KVSTAGE_CLASS_CONFIG || strstr(e->message, field) == NULL ||
        strstr(e->message, value) == NULL || e->session[0] != '\0') {
        KV_FAIL_AT(__FILE__, line, "%s = %s: rc %d, engine %s, expected code %d naming \"%s\" and \"%s\"",
                   field, value, rc, engine == MARKER ? "untouched" : "WRITTEN", code, field, value);
        kv_print_last_error("last error");
    } else {
        printf("rejected %-30s -> %s: %s\n", field, kvstage_status_name(rc), "ok");
    }
    if (engine != MARKER && engine != NULL) kvstage_engine_free(engine);
}
#define EXPECT_REJECTED(opts, code, field, value) expect_rejected(__LINE__, (opts), (code), (field), (value))

/* Prints the message of a rejection (to show what users see). */
static void show(const kvstage_engine_options *options) {
    kvstage_engine *engine = NULL;
    if (kvstage_engine_new(options, &engine) != KVSTAGE_OK) {
        printf("  message: %s\n", kvstage_error_last()->message);
    } else {
        kvstage_engine_free(engine);
    }
}

int main(void) {
    kvstage_engine_options defaults, o;
    kvstage_engine *engine = NULL;

    /* Defaults. */
    memset(&defaults, 0xA5, sizeof defaults);
    CHECK_OK(kvstage_engine_options_init(&defaults, sizeof defaults));
    CHECK_INT(defaults.struct_size, sizeof(kvstage_engine_options));
    CHECK_INT(defaults.transport, KVSTAGE_TRANSPORT_AUTO);
    CHECK(defaults.listen_address == NULL);
    CHECK(defaults.worker_threads >= 1 && defaults.worker_threads <= 256);
    CHECK(defaults.default_timeout_ms > 0);
    /* Receiver bounds: sane, finite defaults (a vanished host is noticed within about 15 s). */
    CHECK_INT(defaults.max_connections, 1024);
    CHECK_INT(defaults.max_handshakes, 64);
    CHECK_INT(defaults.handshake_timeout_ms, 5000);
    CHECK_INT(defaults.max_events, 65536);
    CHECK_INT(defaults.dead_peer_timeout_ms, 15000);
    CHECK_INT(defaults.room_timeout_ms, 300000);
    CHECK_INT(defaults.stall_warn_ms, 0); /* a quarter of each operation's deadline */

    /* Valid engines. */
    CHECK_OK(kvstage_engine_new(&defaults, &engine));
    CHECK(engine != NULL);
    CHECK_INT(kvstage_error_last()->code, KVSTAGE_OK);
    kvstage_engine_free(engine);

    engine = NULL;
    CHECK_OK(kvstage_engine_new(NULL, &engine)); /* NULL options = defaults */
    CHECK(engine != NULL);
    kvstage_engine_free(engine);

    o = defaults;
    o.transport = KVSTAGE_TRANSPORT_TCP;
    o.listen_address = "127.0.0.1:0";
    o.worker_threads = 256;
    o.default_timeout_ms = KVSTAGE_TIMEOUT_INFINITE;
    engine = NULL;
    CHECK_OK(kvstage_engine_new(&o, &engine));
    CHECK(engine != NULL);
    kvstage_engine_free(engine);

    o = defaults;
    o.dead_peer_timeout_ms = KVSTAGE_TIMEOUT_INFINITE; /* the OS's keepalive defaults */
    o.room_timeout_ms = KVSTAGE_TIMEOUT_INFINITE;
    o.max_connections = 1;
    o.max_handshakes = 1;
    engine = NULL;
    CHECK_OK(kvstage_engine_new(&o, &engine));
    kvstage_engine_free(engine);

    o = defaults;
    o.worker_threads = 1;
    o.default_timeout_ms = 1;
    engine = NULL;
    CHECK_OK(kvstage_engine_new(&o, &engine));
    kvstage_engine_free(engine);

    /* Bad options: each names the option and the value. */
    o = defaults;
    o.worker_threads = 0;
    EXPECT_REJECTED(&o, KVSTAGE_E_INVALID_ARG, "options->worker_threads", "0");
    show(&o);
    o.worker_threads = 257;
    EXPECT_REJECTED(&o, KVSTAGE_E_INVALID_ARG, "options->worker_threads", "257");

    o = defaults;
    o.listen_address = "not-an-address";
    EXPECT_REJECTED(&o, KVSTAGE_E_INVALID_ARG, "options->listen_address", "not-an-address");
    show(&o);
    o.listen_address = "127.0.0.1:99999";
    EXPECT_REJECTED(&o, KVSTAGE_E_INVALID_ARG, "options->listen_address", "127.0.0.1:99999");
    o.listen_address = "";
    EXPECT_REJECTED(&o, KVSTAGE_E_INVALID_ARG, "options->listen_address", "\"\"");
    o.listen_address = "\xff\xfe";
    EXPECT_REJECTED(&o, KVSTAGE_E_INVALID_ARG, "options->listen_address", "UTF-8");

    o = defaults;
    o.struct_size = 0;
    EXPECT_REJECTED(&o, KVSTAGE_E_INVALID_ARG, "options->struct_size", "0");
    show(&o);
    o.struct_size = sizeof(size_t);
    EXPECT_REJECTED(&o, KVSTAGE_E_INVALID_ARG, "options->struct_size", "8");

    o = defaults;
    o.transport = 7;
    EXPECT_REJECTED(&o, KVSTAGE_E_INVALID_ARG, "options->transport", "7");
    show(&o);
    o.transport = -1;
    EXPECT_REJECTED(&o, KVSTAGE_E_INVALID_ARG, "options->transport", "-1");

    o = defaults;
    o.default_timeout_ms = 0;
    EXPECT_REJECTED(&o, KVSTAGE_E_INVALID_ARG, "options->default_timeout_ms", "0");
    show(&o);

    /* NULL arguments. */
    CHECK_INT(kvstage_engine_new(&defaults, NULL), KVSTAGE_E_INVALID_ARG);
    CHECK_CONTAINS(kvstage_error_last()->message, "out");
    CHECK_INT(kvstage_engine_new(NULL, NULL), KVSTAGE_E_INVALID_ARG);
    CHECK_CONTAINS(kvstage_error_last()->message, "out");
    CHECK_INT(kvstage_engine_options_init(NULL, sizeof(kvstage_engine_options)), KVSTAGE_E_INVALID_ARG);
    CHECK_CONTAINS(kvstage_error_last()->message, "options");

    /* Freeing NULL is a no-op (and a call like any other: it leaves "no error"). */
    kvstage_engine_free(NULL);
    CHECK_INT(kvstage_error_last()->code, KVSTAGE_OK);

    /* Many engines at once, freed in another order. */
    {
        kvstage_engine *engines[16];
        int i;
        for (i = 0; i < 16; i++) {
            engines[i] = NULL;
            CHECK_OK(kvstage_engine_new(&defaults, &engines[i]));
        }
        for (i = 0; i < 16; i += 2) kvstage_engine_free(engines[i]);
        for (i = 1; i < 16; i += 2) kvstage_engine_free(engines[i]);
    }
    return kv_finish("engine_options");
}
