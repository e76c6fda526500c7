/* Lending an idle core: a helper thread pinned to another device's core takes half of each GEMM's output rows
 * while that device has nothing to do, so one stream's decode (or one long prompt's prefill) reads its weights
 * with two cores' memory bandwidth instead of one.
 *
 * The device that owns the core lends it (ns_helper_lend(h, 1)) only while its worker waits for work, and takes it
 * back (0) before its own step: the helper then finishes the half it is on (tens of microseconds) and sleeps on
 * a condition variable. While lent and wanted (ns_helper_want: the borrowing device has work) it spins, on a
 * core that would otherwise idle, so a posted half starts at once; an idle server's helpers sleep. The borrowing thread never waits on a half the helper has not started: it takes the half back and
 * computes it itself, so a core taken back mid-post costs nothing but the split.
 *
 * One helper serves one borrowing thread (ns_helper_use, thread-local), so a job slot needs no queue.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

int ns_linear_local(int type, const uint8_t *w, const float *x, float *y, int64_t M, int64_t K, int64_t ldy,
                    int64_t n_begin, int64_t n_end);

#define HELPER_NICE 5
#define MIN_SPLIT_ROWS 64  /* below this many output rows a split costs more than the second core gives */
enum { IDLE, POSTED, RUNNING, DONE };

struct ns_helper {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int cpu;
    atomic_int lent, wanted, stop, state;
    atomic_long num_jobs;  /* halves the helper ran (tests and metrics) */
    /* the job: ns_linear_local's arguments */
    int type, err;
    const uint8_t *w;
    const float *x;
    float *y;
    int64_t M, K, ldy, n_begin, n_end;
};

static _Thread_local struct ns_helper *borrowed;

static void *helper_main(void *arg) {
    struct ns_helper *h = arg;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(h->cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);  /* best effort: unpinned it still helps */
    /* Below the event loop, which is not pinned and may want this core: a spinning or computing helper gave it
     * half the core at equal priority (nice +5: about three quarters). Linux nice values are per thread. */
    id_t tid = (id_t)syscall(SYS_gettid);
    setpriority(PRIO_PROCESS, tid, getpriority(PRIO_PROCESS, tid) + HELPER_NICE);
    while (!atomic_load(&h->stop)) {
        int posted = POSTED;
        if (atomic_compare_exchange_strong(&h->state, &posted, RUNNING)) {
            h->err = ns_linear_local(h->type, h->w, h->x, h->y, h->M, h->K, h->ldy, h->n_begin, h->n_end);
            atomic_fetch_add(&h->num_jobs, 1);
            atomic_store_explicit(&h->state, DONE, memory_order_release);
        } else if (atomic_load(&h->lent) && atomic_load(&h->wanted)) {
            CPU_RELAX();
        } else {
            pthread_mutex_lock(&h->mu);
            while (!(atomic_load(&h->lent) && atomic_load(&h->wanted)) && !atomic_load(&h->stop))
                pthread_cond_wait(&h->cv, &h->mu);
            pthread_mutex_unlock(&h->mu);
        }
    }
    return NULL;
}

/* A helper thread pinned to `cpu`, not lent yet; NULL if the thread cannot start. */
struct ns_helper *ns_helper_new(int cpu) {
    struct ns_helper *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    h->cpu = cpu;
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->cv, NULL);
    if (pthread_create(&h->thread, NULL, helper_main, h)) {
        free(h);
        return NULL;
    }
    return h;
}

static void set_flag(struct ns_helper *h, atomic_int *flag, int on) {
    if (atomic_exchange(flag, on) == on || !on) return;
    pthread_mutex_lock(&h->mu);
    pthread_cond_signal(&h->cv);
    pthread_mutex_unlock(&h->mu);
}

/* The owner of h's core: on while its worker waits for work, off before it runs anything. */
void ns_helper_lend(struct ns_helper *h, int on) { set_flag(h, &h->lent, on); }

/* The borrower of h: on while its worker has work (h may spin), off while it waits (h sleeps). */
void ns_helper_want(struct ns_helper *h, int on) { set_flag(h, &h->wanted, on); }

/* The calling thread's GEMMs split with h from now on (NULL: no more). */
void ns_helper_use(struct ns_helper *h) { borrowed = h; }

long ns_helper_jobs(struct ns_helper *h) { return atomic_load(&h->num_jobs); }

void ns_helper_free(struct ns_helper *h) {
    atomic_store(&h->stop, 1);
    pthread_mutex_lock(&h->mu);
    pthread_cond_signal(&h->cv);
    pthread_mutex_unlock(&h->mu);
    pthread_join(h->thread, NULL);
    pthread_mutex_destroy(&h->mu);
    pthread_cond_destroy(&h->cv);
    free(h);
}

/* y [M, ldy] columns n_begin..n_end = x @ W^T (see ns_linear_local), the upper half of the rows on the borrowed
 * helper when it is lent and idle. The split falls on a multiple of 16 rows (the R16 groups). */
int ns_linear(int type, const uint8_t *w, const float *x, float *y, int64_t M, int64_t K, int64_t ldy,
              int64_t n_begin, int64_t n_end) {
    struct ns_helper *h = borrowed;
    if (!h || n_end - n_begin < MIN_SPLIT_ROWS || !atomic_load(&h->lent) || atomic_load(&h->state) != IDLE)
        return ns_linear_local(type, w, x, y, M, K, ldy, n_begin, n_end);
    const int64_t mid = n_begin + ((n_end - n_begin) / 2 + 15) / 16 * 16;
    h->type = type; h->w = w; h->x = x; h->y = y; h->M = M; h->K = K; h->ldy = ldy;
    h->n_begin = mid; h->n_end = n_end;
    atomic_store_explicit(&h->state, POSTED, memory_order_release);
    int err = ns_linear_local(type, w, x, y, M, K, ldy, n_begin, mid);
    for (;;) {
        int s = atomic_load_explicit(&h->state, memory_order_acquire);
        if (s == DONE) {
            err |= h->err;
            break;
        }
        if (s == POSTED) {  /* not started: the core was taken back, or the helper is asleep; do it here */
            int posted = POSTED;
            if (atomic_compare_exchange_strong(&h->state, &posted, RUNNING)) {
                err |= ns_linear_local(type, w, x, y, M, K, ldy, mid, n_end);
                break;
            }
        }
        CPU_RELAX();
    }
    atomic_store(&h->state, IDLE);
    return err;
}
