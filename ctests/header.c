/* The generated header in several language modes (built as C99, C11, C++11 and C++17, each with
 * -Wall -Wextra -Wpedantic -Werror and no extensions): every declaration compiles, every
 * signature is what callers were promised, and the program links and runs. Only kvstage.h and the
 * C standard library are included, so nothing else can hide a header problem. */
#include "kvstage.h"

#include <stdio.h>
#include <string.h>

int main(void) {
    /* Every export, through a pointer of the promised type. */
    const char *(*p_version_string)(void) = kvstage_version_string;
    uint32_t (*p_version)(void) = kvstage_version;
    const char *(*p_status_name)(int32_t) = kvstage_status_name;
    const struct kvstage_error *(*p_error_last)(void) = kvstage_error_last;
    void (*p_error_clear)(void) = kvstage_error_clear;
    enum kvstage_status (*p_caps)(struct kvstage_capabilities *) = kvstage_capabilities_get;
    enum kvstage_status (*p_opts_init)(struct kvstage_engine_options *, size_t) = kvstage_engine_options_init;
    enum kvstage_status (*p_engine_new)(const struct kvstage_engine_options *, struct kvstage_engine **) =
        kvstage_engine_new;
    void (*p_engine_free)(struct kvstage_engine *) = kvstage_engine_free;
    /* API 0.4: rooms by descriptor and key, events of versioned elements. */
    enum kvstage_status (*p_room_desc_init)(struct kvstage_room_desc *, size_t) = kvstage_room_desc_init;
    enum kvstage_status (*p_room_open)(const struct kvstage_engine *, const struct kvstage_room_desc *,
                                       struct kvstage_room_grid *) = kvstage_room_open;
    enum kvstage_status (*p_room_wait)(const struct kvstage_engine *, uint64_t, uint64_t, uint64_t) = kvstage_room_wait;
    enum kvstage_status (*p_room_release)(const struct kvstage_engine *, uint64_t, uint64_t) = kvstage_room_release;
    enum kvstage_status (*p_poll_events)(const struct kvstage_engine *, struct kvstage_room_event *, size_t, size_t *) =
        kvstage_engine_poll_events;
#if defined(KVSTAGE_TESTING)
    enum kvstage_status (*p_testing_panic)(const struct kvstage_engine *) = kvstage_testing_panic;
    int has_testing = p_testing_panic != NULL;
#else
    int has_testing = 0;
#endif

    /* Both spellings of every type (typedef and tag) name the same thing. */
    kvstage_status status = KVSTAGE_OK;
    kvstage_error_class klass = KVSTAGE_CLASS_NONE;
    kvstage_transport transport = KVSTAGE_TRANSPORT_AUTO;
    kvstage_engine_options options;
    kvstage_capabilities caps;
    kvstage_engine *engine = NULL;
    const kvstage_error *err;
    uint64_t infinite = KVSTAGE_TIMEOUT_INFINITE;
    int ok = 1;

    memset(&options, 0, sizeof options);
    memset(&caps, 0, sizeof caps);
    ok &= KVSTAGE_VERSION == ((KVSTAGE_VERSION_MAJOR << 16) | (KVSTAGE_VERSION_MINOR << 8) | KVSTAGE_VERSION_PATCH);
    ok &= strlen(KVSTAGE_VERSION_STRING) >= 5;
    ok &= KVSTAGE_PENDING > 0 && KVSTAGE_FALLBACK > 0 && KVSTAGE_E_INVALID_ARG < 0;
    ok &= infinite == UINT64_MAX;
    ok &= (int)transport == 0 && (int)klass == 0 && (int)status == 0;
    ok &= p_version_string != NULL && p_version != NULL && p_status_name != NULL;
    ok &= p_error_last != NULL && p_error_clear != NULL && p_caps != NULL;
    ok &= p_opts_init != NULL && p_engine_new != NULL && p_engine_free != NULL;
    ok &= p_room_desc_init != NULL && p_room_open != NULL && p_room_wait != NULL && p_room_release != NULL &&
          p_poll_events != NULL;
    ok &= KVSTAGE_ROOM_EVENT_CHUNK == 1 && KVSTAGE_ROOM_EVENT_ROOM == 2 && KVSTAGE_COMPLETION_ROOM == 3;
    ok &= engine == NULL;

    /* And it links and runs. */
    err = p_error_last();
    ok &= err != NULL && err->code == KVSTAGE_OK;
    printf("kvstage %s (header %s, testing exports declared: %d), %s\n", p_version_string(),
           KVSTAGE_VERSION_STRING, has_testing,
#if defined(__cplusplus)
           "C++"
#else
           "C"
#endif
    );
    return ok ? 0 : 1;
}
