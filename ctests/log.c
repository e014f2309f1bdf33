/* Log records from C: the callback gets one record per event at the right level, with the cause
 * in the message and the session id in its own field; without a callback records go to stderr
 * (default level warn), and KVSTAGE_LOG=off silences them.
 *
 * Two scenarios, each expected to produce exactly one record at warn or above:
 *  - downgrade: a prefill engine with transport AUTO connects to a decode engine with transport
 *    TCP: the session runs on TCP (no local RDMA device, or the peer does not serve RDMA);
 *  - expiry: a decode room with room_timeout_ms 300 that nobody writes fails with TIMEOUT.
 *
 * The stderr checks run the scenarios again in a child process (this executable with the
 * argument "child", exec'ed with its stderr on a pipe and KVSTAGE_LOG set or unset), since the
 * library reads KVSTAGE_LOG once per process. */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "host_pool.h"

enum { LAYERS = 2, HEADS = 2, HEAD_DIM = 8, DTYPE = 2, PAGE = 4, CAPACITY = 8, ROOM = 7, MAX_RECORDS = 256 };

static const char *const SESSION = "log-downgrade";

static void pool_init(host_pool *p) {
    kvstage_kv_layout shape = host_pool_shape(LAYERS, HEADS, HEAD_DIM, DTYPE, PAGE, CAPACITY, 0, 1);
    host_pool_init(p, &shape);
}

static kvstage_engine *engine(int transport, uint64_t room_timeout_ms, host_pool *p) {
    kvstage_engine_options o;
    REQUIRE(kvstage_engine_options_init(&o, sizeof o) == KVSTAGE_OK);
    o.transport = transport;
    if (room_timeout_ms) o.room_timeout_ms = room_timeout_ms;
    return host_pool_engine(&o, p, 0);
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

/* A session from an AUTO engine to a TCP engine, opened and closed. */
static void scenario_downgrade(void) {
    host_pool dp, pp;
    pool_init(&dp);
    pool_init(&pp);
    kvstage_engine *decode = engine(KVSTAGE_TRANSPORT_TCP, 0, &dp);
    kvstage_engine *prefill = engine(KVSTAGE_TRANSPORT_AUTO, 0, &pp);
    char addr[64] = {0};
    REQUIRE(kvstage_engine_listen_address(decode, addr, sizeof addr, NULL) == KVSTAGE_OK);
    kvstage_session *s = NULL;
    CHECK_OK(kvstage_session_connect(prefill, addr, SESSION, 10000, &s));
    kvstage_session_free(s);
    kvstage_engine_free(prefill);
    kvstage_engine_free(decode);
    host_pool_free(&dp);
    host_pool_free(&pp);
}

/* A room nobody writes, failed by its deadline. `wait_until` (may be NULL) is polled after the
 * room failed until it returns nonzero (at most 5 s): the record is logged on the engine's thread. */
static void scenario_expiry(int (*wait_until)(void)) {
    static const uint32_t pages[4] = {0, 1, 2, 3};
    host_pool dp;
    pool_init(&dp);
    kvstage_engine *decode = engine(KVSTAGE_TRANSPORT_TCP, 300, &dp);
    uint64_t key = 0; /* nobody sends: the key goes nowhere */
    CHECK_OK(kv_room_open(decode, ROOM, pages, 4, 0, NULL, NULL, &key));
    CHECK_INT(kvstage_room_wait(decode, ROOM, key, 10000), KVSTAGE_E_TIMEOUT);
    CHECK_CONTAINS(kvstage_error_last()->message, "deadline passed");
    for (int i = 0; wait_until != NULL && i < 500 && !wait_until(); ++i) sleep_ms(10);
    CHECK_OK(kvstage_room_release(decode, ROOM, key));
    kvstage_engine_free(decode);
    host_pool_free(&dp);
}

/* --- the callback ------------------------------------------------------------------------------ */

typedef struct record {
    int level;
    char target[128], session[128], message[2048];
} record;

static struct {
    pthread_mutex_t lock;
    int count, bad;
    record records[MAX_RECORDS];
} seen = {PTHREAD_MUTEX_INITIALIZER, 0, 0, {{0, {0}, {0}, {0}}}};

static int user_token;

static void on_log(void *user_data, const kvstage_log_record *r) {
    pthread_mutex_lock(&seen.lock);
    if (user_data != &user_token || r == NULL || r->struct_size != sizeof *r || r->level < KVSTAGE_LOG_ERROR ||
        r->level > KVSTAGE_LOG_TRACE || r->target == NULL || r->session == NULL || r->message == NULL) {
        seen.bad++;
    } else if (seen.count < MAX_RECORDS) {
        record *out = &seen.records[seen.count++];
        out->level = r->level;
        snprintf(out->target, sizeof out->target, "%s", r->target);
        snprintf(out->session, sizeof out->session, "%s", r->session);
        snprintf(out->message, sizeof out->message, "%s", r->message);
    }
    pthread_mutex_unlock(&seen.lock);
}

static void reset(void) {
    pthread_mutex_lock(&seen.lock);
    seen.count = 0;
    pthread_mutex_unlock(&seen.lock);
}

/* Records at warn or above so far; the last one into *last. */
static int serious(record *last) {
    int n = 0;
    pthread_mutex_lock(&seen.lock);
    for (int i = 0; i < seen.count; ++i)
        if (seen.records[i].level <= KVSTAGE_LOG_WARN) {
            if (last != NULL) *last = seen.records[i];
            n++;
        }
    pthread_mutex_unlock(&seen.lock);
    return n;
}

static int one_serious(void) { return serious(NULL) >= 1; }

static void print_records(const char *what) {
    pthread_mutex_lock(&seen.lock);
    printf("%s: %d record(s)\n", what, seen.count);
    for (int i = 0; i < seen.count; ++i)
        printf("  level %d %s [%s] %s\n", seen.records[i].level, seen.records[i].target, seen.records[i].session,
               seen.records[i].message);
    pthread_mutex_unlock(&seen.lock);
}

static int callback_checks(void) {
    record r;
    memset(&r, 0, sizeof r);

    CHECK_INT(kvstage_log_set_callback(on_log, &user_token, 6), KVSTAGE_E_INVALID_ARG);
    CHECK_CONTAINS(kvstage_error_last()->message, "max_level");
    CHECK_INT(kvstage_log_set_callback(on_log, &user_token, -1), KVSTAGE_E_INVALID_ARG);

    /* Downgrade, at level INFO: the session's lifecycle shows too, with its transport. */
    CHECK_OK(kvstage_log_set_callback(on_log, &user_token, KVSTAGE_LOG_INFO));
    scenario_downgrade();
    print_records("downgrade");
    /* Two: the same-host path refused by the decode engine (its transport is TCP), then RDMA. */
    CHECK_INT(serious(&r), 2);
    CHECK_INT(r.level, KVSTAGE_LOG_WARN);
    CHECK_STR(r.session, SESSION);
    CHECK_STR(r.target, "kvstage::transport::rdma");
    CHECK_CONTAINS(r.message, "downgraded from rdma to tcp");
    /* The cause: this host has no RDMA device, or the decode engine does not serve RDMA. */
    CHECK(strstr(r.message, "no local RDMA device") != NULL || strstr(r.message, "does not serve RDMA") != NULL);
    CHECK(strstr(r.message, SESSION) == NULL); /* in its own field, not repeated */
    int opened = 0, accepted = 0;
    pthread_mutex_lock(&seen.lock);
    for (int i = 0; i < seen.count; ++i) {
        const record *x = &seen.records[i];
        CHECK(x->level <= KVSTAGE_LOG_INFO); /* nothing above the callback's level */
        if (x->level == KVSTAGE_LOG_INFO && strcmp(x->session, SESSION) == 0 && strstr(x->message, "session opened to ") &&
            strstr(x->message, "over tcp"))
            opened++;
        if (x->level == KVSTAGE_LOG_INFO && strcmp(x->session, SESSION) == 0 && strstr(x->message, "accepted over tcp")) accepted++;
    }
    pthread_mutex_unlock(&seen.lock);
    CHECK_INT(opened, 1);
    CHECK_INT(accepted, 1);

    /* Expiry, at level WARN: exactly one record, nothing else. */
    reset();
    CHECK_OK(kvstage_log_set_callback(on_log, &user_token, KVSTAGE_LOG_WARN));
    scenario_expiry(one_serious);
    sleep_ms(300); /* a second record (there must be none) would show by now */
    print_records("expiry");
    pthread_mutex_lock(&seen.lock);
    CHECK_INT(seen.count, 1);
    pthread_mutex_unlock(&seen.lock);
    CHECK_INT(serious(&r), 1);
    CHECK_INT(r.level, KVSTAGE_LOG_WARN);
    CHECK_STR(r.target, "kvstage::session::receiver");
    CHECK_CONTAINS(r.message, "room 7 failed (KVSTAGE_E_TIMEOUT)");
    CHECK_CONTAINS(r.message, "the room's deadline passed (0 of 1 chunks done)");

    /* OFF: installed but silent. */
    reset();
    CHECK_OK(kvstage_log_set_callback(on_log, &user_token, KVSTAGE_LOG_OFF));
    scenario_expiry(NULL);
    sleep_ms(300);
    pthread_mutex_lock(&seen.lock);
    CHECK_INT(seen.count, 0);
    pthread_mutex_unlock(&seen.lock);

    /* NULL: back to stderr (max_level ignored). After it returns, the callback is never called. */
    CHECK_OK(kvstage_log_set_callback(NULL, NULL, 12345));
    pthread_mutex_lock(&seen.lock);
    CHECK_INT(seen.bad, 0);
    pthread_mutex_unlock(&seen.lock);
    return 0;
}

/* --- stderr, in a child process ---------------------------------------------------------------- */

/* Runs this executable as "child" with KVSTAGE_LOG = `level` (NULL: unset); its stderr into `out`. */
static int run_child(const char *self, const char *level, char *out, size_t capacity) {
    int pipefd[2];
    REQUIRE(pipe(pipefd) == 0);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        close(pipefd[0]);
        if (dup2(pipefd[1], 2) < 0) _exit(126);
        close(pipefd[1]);
        if (level != NULL) setenv("KVSTAGE_LOG", level, 1);
        else unsetenv("KVSTAGE_LOG");
        execl(self, self, "child", (char *)NULL);
        _exit(127);
    }
    close(pipefd[1]);
    size_t used = 0;
    for (;;) {
        char buf[4096];
        ssize_t n = read(pipefd[0], buf, sizeof buf);
        if (n < 0) continue; /* EINTR */
        if (n == 0) break;
        size_t take = (size_t)n < capacity - 1 - used ? (size_t)n : capacity - 1 - used;
        memcpy(out + used, buf, take);
        used += take;
    }
    out[used] = '\0';
    close(pipefd[0]);
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    printf("child with KVSTAGE_LOG=%s: exit %d, stderr:\n%s---\n", level ? level : "(unset)",
           WIFEXITED(status) ? WEXITSTATUS(status) : -1, out);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static int count_lines(const char *text, const char *needle) {
    int n = 0;
    for (const char *line = text; *line;) {
        const char *end = strchr(line, '\n');
        size_t len = end ? (size_t)(end - line) : strlen(line);
        char buf[4096];
        snprintf(buf, sizeof buf, "%.*s", (int)(len < sizeof buf ? len : sizeof buf - 1), line);
        if (needle == NULL || strstr(buf, needle) != NULL) n++;
        line += len + (end != NULL);
    }
    return n;
}

static void stderr_checks(const char *self) {
    static char out[1 << 16];

    /* Default level (warn): the three records, one line each: time, level, target, session, message. */
    CHECK_INT(run_child(self, NULL, out, sizeof out), 0);
    CHECK_INT(count_lines(out, NULL), 3);
    CHECK_INT(count_lines(out, "  WARN kvstage::transport::shm: session log-downgrade: same-host path not used"), 1);
    CHECK_INT(count_lines(out, "  WARN kvstage::transport::rdma: session log-downgrade: downgraded from rdma to tcp"), 1);
    /* The room's line is led by its trace id (derived from its opening: no sender named one). */
    CHECK_INT(count_lines(out, "  WARN kvstage::session::receiver: [7#"), 1);
    CHECK_INT(count_lines(out, "] room 7 failed (KVSTAGE_E_TIMEOUT): "), 1);
    /* 2026-12-03T10:15:42.123Z */
    CHECK(strlen(out) > 24 && out[4] == '-' && out[10] == 'T' && out[19] == '.' && out[23] == 'Z' && out[24] == ' ');

    /* off: nothing at all. */
    CHECK_INT(run_child(self, "off", out, sizeof out), 0);
    CHECK_STR(out, "");

    /* info: the lifecycle too. */
    CHECK_INT(run_child(self, "INFO", out, sizeof out), 0);
    CHECK_INT(count_lines(out, " WARN "), 3);
    CHECK(count_lines(out, "  INFO kvstage::session::sender: session log-downgrade: session opened to ") == 1);

    /* A value that is not a level: one warning about it, then the default. */
    CHECK_INT(run_child(self, "loud", out, sizeof out), 0);
    CHECK_INT(count_lines(out, "KVSTAGE_LOG=\"loud\" is not one of off, error, warn, info, debug, trace"), 1);
    CHECK_INT(count_lines(out, " WARN "), 4);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "child") == 0) {
        /* Only the library writes to stderr here (a failed check writes there too, and fails the
         * parent's checks of it as well as the exit status). */
        scenario_downgrade();
        scenario_expiry(NULL);
        sleep_ms(300);
        if (*kv_failures() != 0) {
            printf("child: %d check(s) failed\n", *kv_failures());
            return 1;
        }
        return 0;
    }
    stderr_checks(argv[0]);
    callback_checks();
    return kv_finish("log");
}
