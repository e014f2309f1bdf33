/* Label rdma: the library detects an RDMA device (libibverbs.so.1 listing at least one device).
 * Without one this test exits 77 (ctest: skipped) unless KVSTAGE_REQUIRE_RDMA=1, which turns the skip into a
 * failure on a runner that is known to have the device. */
#include "kvstage_check.h"

int main(void) {
    kvstage_capabilities caps;
    const char *require = getenv("KVSTAGE_REQUIRE_RDMA");
    kvstage_engine *engine = NULL;

    memset(&caps, 0, sizeof caps);
    caps.struct_size = sizeof caps;
    REQUIRE(kvstage_capabilities_get(&caps) == KVSTAGE_OK);
    if (!caps.rdma) {
        if (require != NULL && strcmp(require, "1") == 0) {
            fprintf(stderr, "KVSTAGE_REQUIRE_RDMA=1 but kvstage finds no rdma device\n");
            return 1;
        }
        printf("no rdma device on this host: skipped\n");
        return 77;
    }
    printf("rdma device present (rdma=%d)\n", caps.rdma);
    CHECK_OK(kvstage_engine_new(NULL, &engine));
    kvstage_engine_free(engine);
    return kv_finish("rdma_detect");
}
