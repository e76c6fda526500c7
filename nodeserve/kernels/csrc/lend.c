/* Lending an idle core: a helper thread pinned to another device's core takes half of each GEMM's output rows,
 * and half of a decode step's sequences in attention, while that device has nothing to do, so one stream's decode
 * (or one long prompt's prefill) reads its weights with two cores' memory bandwidth instead of one, and a large
 * decode batch reads its KV pages with two.
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
int ns_paged_decode_attention_local(const float *q, const void *kv, const int64_t *block_tables,
                                    int64_t max_pages, const int64_t *seq_lens, float *out, int64_t B, int64_t H,
                                    int64_t KH, int64_t D, int64_t page_size, float scale, int kv_f16,
                                    int64_t window);

#define HELPER_NICE 5
#define MIN_SPLIT_ROWS 64  /* below this many output rows a split costs more than the second core gives */
#define MIN_SPLIT_KV 512   /* ... below this many KV tokens a step's attention (~0.1 ms a layer) */
enum { IDLE, POSTED, RUNNING, DONE };
enum { LINEAR, ATTENTION, TASKS };

/* Runs tasks taken from *next until none are left, or, when lent is not NULL (on a helper), until *lent is 0. */
typedef void (*ns_tasks_fn)(const void *ctx, atomic_long *next, const atomic_int *lent);

/* One half of a call: ns_linear_local's or ns_paged_decode_attention_local's arguments, or one side of a shared
 * task list. */
struct ns_job {
    int kind;
    ns_tasks_fn fn;  /* TASKS: fn(ctx, next, lent) */
    const void *ctx;
    atomic_long *next;
    const atomic_int *lent;
    int type;  /* LINEAR: y [M, ldy] columns n_begin..n_end = x @ W^T */
    const uint8_t *w;
    const float *x;
    float *y;
    int64_t M, K, ldy, n_begin, n_end;
    const float *q;  /* ATTENTION: B sequences' decode attention over a float32 or float16 (kv_f16) pool */
    const void *kv;
    int kv_f16;
    const int64_t *block_tables, *seq_lens;
    float *out;
    int64_t max_pages, B, H, KH, D, page_size, window;
    float scale;
};

static int run_job(const struct ns_job *j) {
    if (j->kind == TASKS) {
        j->fn(j->ctx, j->next, j->lent);
        return 0;
    }
    if (j->kind == LINEAR)
        return ns_linear_local(j->type, j->w, j->x, j->y, j->M, j->K, j->ldy, j->n_begin, j->n_end);
    return ns_paged_decode_attention_local(j->q, j->kv, j->block_tables, j->max_pages, j->seq_lens, j->out, j->B,
                                           j->H, j->KH, j->D, j->page_size, j->scale, j->kv_f16, j->window);
}

struct ns_helper {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int cpu;
    atomic_int lent, wanted, stop, state;
    atomic_long num_jobs;  /* halves the helper ran (tests and metrics) */
    struct ns_job job;
    int err;
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
            h->err = run_job(&h->job);
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

/* Runs `mine` here and posts `theirs` to h (lent and idle: checked by the caller), then waits for it, or runs it
 * here too when the helper has not started it. */
static int split(struct ns_helper *h, const struct ns_job *mine, const struct ns_job *theirs) {
    h->job = *theirs;
    atomic_store_explicit(&h->state, POSTED, memory_order_release);
    int err = run_job(mine);
    for (;;) {
        int s = atomic_load_explicit(&h->state, memory_order_acquire);
        if (s == DONE) {
            err |= h->err;
            break;
        }
        if (s == POSTED) {  /* not started: the core was taken back, or the helper is asleep; do it here */
            int posted = POSTED;
            if (atomic_compare_exchange_strong(&h->state, &posted, RUNNING)) {
                err |= run_job(theirs);
                break;
            }
        }
        CPU_RELAX();
    }
    atomic_store(&h->state, IDLE);
    return err;
}

static int can_split(const struct ns_helper *h) {
    return h && atomic_load(&h->lent) && atomic_load(&h->state) == IDLE;
}

/* y [M, ldy] columns n_begin..n_end = x @ W^T (see ns_linear_local), the upper half of the rows on the borrowed
 * helper when it is lent and idle. The split falls on a multiple of 16 rows (the R16 groups). */
int ns_linear(int type, const uint8_t *w, const float *x, float *y, int64_t M, int64_t K, int64_t ldy,
              int64_t n_begin, int64_t n_end) {
    struct ns_helper *h = borrowed;
    if (n_end - n_begin < MIN_SPLIT_ROWS || !can_split(h))
        return ns_linear_local(type, w, x, y, M, K, ldy, n_begin, n_end);
    const int64_t mid = n_begin + ((n_end - n_begin) / 2 + 15) / 16 * 16;
    struct ns_job mine = {.kind = LINEAR, .type = type, .w = w, .x = x, .y = y, .M = M, .K = K, .ldy = ldy,
                          .n_begin = n_begin, .n_end = mid};
    struct ns_job theirs = mine;
    theirs.n_begin = mid;
    theirs.n_end = n_end;
    return split(h, &mine, &theirs);
}

/* KV tokens decode attention reads of a sequence of len tokens under a sliding window (0: none). */
#define READ_LEN(len, window) ((window) > 0 && (len) > (window) ? (window) : (len))

/* Decode attention (see ns_paged_decode_attention_local), the later sequences on the borrowed helper when it is
 * lent and idle: split where the KV tokens read are halved, since each sequence's cost is the keys it reads. Each
 * sequence is computed whole on one thread, so the output is the unsplit one bit for bit. */
int ns_paged_decode_attention(const float *q, const void *kv, const int64_t *block_tables, int64_t max_pages,
                              const int64_t *seq_lens, float *out, int64_t B, int64_t H, int64_t KH, int64_t D,
                              int64_t page_size, float scale, int kv_f16, int64_t window) {
    struct ns_helper *h = borrowed;
    int64_t total = 0;
    for (int64_t b = 0; b < B; b++) total += READ_LEN(seq_lens[b], window);
    struct ns_job mine = {.kind = ATTENTION, .q = q, .kv = kv, .block_tables = block_tables, .seq_lens = seq_lens,
                          .out = out, .max_pages = max_pages, .B = B, .H = H, .KH = KH, .D = D,
                          .page_size = page_size, .scale = scale, .kv_f16 = kv_f16, .window = window};
    if (B < 2 || total < MIN_SPLIT_KV || !can_split(h)) return run_job(&mine);
    int64_t mid = 0, sum = 0;
    while (mid < B - 1 && 2 * (sum + READ_LEN(seq_lens[mid], window)) <= total)
        sum += READ_LEN(seq_lens[mid++], window);
    if (mid == 0) mid = 1;
    struct ns_job theirs = mine;
    mine.B = mid;
    theirs.q = q + mid * H * D;
    theirs.block_tables = block_tables + mid * max_pages;
    theirs.seq_lens = seq_lens + mid;
    theirs.out = out + mid * H * D;
    theirs.B = B - mid;
    return split(h, &mine, &theirs);
}

/* Runs fn's tasks on this thread and, when split_ok and the borrowed helper is lent and idle, on the helper too:
 * both take tasks from one counter, and the helper stops taking them once its core is taken back (the borrowing
 * thread then takes the rest). For work cut into many short tasks of uneven cost (prefill attention). */
void ns_run_tasks(ns_tasks_fn fn, const void *ctx, int split_ok) {
    struct ns_helper *h = borrowed;
    atomic_long next = 0;
    struct ns_job mine = {.kind = TASKS, .fn = fn, .ctx = ctx, .next = &next, .lent = NULL};
    if (!split_ok || !can_split(h)) {
        run_job(&mine);
        return;
    }
    struct ns_job theirs = mine;
    theirs.lent = &h->lent;
    split(h, &mine, &theirs);
}
