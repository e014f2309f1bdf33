/* Version agreement: the runtime values equal the header macros, which equal Cargo.toml's
 * [package] version (as CMake read it: KVSTAGE_EXPECTED_VERSION). */
#include "kvstage_check.h"

int main(void) {
    unsigned major = 0, minor = 0, patch = 0;
    char expected[64];
    const char *runtime = kvstage_version_string();

    REQUIRE(runtime != NULL);
    printf("runtime %s (0x%06x), header %s (0x%06x), Cargo.toml %s\n", runtime,
           (unsigned)kvstage_version(), KVSTAGE_VERSION_STRING, (unsigned)KVSTAGE_VERSION,
           KVSTAGE_EXPECTED_VERSION);

    CHECK_STR(runtime, KVSTAGE_VERSION_STRING);
    CHECK_STR(KVSTAGE_VERSION_STRING, KVSTAGE_EXPECTED_VERSION);
    CHECK_INT(kvstage_version(), KVSTAGE_VERSION);

    snprintf(expected, sizeof expected, "%d.%d.%d", KVSTAGE_VERSION_MAJOR, KVSTAGE_VERSION_MINOR,
             KVSTAGE_VERSION_PATCH);
    CHECK_STR(runtime, expected);

    REQUIRE(sscanf(runtime, "%u.%u.%u", &major, &minor, &patch) == 3);
    CHECK_INT(major, KVSTAGE_VERSION_MAJOR);
    CHECK_INT(minor, KVSTAGE_VERSION_MINOR);
    CHECK_INT(patch, KVSTAGE_VERSION_PATCH);
    CHECK_INT(kvstage_version(), (major << 16) | (minor << 8) | patch);

    /* Static storage: the same pointer every time, and the version calls leave no error. */
    CHECK(kvstage_version_string() == runtime);
    CHECK_INT(kvstage_error_last()->code, KVSTAGE_OK);
    return kv_finish("version");
}
