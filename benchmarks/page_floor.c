/* The floor for KV pages over one loopback TCP connection: what plain sockets pay to move
 * scattered pages, against the same bytes contiguous (benchmarks/page_floor.py runs it).
 *
 *   page_floor PAGE_BYTES LAYOUT SECONDS      LAYOUT: contig | shuffled
 *
 * The bench kv layout: 80 layers of 2 MiB (a request's pages of one layer), each in a pool of
 * twice that; `shuffled` takes half the pool's pages in a random order on each side (other
 * seeds), `contig` the layer's first 2 MiB. The sender writev()s and the receiver readv()s
 * each layer in chunks of at most 1 MiB of pages, as multirail's vectored requests carry
 * them (no header: this is the floor). Prints "ms_per_request GBPS" for the bytes the sender
 * had written when SECONDS ran out (whole requests only). */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define LAYERS 80
#define LAYER (2u << 20)
#define CHUNK (1u << 20)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static unsigned long long rng_state;
static unsigned long long next_rand(void) { /* xorshift64 */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* Every page of every layer as an iovec, in transfer order. */
static struct iovec *pages(char *buf, size_t page, int shuffled, unsigned long long seed, size_t *count) {
    size_t per = LAYER / page, slots = 2 * per;
    struct iovec *v = malloc(sizeof *v * LAYERS * per);
    size_t *ids = malloc(sizeof *ids * slots);
    if (!v || !ids) { perror("malloc"); exit(2); }
    rng_state = seed;
    size_t k = 0;
    for (size_t l = 0; l < LAYERS; l++) {
        char *base = buf + l * 2 * (size_t)LAYER;
        for (size_t i = 0; i < slots; i++) ids[i] = i;
        if (shuffled)
            for (size_t i = slots - 1; i > 0; i--) {
                size_t j = next_rand() % (i + 1), t = ids[i];
                ids[i] = ids[j];
                ids[j] = t;
            }
        for (size_t i = 0; i < per; i++) {
            v[k].iov_base = base + ids[i] * page;
            v[k++].iov_len = page;
        }
    }
    free(ids);
    *count = k;
    return v;
}

/* Move every iovec, each chunk of <= CHUNK bytes with one writev/readv loop. 0, or -1 at EOF. */
static int move_all(int fd, const struct iovec *v, size_t count, int send_side) {
    struct iovec tmp[1024];
    for (size_t i = 0; i < count;) {
        size_t m = 0, bytes = 0;
        while (i + m < count && m < 1024 && bytes + v[i + m].iov_len <= CHUNK) bytes += v[i + m++].iov_len;
        memcpy(tmp, v + i, m * sizeof *tmp);
        struct iovec *p = tmp;
        size_t left = m;
        while (left) {
            ssize_t r = send_side ? writev(fd, p, (int)left) : readv(fd, p, (int)left);
            if (r <= 0) return -1;
            while (r > 0) {
                if ((size_t)r >= p->iov_len) { r -= (ssize_t)p->iov_len; p++; left--; }
                else { p->iov_base = (char *)p->iov_base + r; p->iov_len -= (size_t)r; r = 0; }
            }
        }
        i += m;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s PAGE_BYTES contig|shuffled SECONDS\n", argv[0]);
        return 2;
    }
    size_t page = strtoul(argv[1], NULL, 0);
    int shuffled = strcmp(argv[2], "shuffled") == 0;
    double secs = atof(argv[3]);
    if (page == 0 || LAYER % page || (!shuffled && strcmp(argv[2], "contig"))) {
        fprintf(stderr, "PAGE_BYTES must divide 2 MiB; layout contig or shuffled\n");
        return 2;
    }
    if (!shuffled) page = CHUNK; /* contiguous: two 1 MiB pieces per layer, adjacent */
    size_t pool = 2 * (size_t)LAYERS * LAYER;
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t al = sizeof a;
    if (bind(ls, (void *)&a, sizeof a) || listen(ls, 1) || getsockname(ls, (void *)&a, &al)) { perror("listen"); return 2; }
    pid_t child = fork();
    if (child == 0) {
        int c = accept(ls, NULL, NULL);
        char *buf = malloc(pool);
        if (c < 0 || !buf) _exit(2);
        memset(buf, 1, pool);
        size_t count;
        struct iovec *v = pages(buf, page, shuffled, 0x5eed5eedULL, &count);
        if (write(c, "r", 1) != 1) _exit(2); /* faulted in: ready */
        while (move_all(c, v, count, 0) == 0) {}
        _exit(0);
    }
    int s = socket(AF_INET, SOCK_STREAM, 0);
    char *buf = malloc(pool);
    if (!buf || connect(s, (void *)&a, sizeof a)) { perror("connect"); return 2; }
    memset(buf, 7, pool);
    size_t count;
    struct iovec *v = pages(buf, page, shuffled, 0xfeedfaceULL, &count);
    char r;
    if (read(s, &r, 1) != 1) return 2;
    if (move_all(s, v, count, 1)) return 2; /* one warm-up request */
    double t0 = now();
    long reqs = 0;
    while (now() - t0 < secs) {
        if (move_all(s, v, count, 1)) return 2;
        reqs++;
    }
    double dt = now() - t0;
    printf("%.3f %.3f\n", 1000 * dt / reqs, reqs * (double)LAYERS * LAYER * 8 / dt / 1e9);
    shutdown(s, SHUT_WR);
    waitpid(child, NULL, 0);
    return 0;
}
