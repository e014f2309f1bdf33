/* Label gpu: a staged transfer between CUDA device pools on one host (same-host path, transport
 * AUTO). Prefill TP 2 (two engines, 2 KV heads each) -> decode TP 1 (4 KV heads), 3 layers, bf16,
 * 4-token pages, two chunks with pages out of order, the second sent layer-wise (each layer marked
 * after work on a CUDA stream, by a recorded event or by the stream). The decode pool is read back
 * from the device and compared byte for byte with a reference reshard of the prefill pools; pages
 * outside the room must be untouched. The device memory is allocated through libcuda itself
 * (dlopen), as an application would. Exit 77 without a CUDA device, unless KVSTAGE_REQUIRE_GPU=1.
 *
 * The decode staging ring (argv[1]): "host" (default, engine-owned host memory, mapped by the
 * senders), "device" (engine-allocated on device 0) or "caller-device" (device memory the test
 * allocates), both in this process: the senders' gathers write the device ring at its address;
 * "device-ipc": the decode engine runs in a second process (forked before CUDA starts) with an
 * engine-allocated device ring, which the senders open through CUDA IPC; "device-rdma": an
 * engine-allocated device ring reached over RDMA on the soft fabric of test builds (prefill
 * transport RDMA), the ring and the senders' device staging buffers registered through the fake
 * driver's dma-bufs (GPUDirect), without integrity checks so that no byte may cross to the host
 * ("device-rdma-integrity": with them); "device-tcp": an engine-allocated device ring reached by
 * TCP (prefill transport TCP), every byte landed through the receiver's pinned bounce;
 * "device-ipc-kill": as device-ipc, but the first prefill process is SIGKILLed in the middle of a
 * chunk, and a second one sends the next room (see ipc_kill). Those run with direct mode off (the
 * ring is what they test). "device-direct": as device-ipc in direct mode: the decode pool (one
 * allocation of exactly its buffers) is opened by the prefill processes through CUDA IPC and every
 * chunk copied pool to pool by one kernel (no ring, no scatter: counted on both sides), covered
 * checksums read back from both pools; "device-direct-unchecked": the same without integrity
 * checks, so that not one byte may cross to the host; "device-direct-kill": device-ipc-kill in
 * direct mode (the victim is killed after copying a layer into the decode pages; the room fails
 * and the next room lands exact). Device
 * rings run with
 * integrity ALWAYS (each side reads the regions back to check them), and first check what must be
 * refused: a device ring with a host pool (either registration order), an engine-allocated device
 * ring without a device, device memory through the host-only call, a bad memory kind, a sender
 * with a host pool that requires the same-host path into a device ring, and (fake driver only) a
 * device ring the driver cannot export (by IPC; as a dma-buf, in device-rdma): refused to a
 * sender that requires the path, a counted downgrade to TCP for AUTO. */
#define _POSIX_C_SOURCE 200809L

#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gpu_common.h"

/* "device-rdma": every engine opens the soft RDMA fabric's device (test builds only). */
static const char *soft_rdma;
/* "device-tcp": the prefill engines send by TCP (through the decode ring's pinned bounce). */
static int by_tcp;
/* "device-direct*": engines allow direct mode (the others rule it out, to test the ring). */
static int direct_mode;

static kvstage_engine *engine_on(pool *p, int integrity, int transport) {
    kvstage_engine_options o;
    kvstage_engine *e = NULL;
    REQUIRE(kvstage_engine_options_init(&o, sizeof o) == KVSTAGE_OK);
    o.integrity = integrity;
    o.transport = transport;
    o.rdma_devices = soft_rdma;
    o.same_host_direct = direct_mode;
    REQUIRE(kvstage_engine_new(&o, &e) == KVSTAGE_OK);
    CHECK_OK(kvstage_pool_register(e, &p->layout));
    return e;
}

static kvstage_engine *engine_with(pool *p, int integrity) { return engine_on(p, integrity, KVSTAGE_TRANSPORT_AUTO); }

static kvstage_staging_memory device_ring(void *memory, int32_t device, size_t bytes) {
    kvstage_staging_memory m;
    REQUIRE(kvstage_staging_memory_init(&m, sizeof m) == KVSTAGE_OK);
    m.memory_kind = KVSTAGE_MEMORY_CUDA;
    m.cuda_device = device;
    m.memory = memory;
    m.bytes = bytes;
    return m;
}

static const uint32_t SRC_PAGES[NPAGES] = {7, 2, 3, 11};
static const uint32_t DST_PAGES[NPAGES] = {5, 14, 0, 1};

/* What a device ring must refuse, on engines of their own. */
static void check_refusals(pool *dst, pool *sender, void *device_memory, int fake_driver) {
    kvstage_engine *e = NULL, *shm_sender = NULL;
    kvstage_engine_options o;
    kvstage_staging_memory m = device_ring(NULL, 0, 1 << 16);
    kvstage_session *s = NULL;
    char addr[64];
    kvstage_kv_layout host = dst->layout;
    uint8_t *host_buffers = (uint8_t *)calloc(2 * LAYERS, dst->buffer);
    uint64_t hk[LAYERS], hv[LAYERS];
    size_t i;

    REQUIRE(host_buffers != NULL);
    for (i = 0; i < LAYERS; i++) {
        hk[i] = (uint64_t)(uintptr_t)(host_buffers + 2 * i * dst->buffer);
        hv[i] = (uint64_t)(uintptr_t)(host_buffers + (2 * i + 1) * dst->buffer);
    }
    host.k_bases = hk;
    host.v_bases = hv;
    host.memory_kind = KVSTAGE_MEMORY_HOST;
    host.cuda_device = -1;

    /* Host pool, then a device ring; and the other order. */
    REQUIRE(kvstage_engine_new(NULL, &e) == KVSTAGE_OK);
    CHECK_OK(kvstage_pool_register(e, &host));
    CHECK_ERR(kvstage_staging_register(e, &m), KVSTAGE_E_INVALID_ARG, "the KV pool is host memory");
    kvstage_engine_free(e);
    REQUIRE(kvstage_engine_new(NULL, &e) == KVSTAGE_OK);
    CHECK_OK(kvstage_staging_register(e, &m));
    CHECK_ERR(kvstage_pool_register(e, &host), KVSTAGE_E_INVALID_ARG, "the KV pool is host memory");
    /* Bad descriptors. */
    m.cuda_device = -1;
    CHECK_ERR(kvstage_staging_register(e, &m), KVSTAGE_E_INVALID_ARG, "staging->cuda_device");
    m.cuda_device = 0;
    m.memory_kind = 7;
    CHECK_ERR(kvstage_staging_register(e, &m), KVSTAGE_E_INVALID_ARG, "staging->memory_kind");
    m.memory_kind = KVSTAGE_MEMORY_CUDA;
    m.struct_size = 0;
    CHECK_ERR(kvstage_staging_register(e, &m), KVSTAGE_E_INVALID_ARG, "staging->struct_size");
    CHECK_ERR(kv_staging_register(e, device_memory, 1 << 16), KVSTAGE_E_INVALID_ARG, "is CUDA device memory");
    kvstage_engine_free(e);

    /* A sender with a host pool that requires the same-host path: a device ring is written from
     * device memory only. */
    e = engine_with(dst, KVSTAGE_INTEGRITY_OFF);
    m = device_ring(NULL, 0, 1 << 20);
    CHECK_OK(kvstage_staging_register(e, &m));
    CHECK_OK(kvstage_engine_listen_address(e, addr, sizeof addr, NULL));
    REQUIRE(kvstage_engine_options_init(&o, sizeof o) == KVSTAGE_OK);
    o.transport = KVSTAGE_TRANSPORT_SHM;
    REQUIRE(kvstage_engine_new(&o, &shm_sender) == KVSTAGE_OK);
    CHECK_OK(kvstage_pool_register(shm_sender, &host));
    CHECK_ERR(kvstage_session_connect(shm_sender, addr, "shm-host-pool", 5000, &s), KVSTAGE_E_UNSUPPORTED, "KV pool is host memory");
    kvstage_engine_free(shm_sender);
    /* The driver cannot export the ring (as for VMM memory): SHM fails, AUTO goes by TCP, counted. */
    if (fake_driver) {
        kvstage_engine_stats st;
        REQUIRE(setenv("KVSTAGE_FAKE_CUDA_NO_IPC", "1", 1) == 0);
        REQUIRE(kvstage_engine_new(&o, &shm_sender) == KVSTAGE_OK);
        CHECK_OK(kvstage_pool_register(shm_sender, &sender->layout));
        CHECK_ERR(kvstage_session_connect(shm_sender, addr, "shm-no-ipc", 5000, &s), KVSTAGE_E_UNSUPPORTED, "cannot be shared by CUDA IPC");
        kvstage_engine_free(shm_sender);
        shm_sender = engine_with(sender, KVSTAGE_INTEGRITY_OFF);
        CHECK_OK(kvstage_session_connect(shm_sender, addr, "auto-no-ipc", 5000, &s));
        st = stats_of(shm_sender);
        CHECK_INT(st.shm_sessions, 0);
        CHECK_INT(st.shm_downgrades, 1);
        kvstage_session_free(s);
        kvstage_engine_free(shm_sender);
        REQUIRE(unsetenv("KVSTAGE_FAKE_CUDA_NO_IPC") == 0);
    }
    /* Direct mode: a decode pool whose allocation holds other bytes too is not shared (CUDA IPC
     * would give the sender all of it): the session is same-host, its chunks go through the ring. */
    if (direct_mode) {
        pool wide = *dst;
        kvstage_engine *narrow_sender;
        kvstage_engine_stats st;
        char wide_addr[64];
        unsigned long long memory = 0;
        REQUIRE(cu.alloc(&memory, 2 * LAYERS * dst->buffer + 4096) == 0);
        for (i = 0; i < LAYERS; i++) {
            wide.k[i] = memory + 2 * i * dst->buffer;
            wide.v[i] = memory + (2 * i + 1) * dst->buffer;
        }
        wide.layout.k_bases = wide.k;
        wide.layout.v_bases = wide.v;
        kvstage_engine *wide_decode = engine_with(&wide, KVSTAGE_INTEGRITY_OFF);
        m = device_ring(NULL, 0, 1 << 20);
        CHECK_OK(kvstage_staging_register(wide_decode, &m));
        CHECK_OK(kvstage_engine_listen_address(wide_decode, wide_addr, sizeof wide_addr, NULL));
        narrow_sender = engine_with(sender, KVSTAGE_INTEGRITY_OFF);
        CHECK_OK(kvstage_session_connect(narrow_sender, wide_addr, "direct-not-shared", 5000, &s));
        st = stats_of(narrow_sender);
        CHECK_INT(st.shm_sessions, 1);
        CHECK_INT(st.shm_direct_sessions, 0);
        kvstage_session_free(s);
        kvstage_engine_free(narrow_sender);
        kvstage_engine_free(wide_decode);
        cu.free_(memory);
    }
    /* GPUDirect RDMA without a dma-buf (and without peer memory: the soft fabric cannot pin a
     * device pointer): RDMA senders fail, AUTO ones (same host off) go by TCP, counted. */
    if (fake_driver && soft_rdma != NULL) {
        kvstage_engine_stats st;
        kvstage_transfer_desc d;
        char describe[1024];
        uint32_t chunks = 0;
        uint64_t room_key = 0;
        /* A receiver of its own: the one above registered its ring with the NIC already. */
        kvstage_engine_free(e);
        e = engine_with(dst, KVSTAGE_INTEGRITY_OFF);
        m = device_ring(NULL, 0, 1 << 20);
        CHECK_OK(kvstage_staging_register(e, &m));
        CHECK_OK(kvstage_engine_listen_address(e, addr, sizeof addr, NULL));
        REQUIRE(setenv("KVSTAGE_FAKE_CUDA_NO_DMABUF", "1", 1) == 0);
        shm_sender = engine_on(sender, KVSTAGE_INTEGRITY_OFF, KVSTAGE_TRANSPORT_RDMA);
        CHECK_ERR(kvstage_session_connect(shm_sender, addr, "rdma-no-dmabuf", 5000, &s), KVSTAGE_E_UNSUPPORTED, "cannot be registered for GPUDirect RDMA");
        kvstage_engine_free(shm_sender);
        REQUIRE(kvstage_engine_options_init(&o, sizeof o) == KVSTAGE_OK);
        o.rdma_devices = soft_rdma;
        o.same_host = KVSTAGE_SAME_HOST_OFF;
        REQUIRE(kvstage_engine_new(&o, &shm_sender) == KVSTAGE_OK);
        CHECK_OK(kvstage_pool_register(shm_sender, &sender->layout));
        CHECK_OK(kvstage_session_connect(shm_sender, addr, "auto-no-dmabuf", 5000, &s));
        st = stats_of(shm_sender);
        CHECK_INT(st.rdma_sessions, 0);
        CHECK_INT(st.rdma_downgrades, 1);
        kvstage_session_free(s);
        kvstage_engine_free(shm_sender);
        /* Into a host ring the sender alone needs GPUDirect: without a dma-buf its chunk is staged
         * in host memory instead, delivered, counted and said. */
        kvstage_engine_free(e);
        e = engine_with(dst, KVSTAGE_INTEGRITY_OFF);
        CHECK_OK(kv_staging_register(e, NULL, 1 << 20));
        CHECK_OK(kvstage_engine_listen_address(e, addr, sizeof addr, NULL));
        CHECK_OK(kv_room_open(e, ROOM, DST_PAGES, NPAGES, CHUNK, NULL, &chunks, &room_key));
        shm_sender = engine_on(sender, KVSTAGE_INTEGRITY_OFF, KVSTAGE_TRANSPORT_RDMA);
        CHECK_OK(kvstage_session_connect(shm_sender, addr, "rdma-host-bounce", 5000, &s));
        REQUIRE(kvstage_transfer_desc_init(&d, sizeof d) == KVSTAGE_OK);
        d.room = ROOM;
        d.room_key = room_key;
        d.src_pages = SRC_PAGES;
        d.num_pages = CHUNK / PAGE;
        d.timeout_ms = 10000;
        CHECK_OK(kvstage_transfer(s, &d));
        kv_engine_transport(shm_sender, describe, sizeof describe);
        CHECK_CONTAINS(describe, "1 session(s) staging GPU data in host memory (no GPUDirect)");
        CHECK_INT(stats_of(shm_sender).rdma_host_staging_sessions, 1);
        CHECK_CONTAINS(describe, "cannot be registered for GPUDirect RDMA");
        kvstage_session_free(s);
        kvstage_engine_free(shm_sender);
        REQUIRE(unsetenv("KVSTAGE_FAKE_CUDA_NO_DMABUF") == 0);
    }
    kvstage_engine_free(e);
    free(host_buffers);
}

/* One chunk layer-wise, its layers marked last first, each after the caller's work on a CUDA
 * stream: odd layers by an event recorded there, even ones by the stream itself. */
static void send_layerwise(kvstage_session *s, const kvstage_transfer_desc *d) {
    void *stream = NULL, *events[LAYERS] = {NULL};
    kvstage_op *op = NULL;
    int l;
    REQUIRE(cu.stream_create(&stream, 0) == 0);
    CHECK_INT(kvstage_transfer_layerwise_async(s, d, &op), KVSTAGE_PENDING);
    for (l = LAYERS - 1; l >= 0; l--) {
        if (l % 2) {
            REQUIRE(cu.event_create(&events[l], 0) == 0);
            REQUIRE(cu.event_record(events[l], stream) == 0);
            CHECK_OK(kvstage_op_layers_ready(op, (uint32_t)l, 1, NULL, events[l]));
        } else {
            CHECK_OK(kvstage_op_layers_ready(op, (uint32_t)l, 1, stream, NULL));
        }
    }
    CHECK_OK(kvstage_op_wait(op, 10000));
    kvstage_op_free(op);
    for (l = 0; l < LAYERS; l++)
        if (events[l] != NULL) cu.event_destroy(events[l]);
    cu.stream_destroy(stream);
}

/* Integrity on device rings (each side reads the regions back to check them); "device-rdma"
 * runs without it, so that no byte may cross to the host at all. */
static int device_integrity = KVSTAGE_INTEGRITY_ALWAYS;

/* The prefill side: both ranks connect to `addr` and send every chunk of the room (opened with
 * key `room_key`; the last chunk layer-wise); then each engine's same-host counters are checked, and with the fake driver that
 * a device ring was written device to device (the gather in place: no host staging copied up). */
static void send_room(pool src[2], uint64_t room, uint64_t room_key, const char *addr, uint32_t chunks, int ring_on_device) {
    kvstage_engine *prefill[2];
    kvstage_session *session[2];
    kvstage_engine_stats st;
    unsigned long long sent = 0, htod_before = fake_htod_bytes ? *fake_htod_bytes : 0;
    unsigned long long dtoh_before = fake_dtoh_bytes ? *fake_dtoh_bytes : 0;
    int r, c;
    for (r = 0; r < 2; r++) {
        char id[32];
        prefill[r] = engine_on(&src[r], KVSTAGE_INTEGRITY_OFF,
                               soft_rdma ? KVSTAGE_TRANSPORT_RDMA : by_tcp ? KVSTAGE_TRANSPORT_TCP : KVSTAGE_TRANSPORT_AUTO);
        snprintf(id, sizeof id, "gpu-p%d", r);
        CHECK_OK(kvstage_session_connect(prefill[r], addr, id, 5000, &session[r]));
    }
    REQUIRE(*kv_failures() == 0);
    for (c = 0; c < (int)chunks; c++) {
        for (r = 0; r < 2; r++) {
            kvstage_transfer_desc d;
            REQUIRE(kvstage_transfer_desc_init(&d, sizeof d) == KVSTAGE_OK);
            d.room = room;
            d.room_key = room_key;
            d.chunk_index = (uint32_t)c;
            d.src_pages = SRC_PAGES + c * (CHUNK / PAGE);
            d.num_pages = CHUNK / PAGE;
            d.timeout_ms = 10000;
            if (c + 1 < (int)chunks)
                CHECK_OK(kvstage_transfer(session[r], &d));
            else
                send_layerwise(session[r], &d);
        }
    }
    for (r = 0; r < 2; r++) {
        char describe[1024];
        st = stats_of(prefill[r]);
        CHECK_INT(st.shm_sessions, soft_rdma || by_tcp ? 0 : 1);
        CHECK_INT(st.rdma_sessions, soft_rdma ? 1 : 0);
        CHECK_INT(st.shm_downgrades, 0);
        /* Direct mode: every chunk of the rank copied into the decode pool (none through the ring). */
        CHECK_INT(st.shm_direct_sessions, direct_mode ? 1 : 0);
        CHECK_INT(st.shm_direct_chunks, direct_mode ? chunks : 0);
        sent += st.bytes_sent;
        kv_engine_transport(prefill[r], describe, sizeof describe);
        printf("prefill %d: %s\n", r, describe);
        /* GPUDirect was not given up for host staging. */
        CHECK(strstr(describe, "staging GPU data in host memory") == NULL);
        CHECK_INT(st.rdma_host_staging_sessions, 0);
    }
    if (fake_htod_bytes != NULL && ring_on_device) {
        /* Only the copy plans' tables go up; a staged write (or TCP's bounce on the receiver,
         * which must land every byte) would copy every byte sent. */
        const unsigned long long up = *fake_htod_bytes - htod_before;
        printf("host->device bytes while sending %llu: %llu\n", sent, up);
        CHECK(sent > 0 && (by_tcp ? up >= sent : up < sent / 4));
    }
    if (fake_dtoh_bytes != NULL && ring_on_device && device_integrity == KVSTAGE_INTEGRITY_OFF) {
        /* GPUDirect both ways: gathered into device staging, read by the NIC, written into the
         * device ring; host staging would copy every byte down first. */
        const unsigned long long down = *fake_dtoh_bytes - dtoh_before;
        printf("device->host bytes while sending %llu: %llu\n", sent, down);
        CHECK(direct_mode ? down == 0 : down < sent / 4);
    }
    for (r = 0; r < 2; r++) {
        kvstage_session_free(session[r]);
        kvstage_engine_free(prefill[r]);
    }
}

/* Reads the decode pool back and compares it with the reference reshard of the prefill mirrors:
 * decode heads [2r, 2r+2) of page DST_PAGES[i] come from prefill rank r's page SRC_PAGES[i];
 * every other byte keeps its initial value. */
static void verify(pool src[2], pool *dst) {
    size_t b, pg, t;
    int r;
    uint8_t *got = (uint8_t *)malloc(2 * LAYERS * dst->buffer);
    REQUIRE(got != NULL);
    for (b = 0; b < 2 * LAYERS; b++)
        for (pg = 0; pg < NPAGES; pg++)
            for (t = 0; t < PAGE; t++)
                for (r = 0; r < 2; r++) {
                    const uint8_t *from = src[r].host + b * src[r].buffer + ((size_t)SRC_PAGES[pg] * PAGE + t) * src[r].slot;
                    uint8_t *to = dst->host + b * dst->buffer + ((size_t)DST_PAGES[pg] * PAGE + t) * dst->slot + (size_t)r * src[r].slot;
                    memcpy(to, from, src[r].slot);
                }
    REQUIRE(cu.dtoh(got, dst->dev, 2 * LAYERS * dst->buffer) == 0);
    for (b = 0; b < 2 * LAYERS * dst->buffer; b++)
        if (got[b] != dst->host[b]) {
            KV_FAIL_AT(__FILE__, __LINE__, "decode pool byte %lu (buffer %lu, token slot %lu) = %u, expected %u",
                       (unsigned long)b, (unsigned long)(b / dst->buffer), (unsigned long)(b % dst->buffer / dst->slot),
                       got[b], dst->host[b]);
            break;
        }
    printf("decode pool verified: %lu bytes\n", (unsigned long)(2 * LAYERS * dst->buffer));
    free(got);
}

/* The decode side up to a listening engine with its room open (the opening's key in
 * `*room_key`). */
static kvstage_engine *open_decode(pool *dst, pool *src0, const char *ring, int fake_driver, unsigned long long *caller_ring,
                                   char *addr, size_t addr_len, uint32_t *chunks, uint64_t *room_key) {
    const int device_ring_mode = strcmp(ring, "host") != 0;
    kvstage_engine *decode = engine_with(dst, device_ring_mode ? device_integrity : KVSTAGE_INTEGRITY_OFF);
    REQUIRE(*kv_failures() == 0);
    if (!device_ring_mode) {
        CHECK_OK(kv_staging_register(decode, NULL, 1 << 20));
    } else {
        kvstage_staging_memory m;
        const int engine_owned = strcmp(ring, "caller-device") != 0;
        REQUIRE(cu.alloc(caller_ring, 1 << 20) == 0);
        check_refusals(dst, src0, (void *)(uintptr_t)*caller_ring, fake_driver);
        m = device_ring(engine_owned ? NULL : (void *)(uintptr_t)*caller_ring, engine_owned ? 0 : -1, 1 << 20);
        CHECK_OK(kvstage_staging_register(decode, &m));
    }
    printf("staging ring: %s\n", ring);
    CHECK_OK(kv_room_open(decode, ROOM, DST_PAGES, NPAGES, CHUNK, NULL, chunks, room_key));
    CHECK_INT(*chunks, NPAGES * PAGE / CHUNK);
    CHECK_OK(kvstage_engine_listen_address(decode, addr, addr_len, NULL));
    return decode;
}

/* The decode side after room `room` (its opening `room_key`): complete, verified, ring empty;
 * `sessions` same-host (or RDMA) sessions accepted so far. */
static void finish_decode(kvstage_engine *decode, uint64_t room, uint64_t room_key, pool src[2], pool *dst, uint64_t sessions) {
    kvstage_engine_stats st;
    CHECK_OK(kvstage_room_wait(decode, room, room_key, 10000));
    verify(src, dst);
    CHECK_OK(kvstage_room_release(decode, room, room_key));
    st = stats_of(decode);
    CHECK_INT(st.ring_live_allocations, 0);
    CHECK_INT(st.shm_sessions, soft_rdma || by_tcp ? 0 : sessions);
    CHECK_INT(st.rdma_sessions, soft_rdma ? sessions : 0);
    CHECK_INT(st.shm_direct_sessions, direct_mode ? sessions : 0);
    /* Every region of every room so far copied straight into the pool (a killed writer's region
     * of a failed room may count or not). */
    if (direct_mode) CHECK(st.shm_direct_chunks >= 2 * (NPAGES * PAGE / CHUNK));
    /* A device that does not order a NIC's writes for its kernels (the fake, when told): every
     * scatter of the RDMA-written ring (at least one a chunk) and every read-back flushes first.
     * One that does (owner, as an H200): never. */
    if (fake_rdma_flushes != NULL && soft_rdma != NULL) {
        const uint64_t chunks = NPAGES * PAGE / CHUNK;
        printf("GPUDirect RDMA flushes: %llu\n", *fake_rdma_flushes);
        if (getenv("KVSTAGE_FAKE_CUDA_RDMA_UNORDERED") != NULL)
            CHECK(*fake_rdma_flushes >= chunks * (device_integrity == KVSTAGE_INTEGRITY_OFF ? 1 : 2));
        else
            CHECK_INT(*fake_rdma_flushes, 0);
    }
}

/* Reads exactly `n` bytes from a pipe (the peer process exiting early is a failure). */
static void read_pipe(int fd, void *buf, size_t n, const char *what) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, (char *)buf + got, n - got);
        if (r <= 0) {
            KV_FAIL_AT(__FILE__, __LINE__, "pipe closed while waiting for %s", what);
            exit(kv_finish("gpu_transfer device-ipc-kill"));
        }
        got += (size_t)r;
    }
}

/* "device-ipc-kill", a prefill process (`victim` or not): waits for the decode address on `in`
 * (empty: the decode skipped) and the key of the room it sends, opens CUDA, and sends ROOM into the decode's device ring through
 * CUDA IPC. The victim's pools hold other bytes than the reference; it sends chunk 0, starts the
 * last chunk layer-wise, marks its first layer (the gather writes that piece into the granted
 * range), says so on `out` and waits to be killed. The other one sends ROOM + 1 whole. */
static int ipc_kill_prefill(int in, int out, int victim) {
    void *lib = NULL;
    pool src[2];
    char addr[64];
    kvstage_engine *prefill[2];
    kvstage_session *session[2];
    kvstage_op *op[2];
    uint64_t room_key = 0;
    int r, started;
    alarm(100); /* never outlives a decode process that failed early (the ctest's limit is 120 s) */
    read_pipe(in, addr, sizeof addr, "the decode address");
    if (addr[0] == 0) return 77;
    read_pipe(in, &room_key, sizeof room_key, "the room key");
    started = start_cuda(&lib);
    if (started != 0) return started;
    find_fake_counters(lib);
    for (r = 0; r < 2; r++) pool_init(&src[r], (uint32_t)r, 2, 17u * (unsigned)r + 1 + (victim ? 1000u : 0u));
    if (!victim) {
        send_room(src, ROOM + 1, room_key, addr, NPAGES * PAGE / CHUNK, 1);
        return finish("gpu_transfer device-ipc-kill (prefill process)");
    }
    for (r = 0; r < 2; r++) {
        kvstage_transfer_desc d;
        prefill[r] = engine_with(&src[r], KVSTAGE_INTEGRITY_OFF);
        CHECK_OK(kvstage_session_connect(prefill[r], addr, r ? "gpu-victim1" : "gpu-victim0", 5000, &session[r]));
        REQUIRE(kvstage_transfer_desc_init(&d, sizeof d) == KVSTAGE_OK);
        d.room = ROOM;
        d.room_key = room_key;
        d.src_pages = SRC_PAGES;
        d.num_pages = CHUNK / PAGE;
        d.timeout_ms = 30000;
        CHECK_OK(kvstage_transfer(session[r], &d));
        d.chunk_index = 1;
        d.src_pages = SRC_PAGES + CHUNK / PAGE;
        CHECK_INT(kvstage_transfer_layerwise_async(session[r], &d, &op[r]), KVSTAGE_PENDING);
        CHECK_OK(kvstage_op_layers_ready(op[r], 0, 1, NULL, NULL));
    }
    CHECK_INT(stats_of(prefill[0]).shm_sessions, 1);
    REQUIRE(*kv_failures() == 0);
    REQUIRE(write(out, "x", 1) == 1);
    for (;;) pause(); /* killed by the decode process */
}

/* "device-ipc-kill", the decode process: a prefill process writing into the device ring through
 * CUDA IPC is SIGKILLed in the middle of a chunk. The room fails (not by its timeout), the ring
 * returns to empty, and the next room, from another process, lands exact (none of the dead
 * writer's bytes). Both prefill processes are forked before CUDA starts here. */
static int ipc_kill(void) {
    int to_victim[2], to_heir[2], from_victim[2], status = 0, started, rc;
    pid_t victim, heir;
    void *lib = NULL;
    pool src[2], dst;
    kvstage_engine *decode;
    kvstage_engine_stats st;
    unsigned long long ring = 0;
    char addr[64] = {0}, x = 0, why[512];
    uint32_t chunks = 0;
    uint64_t room_key = 0, next_key = 0;
    int r, waited;
    REQUIRE(pipe(to_victim) == 0 && pipe(to_heir) == 0 && pipe(from_victim) == 0);
    fflush(NULL);
    victim = fork();
    REQUIRE(victim >= 0);
    if (victim == 0) return ipc_kill_prefill(to_victim[0], from_victim[1], 1);
    heir = fork();
    REQUIRE(heir >= 0);
    if (heir == 0) return ipc_kill_prefill(to_heir[0], -1, 0);
    close(from_victim[1]);
    started = start_cuda(&lib);
    if (started != 0) {
        REQUIRE(write(to_victim[1], addr, sizeof addr) == (ssize_t)sizeof addr);
        REQUIRE(write(to_heir[1], addr, sizeof addr) == (ssize_t)sizeof addr);
        waitpid(victim, NULL, 0);
        waitpid(heir, NULL, 0);
        return started;
    }
    find_fake_counters(lib);
    for (r = 0; r < 2; r++) pool_init(&src[r], (uint32_t)r, 2, 17u * (unsigned)r + 1);
    pool_init(&dst, 0, 1, 99);
    decode = open_decode(&dst, &src[0], "device", dlsym(lib, "kvstage_fake_libcuda") != NULL, &ring, addr, sizeof addr, &chunks,
                         &room_key);
    REQUIRE(write(to_victim[1], addr, sizeof addr) == (ssize_t)sizeof addr);
    REQUIRE(write(to_victim[1], &room_key, sizeof room_key) == (ssize_t)sizeof room_key);
    read_pipe(from_victim[0], &x, 1, "the victim's first layer");
    st = stats_of(decode);
    printf("victim marked its first layer of chunk 1: %llu live ring allocation(s), %llu chunk(s) received\n",
           (unsigned long long)st.ring_live_allocations, (unsigned long long)st.chunks_received);
    sleep_ms(20);
    kill(victim, SIGKILL);
    REQUIRE(waitpid(victim, NULL, 0) == victim);
    rc = kvstage_room_wait(decode, ROOM, room_key, 10000);
    snprintf(why, sizeof why, "%s", kvstage_error_last()->message); /* valid until the next call */
    CHECK(rc < 0 && rc != KVSTAGE_E_TIMEOUT);
    printf("room %d after its writer was killed: %s (%s)\n", ROOM, kvstage_status_name(rc), why);
    for (waited = 0; stats_of(decode).ring_live_allocations != 0 && waited < 5000; waited += 10) sleep_ms(10);
    CHECK_INT(stats_of(decode).ring_live_allocations, 0);
    CHECK_OK(kvstage_room_release(decode, ROOM, room_key));
    CHECK_OK(kv_room_open(decode, ROOM + 1, DST_PAGES, NPAGES, CHUNK, NULL, &chunks, &next_key));
    REQUIRE(write(to_heir[1], addr, sizeof addr) == (ssize_t)sizeof addr);
    REQUIRE(write(to_heir[1], &next_key, sizeof next_key) == (ssize_t)sizeof next_key);
    finish_decode(decode, ROOM + 1, next_key, src, &dst, 4);
    REQUIRE(waitpid(heir, &status, 0) == heir);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    kvstage_engine_free(decode);
    for (r = 0; r < 2; r++) {
        cu.free_(src[r].dev);
        free(src[r].host);
    }
    cu.free_(dst.dev);
    cu.free_(ring);
    free(dst.host);
    return finish("gpu_transfer device-ipc-kill (decode process)");
}

int main(int argc, char **argv) {
    void *lib = NULL;
    pool src[2], dst;
    kvstage_engine *decode;
    char addr[64];
    uint32_t chunks = 0;
    uint64_t room_key = 0;
    int r, started;
    const char *ring = argc > 1 ? argv[1] : "host";
    const int two_processes = strcmp(ring, "device-ipc") == 0 || strcmp(ring, "device-direct") == 0 || strcmp(ring, "device-direct-unchecked") == 0;
    const int rdma = strcmp(ring, "device-rdma") == 0 || strcmp(ring, "device-rdma-integrity") == 0;
    by_tcp = strcmp(ring, "device-tcp") == 0;
    int fake_driver, to_prefill[2], to_decode[2];
    pid_t decode_pid = 0;
    unsigned long long caller_ring = 0;

    direct_mode = strncmp(ring, "device-direct", strlen("device-direct")) == 0;
    if (strcmp(ring, "device-ipc-kill") == 0 || strcmp(ring, "device-direct-kill") == 0) return ipc_kill();
    if (strcmp(ring, "device-direct-unchecked") == 0) device_integrity = KVSTAGE_INTEGRITY_OFF;
    REQUIRE(strcmp(ring, "host") == 0 || strcmp(ring, "device") == 0 || strcmp(ring, "caller-device") == 0 || two_processes || rdma || by_tcp);
    if (by_tcp) ring = "device";
    /* Two processes: fork before CUDA starts (a CUDA context does not survive fork). The decode
     * process sends its address (or "" when it skips) and the room's key, and waits until the prefill side is done
     * with its ring before freeing it. */
    if (two_processes) {
        REQUIRE(pipe(to_prefill) == 0 && pipe(to_decode) == 0);
        fflush(NULL);
        decode_pid = fork();
        REQUIRE(decode_pid >= 0);
    }
    started = start_cuda(&lib);
    if (started != 0) {
        if (two_processes && decode_pid == 0) REQUIRE(write(to_prefill[1], "", 1) == 1);
        if (two_processes && decode_pid > 0) waitpid(decode_pid, NULL, 0);
        return started;
    }
    fake_driver = dlsym(lib, "kvstage_fake_libcuda") != NULL;
    find_fake_counters(lib);
    if (rdma) {
        /* The soft fabric exists in test builds only. */
        kvstage_engine *probe = NULL;
        kvstage_engine_options o;
        REQUIRE(kvstage_engine_options_init(&o, sizeof o) == KVSTAGE_OK);
        o.transport = KVSTAGE_TRANSPORT_RDMA;
        o.rdma_devices = "softib0";
        if (kvstage_engine_new(&o, &probe) != KVSTAGE_OK) return skip("no soft RDMA fabric (a build without the testing feature)");
        kvstage_engine_free(probe);
        soft_rdma = "softib0";
        if (strcmp(ring, "device-rdma") == 0) device_integrity = KVSTAGE_INTEGRITY_OFF;
        ring = "device";
    }
    for (r = 0; r < 2; r++) pool_init(&src[r], (uint32_t)r, 2, 17u * (unsigned)r + 1);
    pool_init(&dst, 0, 1, 99);

    if (!two_processes) {
        decode = open_decode(&dst, &src[0], ring, fake_driver, &caller_ring, addr, sizeof addr, &chunks, &room_key);
        send_room(src, ROOM, room_key, addr, chunks, strcmp(ring, "host") != 0);
        finish_decode(decode, ROOM, room_key, src, &dst, 2);
        kvstage_engine_free(decode);
    } else if (decode_pid == 0) {
        char done;
        decode = open_decode(&dst, &src[0], "device", fake_driver, &caller_ring, addr, sizeof addr, &chunks, &room_key);
        REQUIRE(write(to_prefill[1], addr, strlen(addr) + 1) == (ssize_t)(strlen(addr) + 1));
        REQUIRE(write(to_prefill[1], &room_key, sizeof room_key) == (ssize_t)sizeof room_key);
        finish_decode(decode, ROOM, room_key, src, &dst, 2);
        REQUIRE(read(to_decode[0], &done, 1) == 1);
        kvstage_engine_free(decode);
    } else {
        size_t got = 0;
        int status = 0;
        while (got < sizeof addr) {
            ssize_t n = read(to_prefill[0], addr + got, 1);
            REQUIRE(n == 1);
            if (addr[got++] == 0) break;
        }
        REQUIRE(got > 1); /* the decode process did not skip: CUDA worked there too */
        REQUIRE(read(to_prefill[0], &room_key, sizeof room_key) == (ssize_t)sizeof room_key);
        REQUIRE(room_key != 0);
        send_room(src, ROOM, room_key, addr, NPAGES * PAGE / CHUNK, 1);
        REQUIRE(write(to_decode[1], "", 1) == 1);
        REQUIRE(waitpid(decode_pid, &status, 0) == decode_pid);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        printf("decode process exited with %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    }
    for (r = 0; r < 2; r++) {
        cu.free_(src[r].dev);
        free(src[r].host);
    }
    cu.free_(dst.dev);
    if (caller_ring) cu.free_(caller_ring);
    free(dst.host);
    return finish(two_processes ? (decode_pid == 0 ? "gpu_transfer (decode process)" : "gpu_transfer (prefill process)") : "gpu_transfer");
}
