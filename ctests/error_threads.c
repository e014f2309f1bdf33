/* The last error is per thread: a failure on one thread is invisible on another, and many threads
 * failing at once each read back their own error. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>

#include "kvstage_check.h"

#define THREADS 8
#define ROUNDS 500

struct worker {
    unsigned index;
    int failures;
    char first_seen[256];
};

static void *run_worker(void *arg) {
    struct worker *w = (struct worker *)arg;
    const kvstage_error *e = kvstage_error_last();
    kvstage_engine_options options;
    kvstage_engine *engine = NULL;
    char expected[64];
    int round;

    /* A new thread starts with "no error", whatever the main thread did. */
    snprintf(w->first_seen, sizeof w->first_seen, "%s", e->message);
    if (e->code != KVSTAGE_OK) w->failures++;

    for (round = 0; round < ROUNDS; round++) {
        if (kvstage_engine_options_init(&options, sizeof options) != KVSTAGE_OK) w->failures++;
        /* A value unique to this thread and round, outside 1..=256. */
        options.worker_threads = 1000u + w->index * 100000u + (unsigned)round;
        if (kvstage_engine_new(&options, &engine) != KVSTAGE_E_INVALID_ARG) w->failures++;
        snprintf(expected, sizeof expected, "%u", options.worker_threads);
        e = kvstage_error_last();
        if (e->code != KVSTAGE_E_INVALID_ARG || strstr(e->message, expected) == NULL ||
            strstr(e->message, "options->worker_threads") == NULL) {
            fprintf(stderr, "thread %u round %d: unexpected last error \"%s\"\n", w->index, round, e->message);
            w->failures++;
        }
    }
    if (engine != NULL) w->failures++; /* never written on failure */
    return NULL;
}

int main(void) {
    pthread_t threads[THREADS];
    struct worker workers[THREADS];
    unsigned i;

    /* Fail on the main thread first. */
    CHECK_INT(kvstage_engine_options_init(NULL, sizeof(kvstage_engine_options)), KVSTAGE_E_INVALID_ARG);
    CHECK_CONTAINS(kvstage_error_last()->message, "options");

    for (i = 0; i < THREADS; i++) {
        memset(&workers[i], 0, sizeof workers[i]);
        workers[i].index = i;
        REQUIRE(pthread_create(&threads[i], NULL, run_worker, &workers[i]) == 0);
    }
    for (i = 0; i < THREADS; i++) {
        REQUIRE(pthread_join(threads[i], NULL) == 0);
        CHECK_INT(workers[i].failures, 0);
        CHECK_STR(workers[i].first_seen, "no error");
    }

    /* The main thread's error is still its own. */
    CHECK_INT(kvstage_error_last()->code, KVSTAGE_E_INVALID_ARG);
    CHECK_CONTAINS(kvstage_error_last()->message, "options");
    CHECK(strstr(kvstage_error_last()->message, "worker_threads") == NULL);
    return kv_finish("error_threads");
}
