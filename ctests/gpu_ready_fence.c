/* ctest cuda_fake_ready_fence (fake libcuda): a transfer whose KV is not ready yet holds nothing
 * another transfer needs. Transfer A (asynchronous) names a CUevent recorded on a stream the fake
 * driver holds back for 4 s, as a long prefill kernel would; transfer B (synchronous, 1 s
 * deadline) of the same room, session, engine and device, its KV ready, must complete while A
 * still waits. Before, A waited for its event inside the device's gather lane (and a same-host
 * sender inside its ring range), so B waited for A's compute and missed its deadline. Then A
 * completes and the decode pool equals the prefill pages, byte for byte. Prefill TP 1 -> decode
 * TP 1, device pools, the engine's host ring (same-host path). Exit 77 without the fake driver
 * (a real GPU has no stream delay to ask for; the runner's PyTorch check covers a slow producer
 * there). */
#define _POSIX_C_SOURCE 200809L

#include "gpu_common.h"

typedef void (*fake_delay_fn)(void *stream, unsigned ms);

static const uint32_t SRC[NPAGES] = {9, 4, 12, 1};
static const uint32_t DST[NPAGES] = {3, 7, 15, 0};

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static kvstage_transfer_desc chunk_desc(uint64_t room_key, uint32_t chunk, uint64_t timeout_ms) {
    kvstage_transfer_desc d;
    REQUIRE(kvstage_transfer_desc_init(&d, sizeof d) == KVSTAGE_OK);
    d.room = ROOM;
    d.room_key = room_key;
    d.chunk_index = chunk;
    d.src_pages = SRC + chunk * (CHUNK / PAGE);
    d.num_pages = CHUNK / PAGE;
    d.timeout_ms = timeout_ms;
    return d;
}

int main(void) {
    void *lib = NULL, *stream = NULL, *event = NULL;
    pool src, dst;
    kvstage_engine *decode = NULL, *prefill = NULL;
    kvstage_session *session = NULL;
    kvstage_op *a = NULL;
    kvstage_transfer_desc da, db;
    char addr[64];
    uint32_t chunks = 0;
    uint64_t room_key = 0;
    size_t b, pg, t;
    double started;
    uint8_t *got;
    fake_delay_fn delay;
    int rc = start_cuda(&lib);
    if (rc != 0) return rc;
    delay = (fake_delay_fn)(uintptr_t)dlsym(lib, "kvstage_fake_stream_delay");
    if (delay == NULL) return skip("needs the fake driver's stream delay");
    find_fake_counters(lib);
    pool_init(&src, 0, 1, 5);
    pool_init(&dst, 0, 1, 99);

    REQUIRE(kvstage_engine_new(NULL, &decode) == KVSTAGE_OK);
    CHECK_OK(kvstage_pool_register(decode, &dst.layout));
    CHECK_OK(kv_staging_register(decode, NULL, 1 << 20));
    CHECK_OK(kv_room_open(decode, ROOM, DST, NPAGES, CHUNK, NULL, &chunks, &room_key));
    CHECK_INT(chunks, 2);
    CHECK_OK(kvstage_engine_listen_address(decode, addr, sizeof addr, NULL));
    REQUIRE(kvstage_engine_new(NULL, &prefill) == KVSTAGE_OK);
    CHECK_OK(kvstage_pool_register(prefill, &src.layout));
    CHECK_OK(kvstage_session_connect(prefill, addr, "ready-fence", 5000, &session));
    REQUIRE(*kv_failures() == 0);

    /* A: its KV is ready 4 s from now. */
    REQUIRE(cu.stream_create(&stream, 0) == 0);
    delay(stream, 4000);
    REQUIRE(cu.event_create(&event, 0) == 0);
    REQUIRE(cu.event_record(event, stream) == 0);
    da = chunk_desc(room_key, 0, 20000);
    da.cuda_event = event;
    CHECK_INT(kvstage_transfer_async(session, &da, &a), KVSTAGE_PENDING);

    /* B: ready now, 1 s to land; A is still waiting for its event when B is done. */
    db = chunk_desc(room_key, 1, 1000);
    started = now_ms();
    rc = kvstage_transfer(session, &db);
    if (rc != KVSTAGE_OK) kv_print_last_error("transfer B, while A waits for its KV");
    CHECK_INT(rc, KVSTAGE_OK);
    printf("B landed in %.0f ms while A waited for its ready point\n", now_ms() - started);
    CHECK_INT(kvstage_op_poll(a), KVSTAGE_PENDING);

    CHECK_OK(kvstage_op_wait(a, 20000));
    kvstage_op_free(a);
    CHECK_OK(kvstage_room_wait(decode, ROOM, room_key, 10000));

    /* Decode page DST[i] holds prefill page SRC[i] (TP 1 to TP 1: the same token slots). */
    for (b = 0; b < 2 * LAYERS; b++)
        for (pg = 0; pg < NPAGES; pg++)
            for (t = 0; t < PAGE; t++)
                memcpy(dst.host + b * dst.buffer + ((size_t)DST[pg] * PAGE + t) * dst.slot,
                       src.host + b * src.buffer + ((size_t)SRC[pg] * PAGE + t) * src.slot, src.slot);
    got = (uint8_t *)malloc(2 * LAYERS * dst.buffer);
    REQUIRE(got != NULL);
    REQUIRE(cu.dtoh(got, dst.dev, 2 * LAYERS * dst.buffer) == 0);
    CHECK(memcmp(got, dst.host, 2 * LAYERS * dst.buffer) == 0);
    free(got);
    CHECK_OK(kvstage_room_release(decode, ROOM, room_key));

    kvstage_session_free(session);
    kvstage_engine_free(prefill);
    kvstage_engine_free(decode);
    cu.event_destroy(event);
    cu.stream_destroy(stream);
    cu.free_(src.dev);
    cu.free_(dst.dev);
    free(src.host);
    free(dst.host);
    return finish("gpu_ready_fence");
}
