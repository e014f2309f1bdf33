/* Label gpu: the library detects a CUDA device (libcuda.so.1 with at least one GPU).
 * Without one this test exits 77 (ctest: skipped) unless KVSTAGE_REQUIRE_GPU=1, which turns the skip into a
 * failure on a runner that is known to have the device. */
#include "kvstage_check.h"

int main(void) {
    kvstage_capabilities caps;
    const char *require = getenv("KVSTAGE_REQUIRE_GPU");
    kvstage_engine *engine = NULL;

    memset(&caps, 0, sizeof caps);
    caps.struct_size = sizeof caps;
    REQUIRE(kvstage_capabilities_get(&caps) == KVSTAGE_OK);
    if (!caps.cuda_memory) {
        if (require != NULL && strcmp(require, "1") == 0) {
            fprintf(stderr, "KVSTAGE_REQUIRE_GPU=1 but kvstage finds no gpu device\n");
            return 1;
        }
        printf("no gpu device on this host: skipped\n");
        return 77;
    }
    printf("gpu device present (cuda_memory=%d)\n", caps.cuda_memory);
    CHECK_OK(kvstage_engine_new(NULL, &engine));
    kvstage_engine_free(engine);
    return kv_finish("gpu_detect");
}
