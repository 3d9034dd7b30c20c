/* What a plain loopback socket pair pays per byte to move a 64 MiB buffer, and what
 * SO_RCVLOWAT, vmsplice and huge pages change about it (docs/benchmarks.md, "Issue 22:
 * session 18"; the engine's bulk reads took SO_RCVLOWAT from it: wire::BulkLowat).
 *
 *   gcc -O2 -o /tmp/socket_lowat benchmarks/socket_lowat.c
 *   /tmp/socket_lowat MODE GB        MODE: plain | lowat:BYTES | vmsplice | hugepage
 *
 * The sender sends 1 MiB at a time, cycling over its 64 MiB buffer (filled with real bytes);
 * the receiver recv()s 1 MiB at a time (MSG_WAITALL) into its own 64 MiB buffer. lowat:BYTES
 * sets the receiver's SO_RCVLOWAT (a fixed mark is safe here only because the stream never
 * pauses); vmsplice sends through a pipe (vmsplice + splice, no copy on the sender); hugepage
 * madvise()s both buffers MADV_HUGEPAGE before touching them. Prints the CPU seconds per GB
 * of each side (getrusage of the moving loop only) and the rate. Alternate the modes a few
 * times: the host's noise is as large as some of the differences. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define SIZE (64ul << 20)
#define CHUNK (1ul << 20)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static double cpu(void) {
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return r.ru_utime.tv_sec + r.ru_utime.tv_usec / 1e6 + r.ru_stime.tv_sec + r.ru_stime.tv_usec / 1e6;
}

static char *buffer(int huge) {
    char *b = aligned_alloc(2ul << 20, SIZE);
    if (!b) { perror("alloc"); exit(1); }
    if (huge) madvise(b, SIZE, MADV_HUGEPAGE);
    for (size_t i = 0; i < SIZE; i++) b[i] = (char)(i * 7);
    return b;
}

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: %s plain|lowat:BYTES|vmsplice|hugepage GB\n", argv[0]); return 2; }
    const char *mode = argv[1];
    int lowat = strncmp(mode, "lowat:", 6) == 0 ? atoi(mode + 6) : 0;
    int splice_send = strcmp(mode, "vmsplice") == 0, huge = strcmp(mode, "hugepage") == 0;
    size_t total = (size_t)atol(argv[2]) << 30;

    int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(ls, (void *)&a, sizeof a) || listen(ls, 1) || getsockname(ls, (void *)&a, &al)) { perror("listen"); return 1; }
    pid_t pid = fork();
    if (pid == 0) {
        int s = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(s, (void *)&a, sizeof a)) { perror("connect"); _exit(1); }
        if (lowat) setsockopt(s, SOL_SOCKET, SO_RCVLOWAT, &lowat, sizeof lowat);
        char *d = buffer(huge);
        size_t got = 0, off = 0;
        double c0 = cpu();
        while (got < total) {
            ssize_t n = recv(s, d + off, CHUNK, MSG_WAITALL);
            if (n <= 0) break;
            got += n;
            off = (off + CHUNK) % SIZE;
        }
        printf("recv %.3f CPU s/GB\n", (cpu() - c0) / (got / 1e9));
        fflush(stdout);
        _exit(0);
    }
    int s = accept(ls, 0, 0), pp[2];
    char *b = buffer(huge);
    if (pipe(pp) || fcntl(pp[1], F_SETPIPE_SZ, (int)CHUNK) < 0) { perror("pipe"); return 1; }
    double t0 = now(), c0 = cpu();
    size_t sent = 0, off = 0;
    while (sent < total) {
        if (!splice_send) {
            for (size_t k = 0; k < CHUNK;) {
                ssize_t n = send(s, b + off + k, CHUNK - k, 0);
                if (n <= 0) { perror("send"); return 1; }
                k += n;
            }
        } else {
            struct iovec v = {b + off, CHUNK};
            while (v.iov_len) {
                ssize_t n = vmsplice(pp[1], &v, 1, 0);
                if (n < 0) { perror("vmsplice"); return 1; }
                v.iov_base = (char *)v.iov_base + n;
                v.iov_len -= n;
                for (ssize_t m = n; m;) {
                    ssize_t r = splice(pp[0], 0, s, 0, m, SPLICE_F_MORE);
                    if (r <= 0) { perror("splice"); return 1; }
                    m -= r;
                }
            }
        }
        sent += CHUNK;
        off = (off + CHUNK) % SIZE;
    }
    double sc = cpu() - c0;
    shutdown(s, SHUT_WR);
    fflush(stdout);
    int st;
    waitpid(pid, &st, 0);
    printf("%s: send %.3f CPU s/GB, %.2f Gbit/s\n", mode, sc / (sent / 1e9), sent * 8 / (now() - t0) / 1e9);
    return 0;
}
