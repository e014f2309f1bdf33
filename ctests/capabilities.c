/* The capability report (what this build can use on this host) and its versioned-struct rules:
 * struct_size must be set, and a smaller (older) struct is filled only as far as it reaches. */
#include <stddef.h>

#include "kvstage_check.h"

int main(void) {
    kvstage_capabilities caps;
    unsigned char raw[sizeof(kvstage_capabilities) + 16];
    kvstage_capabilities *partial = (kvstage_capabilities *)(void *)raw;
    size_t i, limit = offsetof(kvstage_capabilities, rdma);

    memset(&caps, 0, sizeof caps);
    caps.struct_size = sizeof caps;
    CHECK_OK(kvstage_capabilities_get(&caps));
    printf("capabilities: tcp=%d rdma=%d host_memory=%d cuda_memory=%d\n", caps.tcp, caps.rdma,
           caps.host_memory, caps.cuda_memory);
    CHECK_INT(caps.struct_size, sizeof caps);
    CHECK_INT(caps.tcp, 1);
    CHECK_INT(caps.host_memory, 1);
    CHECK(caps.rdma == 0 || caps.rdma == 1);
    CHECK(caps.cuda_memory == 0 || caps.cuda_memory == 1);

    /* An older caller whose struct ends before `rdma`: nothing past its size is written. */
    memset(raw, 0xEE, sizeof raw);
    partial->struct_size = limit;
    CHECK_OK(kvstage_capabilities_get(partial));
    CHECK_INT(partial->struct_size, limit);
    CHECK_INT(raw[offsetof(kvstage_capabilities, tcp)], 1);
    for (i = limit; i < sizeof raw; i++) CHECK_INT(raw[i], 0xEE);

    /* Errors. */
    CHECK_INT(kvstage_capabilities_get(NULL), KVSTAGE_E_INVALID_ARG);
    CHECK_CONTAINS(kvstage_error_last()->message, "out");
    memset(&caps, 0, sizeof caps);
    CHECK_INT(kvstage_capabilities_get(&caps), KVSTAGE_E_INVALID_ARG);
    CHECK_CONTAINS(kvstage_error_last()->message, "out->struct_size");
    CHECK_CONTAINS(kvstage_error_last()->message, "0");
    return kv_finish("capabilities");
}
