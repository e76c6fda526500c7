/* All-reduce between the ranks of a CPU tensor-parallel group: threads of one process, each running a shard of
 * the model on its own core, meeting after o_proj and after down_proj of every layer (Megatron's two reduces).
 *
 * Every rank passes its own buffer of n floats; on return each holds the elementwise sum over ranks, added in
 * rank order (rank 0 + rank 1 + ... in float32), so all ranks hold bitwise the same values. Shared memory makes
 * this two barriers: each rank publishes its pointer; barrier; rank r adds up its slice of [0, n) over every
 * rank's buffer and writes the sum into all of them; barrier.
 *
 * The barrier is one 64-bit atomic word (arrival count, abort bit, generation), so arriving, completing and
 * aborting are ordered against each other: a barrier either completes for every rank or for none. Waiting spins
 * with a pause for a while (a decode step's reduces are microseconds apart), then yields, so ranks that share a
 * core (more ranks than cores) hand it over instead of spinning through a time slice.
 *
 * Abort: a rank that will not arrive (its forward raised) must not leave the others waiting forever, so its
 * owner calls ns_group_abort: waiting ranks, and every later call, return -1 until ns_group_reset. Only the
 * first barrier honours it: once every rank has published its buffer, all of them are summing and will reach
 * the second barrier in microseconds, and leaving it early would let a caller free a buffer a peer still writes.
 * Plain C11 (no AVX-512 assumed): the sum loop is left to the compiler's vectoriser.
 */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

/* ~7 us of pause on Zen 4 (26 ns each) before each yield: longer than two ranks on their own cores usually wait
 * for each other, short enough that ranks sharing a core hand it over quickly (measured, 4 ranks on 2 cores, 576
 * floats: 11 us a call at 128 spins, 54 us at 1024; 2 ranks on 2 cores: 0.34 us either way). */
#define SPINS_BEFORE_YIELD 256
/* Then sleep on a futex: on machines whose cores share a physical core or are time-sliced by a hypervisor (the
 * 2-vCPU Zen 4 here: a pause loop on one vCPU halved a decode step on the other, 7 -> 14 ms), a rank that spins or
 * yields while waiting takes the issue slots the rank it waits for needs. Set per group (ns_group_spins): 0 sleeps
 * at once. */
#define SLICE_ALIGN 16            /* floats: slices start on 64-byte lines, so no two ranks write one line */
#define SUM_BLOCK 256             /* floats summed in a stack buffer before being written back to every rank */
#define SLOT_FLOATS (64 * 1024)   /* reduces up to this size take one barrier (64 decode rows of a 1k hidden) */

/* The barrier word: arrivals in the low 32 bits, the abort bit, the generation above it. */
#define COUNT_MASK 0xffffffffull
#define ABORT_BIT (1ull << 32)
#define GEN_ONE (1ull << 33)

struct ns_group {
    _Alignas(64) _Atomic uint64_t word;
    _Atomic uint32_t wakes;     /* bumped (then FUTEX_WAKE) at each completion and abort: what sleepers wait on */
    _Atomic uint32_t sleepers;  /* ranks in FUTEX_WAIT or about to be: the waker skips the syscall when none */
    long spins;                 /* pause iterations before sleeping */
    _Alignas(64) int64_t num_ranks;
    float **bufs;  /* [num_ranks] published before the first barrier, read after it */
    int64_t *lens;
    /* The one-barrier path for small reduces (decode rows): each rank copies its partial into slot [parity][rank]
     * and, after one barrier, sums every rank's slot into its own buffer. Parity alternates per call, so a rank's
     * next write goes to the other set, and the one after that only once every rank has passed the barrier in
     * between, i.e. has finished reading this set. Half the barriers of the path above. */
    float *slots;          /* [2][num_ranks][SLOT_FLOATS] */
    int64_t *slot_lens;    /* [2][num_ranks] */
    int64_t *calls;        /* [num_ranks] one-barrier calls made, for the parity; zeroed by reset */
};

void ns_group_free(void *p);

void *ns_group_new(int64_t num_ranks) {
    if (num_ranks < 1) return NULL;
    struct ns_group *g = aligned_alloc(64, sizeof *g);
    if (!g) return NULL;
    g->num_ranks = num_ranks;
    g->bufs = calloc((size_t)num_ranks, sizeof *g->bufs);
    g->lens = calloc((size_t)num_ranks, sizeof *g->lens);
    g->slots = aligned_alloc(64, sizeof(float) * 2 * (size_t)num_ranks * SLOT_FLOATS);
    g->slot_lens = calloc(2 * (size_t)num_ranks, sizeof *g->slot_lens);
    g->calls = calloc((size_t)num_ranks, sizeof *g->calls);
    if (!g->bufs || !g->lens || !g->slots || !g->slot_lens || !g->calls) {
        ns_group_free(g);
        return NULL;
    }
    atomic_init(&g->word, 0);
    atomic_init(&g->wakes, 0);
    atomic_init(&g->sleepers, 0);
    g->spins = SPINS_BEFORE_YIELD;
    return g;
}

void ns_group_free(void *p) {
    struct ns_group *g = p;
    if (!g) return;
    free(g->bufs);
    free(g->lens);
    free(g->slots);
    free(g->slot_lens);
    free(g->calls);
    free(g);
}

/* Arrive and wait for every rank. 0 once all arrived; -1 when honour_abort and the group is (or gets) aborted
 * before the last arrival, in which case it completes for no rank. */
static void wake_all(struct ns_group *g) {
    atomic_fetch_add_explicit(&g->wakes, 1, memory_order_seq_cst);
    if (atomic_load_explicit(&g->sleepers, memory_order_seq_cst))
        syscall(SYS_futex, &g->wakes, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static int barrier(struct ns_group *g, int honour_abort) {
    uint64_t w = atomic_load_explicit(&g->word, memory_order_relaxed), next;
    do {  /* arrive: count up, or, the last one, zero the count and start the next generation */
        if (honour_abort && (w & ABORT_BIT)) return -1;
        next = (int64_t)(w & COUNT_MASK) + 1 == g->num_ranks ? (w & ~COUNT_MASK) + GEN_ONE : w + 1;
    } while (!atomic_compare_exchange_weak_explicit(&g->word, &w, next, memory_order_acq_rel,
                                                    memory_order_relaxed));
    const uint64_t gen = w & ~(COUNT_MASK | ABORT_BIT);
    if ((next & ~(COUNT_MASK | ABORT_BIT)) != gen) {  /* the last arrival: release the others */
        wake_all(g);
        return 0;
    }
    for (long spins = 0;; spins++) {
        /* read before the check: a completion the check misses bumps it after, so FUTEX_WAIT returns */
        const uint32_t wakes = atomic_load_explicit(&g->wakes, memory_order_seq_cst);
        w = atomic_load_explicit(&g->word, memory_order_seq_cst);
        if ((w & ~(COUNT_MASK | ABORT_BIT)) != gen) return 0;
        if (honour_abort && (w & ABORT_BIT)) return -1;  /* the last arrival now never comes: see above */
        if (spins < g->spins) {
            CPU_RELAX();
            continue;
        }
        atomic_fetch_add_explicit(&g->sleepers, 1, memory_order_seq_cst);
        syscall(SYS_futex, &g->wakes, FUTEX_WAIT_PRIVATE, wakes, NULL, NULL, 0);
        atomic_fetch_sub_explicit(&g->sleepers, 1, memory_order_seq_cst);
    }
}

/* Pause iterations a waiting rank spins before it sleeps (0: sleep at once). */
void ns_group_spins(void *p, int64_t spins) {
    ((struct ns_group *)p)->spins = (long)spins;
}

/* out[i] = bufs[0][i] + bufs[1][i] + ... for i in [begin, end), written back into every rank's buffer. */
static void sum_slice(float *const *bufs, int64_t num_ranks, int64_t begin, int64_t end) {
    float acc[SUM_BLOCK];
    for (int64_t i = begin; i < end; i += SUM_BLOCK) {
        const int64_t m = end - i < SUM_BLOCK ? end - i : SUM_BLOCK;
        memcpy(acc, bufs[0] + i, sizeof(float) * (size_t)m);
        for (int64_t r = 1; r < num_ranks; r++) {
            const float *b = bufs[r] + i;
            for (int64_t j = 0; j < m; j++) acc[j] += b[j];
        }
        for (int64_t r = 0; r < num_ranks; r++) memcpy(bufs[r] + i, acc, sizeof(float) * (size_t)m);
    }
}

/* buf [n] of rank `rank`: replaced by the sum over ranks (see the top). Every rank calls it with the same n, in
 * lockstep. 0; -1 when the group is aborted (buf then untouched); -2 on every rank when the ranks' n differ. */
int ns_group_allreduce(void *p, int64_t rank, float *buf, int64_t n) {
    struct ns_group *g = p;
    const int64_t N = g->num_ranks;
    if (N == 1) return (atomic_load(&g->word) & ABORT_BIT) ? -1 : 0;
    if (n <= SLOT_FLOATS) {
        const int64_t parity = g->calls[rank]++ & 1;
        float *const set = g->slots + parity * N * SLOT_FLOATS;
        memcpy(set + rank * SLOT_FLOATS, buf, sizeof(float) * (size_t)n);
        g->slot_lens[parity * N + rank] = n;
        if (barrier(g, 1)) return -1;
        for (int64_t r = 0; r < N; r++)
            if (g->slot_lens[parity * N + r] != n) return -2;  /* every rank sees the same lens: all return -2 */
        memcpy(buf, set, sizeof(float) * (size_t)n);  /* rank 0's, then + rank 1's, ...: the fixed order */
        for (int64_t r = 1; r < N; r++) {
            const float *b = set + r * SLOT_FLOATS;
            for (int64_t j = 0; j < n; j++) buf[j] += b[j];
        }
        return 0;
    }
    g->bufs[rank] = buf;
    g->lens[rank] = n;
    if (barrier(g, 1)) return -1;
    int same = 1;  /* every rank reads the same lens, so all agree on this */
    for (int64_t r = 1; r < N; r++) same &= g->lens[r] == g->lens[0];
    if (same) {
        const int64_t chunk = ((n + N - 1) / N + SLICE_ALIGN - 1) / SLICE_ALIGN * SLICE_ALIGN;
        const int64_t begin = rank * chunk < n ? rank * chunk : n, end = begin + chunk < n ? begin + chunk : n;
        sum_slice(g->bufs, N, begin, end);
    }
    barrier(g, 0);  /* nobody returns (and frees its buffer) while a peer may still write into it */
    return same ? 0 : -2;
}

/* Every rank waiting in ns_group_allreduce, and every later call, returns -1 (until ns_group_reset). */
void ns_group_abort(void *p) {
    atomic_fetch_or(&((struct ns_group *)p)->word, ABORT_BIT);
    wake_all(p);
}

/* Clears an abort and the arrivals it left counted. Only once every rank has returned. */
void ns_group_reset(void *p) {
    struct ns_group *g = p;
    for (int64_t r = 0; r < g->num_ranks; r++) g->calls[r] = 0;
    const uint64_t w = atomic_load(&g->word);
    atomic_store(&g->word, (w & ~(COUNT_MASK | ABORT_BIT)) + GEN_ONE);
}
