/* An application linked against an installed kvstage (CMake package or pkg-config). */
#include <stdio.h>
#include <string.h>

#include <kvstage.h>

int main(void) {
    kvstage_engine_options options;
    kvstage_engine *engine = NULL;
    int rc;

    printf("kvstage %s (header %s)\n", kvstage_version_string(), KVSTAGE_VERSION_STRING);
    if (strcmp(kvstage_version_string(), KVSTAGE_VERSION_STRING) != 0 ||
        strcmp(KVSTAGE_VERSION_STRING, KVSTAGE_EXPECTED_VERSION) != 0 ||
        kvstage_version() != KVSTAGE_VERSION) {
        fprintf(stderr, "version mismatch (expected %s)\n", KVSTAGE_EXPECTED_VERSION);
        return 1;
    }

    kvstage_engine_options_init(&options, sizeof options);
    options.worker_threads = 0;
    rc = kvstage_engine_new(&options, &engine);
    if (rc >= 0 || engine != NULL || strstr(kvstage_error_last()->message, "worker_threads") == NULL) {
        fprintf(stderr, "a bad option was not rejected (rc %d)\n", rc);
        return 1;
    }
    printf("bad option rejected: %s\n", kvstage_error_last()->message);

    options.worker_threads = 2;
    rc = kvstage_engine_new(&options, &engine);
    if (rc != KVSTAGE_OK || engine == NULL) {
        fprintf(stderr, "kvstage_engine_new failed: %d %s\n", rc, kvstage_error_last()->message);
        return 1;
    }
    kvstage_engine_free(engine);
    printf("consumer: ok\n");
    return 0;
}
