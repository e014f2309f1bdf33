/* Static linking: this executable links libkvstage.a (kvstage::static) and must not load
 * libkvstage.so at all. Version, engine, errors and (with the testing exports) a caught panic
 * all work: unwinding inside the static Rust code is intact. */
#define _GNU_SOURCE
#include <link.h>

#include "kvstage_check.h"

static int count_kvstage_so(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    if (info->dlpi_name != NULL && strstr(info->dlpi_name, "libkvstage.so") != NULL) {
        fprintf(stderr, "loaded: %s\n", info->dlpi_name);
        ++*(int *)data;
    }
    return 0;
}

int main(void) {
    kvstage_engine_options options;
    kvstage_engine *engine = NULL;
    int shared_copies = 0;

    dl_iterate_phdr(count_kvstage_so, &shared_copies);
    CHECK_INT(shared_copies, 0);

    CHECK_STR(kvstage_version_string(), KVSTAGE_VERSION_STRING);
    CHECK_INT(kvstage_version(), KVSTAGE_VERSION);

    CHECK_OK(kvstage_engine_options_init(&options, sizeof options));
    options.default_timeout_ms = 0;
    CHECK_INT(kvstage_engine_new(&options, &engine), KVSTAGE_E_INVALID_ARG);
    CHECK_CONTAINS(kvstage_error_last()->message, "options->default_timeout_ms");
    CHECK(engine == NULL);

    options.default_timeout_ms = 1000;
    CHECK_OK(kvstage_engine_new(&options, &engine));
    REQUIRE(engine != NULL);
#if defined(KVSTAGE_TESTING)
    CHECK_INT(kvstage_testing_panic(engine), KVSTAGE_E_PANIC);
    CHECK_INT(kvstage_testing_panic(engine), KVSTAGE_E_POISONED);
#endif
    kvstage_engine_free(engine);
    kvstage_engine_free(NULL);
    return kv_finish("static_link");
}
