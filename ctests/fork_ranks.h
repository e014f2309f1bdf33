/* One process per rank (fork): the children's bookkeeping shared by the multi-process ctests. */
#ifndef KVSTAGE_FORK_RANKS_H
#define KVSTAGE_FORK_RANKS_H

#include <signal.h>
#include <stdio.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>

#include "kvstage_check.h"

static inline double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

typedef struct child {
    pid_t pid;
    char name[48];
} child;

/* Waits for the children until `deadline` (now_ms()), then kills the rest; a failure, labelled
 * `label`, for each child that did not exit with 0 or was still running after `budget_ms`. */
static inline void reap(const char *label, child *kids, int n, double deadline, int budget_ms) {
    int left = n;
    while (left > 0 && now_ms() < deadline) {
        for (int i = 0; i < n; ++i) {
            int status = 0;
            if (kids[i].pid <= 0 || waitpid(kids[i].pid, &status, WNOHANG) != kids[i].pid) continue;
            if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
                KV_FAIL_AT(__FILE__, __LINE__, "[%s] %s: %s %d", label, kids[i].name, WIFEXITED(status) ? "exit code" : "signal",
                           WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
            kids[i].pid = 0;
            --left;
        }
        struct timespec ten_ms = {0, 10 * 1000 * 1000};
        nanosleep(&ten_ms, NULL);
    }
    for (int i = 0; i < n; ++i) {
        if (kids[i].pid <= 0) continue;
        kill(kids[i].pid, SIGKILL);
        waitpid(kids[i].pid, NULL, 0);
        KV_FAIL_AT(__FILE__, __LINE__, "[%s] %s: still running after %d ms, killed", label, kids[i].name, budget_ms);
        kids[i].pid = 0;
    }
}

#endif
