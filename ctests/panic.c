/* Panic survival (needs the test-only export kvstage_testing_panic, cargo feature `testing`):
 * a Rust panic inside an export becomes KVSTAGE_E_PANIC with the panic text as a cause, the engine
 * it touched is poisoned (later calls: KVSTAGE_E_POISONED), it can still be freed, other engines
 * are unaffected, and the process survives. Also built as C++17. */
#include "kvstage_check.h"

#if !defined(KVSTAGE_TESTING)
#error "panic.c needs KVSTAGE_TESTING (configure with -DKVSTAGE_TESTING=ON)"
#endif

static int any_cause_contains(const kvstage_error *e, const char *needle) {
    size_t i;
    for (i = 0; i < e->cause_count; i++)
        if (e->causes[i] != NULL && strstr(e->causes[i], needle) != NULL) return 1;
    return 0;
}

int main(void) {
    kvstage_engine *engine = NULL, *other = NULL;
    const kvstage_error *e;
    int rc, round;

    for (round = 0; round < 3; round++) {
        engine = NULL;
        CHECK_OK(kvstage_engine_new(NULL, &engine));
        REQUIRE(engine != NULL);

        /* The panic: a code, a message, the panic text among the causes. */
        rc = kvstage_testing_panic(engine);
        CHECK_INT(rc, KVSTAGE_E_PANIC);
        e = kvstage_error_last();
        CHECK_INT(e->code, KVSTAGE_E_PANIC);
        CHECK_INT(e->klass, KVSTAGE_CLASS_INTERNAL);
        CHECK_CONTAINS(e->message, "panic");
        CHECK_STR(e->session, "");
        CHECK(e->cause_count >= 1);
        CHECK(any_cause_contains(e, "kvstage_testing_panic was called"));
        if (round == 0) kv_print_last_error("after the panic (expected)");

        /* The engine is poisoned: the next call on it fails without running. */
        rc = kvstage_testing_panic(engine);
        CHECK_INT(rc, KVSTAGE_E_POISONED);
        e = kvstage_error_last();
        CHECK_INT(e->code, KVSTAGE_E_POISONED);
        CHECK_CONTAINS(e->message, "poisoned");
        CHECK_CONTAINS(e->message, "engine");

        /* Other engines and other calls still work. */
        other = NULL;
        CHECK_OK(kvstage_engine_new(NULL, &other));
        CHECK(other != NULL);
        CHECK_STR(kvstage_version_string(), KVSTAGE_VERSION_STRING);
        CHECK_INT(kvstage_testing_panic(NULL), KVSTAGE_E_INVALID_ARG);
        CHECK_CONTAINS(kvstage_error_last()->message, "engine");

        /* A poisoned engine can be freed. */
        kvstage_engine_free(engine);
        CHECK_INT(kvstage_error_last()->code, KVSTAGE_OK);
        kvstage_engine_free(other);
    }
    printf("the process survived 3 panics\n");
    return kv_finish("panic");
}
