/* NCA's value and gradient on candidate sets, one query row at a time.

   The same mathematics as nca_value_and_grad_candidates in training/objectives/nca_kernel.py
   (its docstring and _scores_and_row_scale's). Query row i has M candidates c (-1: none),
   the first K_same of its own class, the rest of other classes:

       L'_ic = 2 z_i.z_c - ||z_c||^2                 (L_ic up to a per-row constant)
       p_ic  = exp(L'_ic - m_i) / S_i,   S_i = sum_c exp(max(L'_ic - m_i, EXP_FLOOR))
       p_i   = sum_{c < K_same} p_ic

   with m_i the row maximum over the candidates present; the same-class candidates get their
   own maximum and sum, so log p_i stays exact when they lie beyond exp's range. A candidate
   that is absent (-1) carries exp(EXP_FLOOR) in S_i and nothing else (the torch path's
   softmax gives it 0: some 2e-35 of S_i >= 1 per candidate, below float precision).
   W_ic = d score_i / d L_ic is

       f: p_ic (1[c same] - p_i)          g: p_ic (1[c same] / p_i - 1)

   and the row adds 2 sum_c W_ic z_c to grad[i] and 2 W_ic (z_i - z_c) to grad[c]. A row with
   no same-class candidate scores 0 and adds nothing.

   Why: the torch path gathers a (B, M, d) block per chunk and scatters it back with
   index_add_, about 8 s an evaluation at N = 60k, M = 64, d = 32 on two cores; here a row's
   M candidates are read once, their logits and weights stay in a stack buffer, and the
   gradient is added in place (each caller thread has its own grad buffer).

   Compiled twice: -DNCA_DOUBLE for double, without it for float. */

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#ifdef NCA_DOUBLE
typedef double real;
#define ENTRY nca_candidates_rows_f64
#define EXP exp
#else
typedef float real;
#define ENTRY nca_candidates_rows_f32
#define EXP expf
#endif

#define EXP_FLOOR (-80.0)
#define MAX_CANDIDATES 4096 /* M at most (the caller checks) */

/* exp(max(x, EXP_FLOOR)) in the flavour's precision: the floor keeps exp off its slow
   subnormal results (the torch path's softmax takes exp(x), some 2e-35 less at most) */
static inline double floored_exp(double x) { return EXP((real)(x < EXP_FLOOR ? EXP_FLOOR : x)); }

/* z (n, d) embeddings; sq (n,) their squared norms; rows (n_rows,) the query rows;
   cand (n_rows, m) the candidates of each query row, in the order of rows; grad (n, d)
   accumulates the gradient. Returns the sum of the rows' scores. */
double ENTRY(const real *z, const real *sq, int64_t n, int64_t d, const int64_t *rows,
             int64_t n_rows, const int64_t *cand, int64_t m, int64_t k_same,
             int32_t log_form, real *grad) {
    double logit[MAX_CANDIDATES];
    double e[MAX_CANDIDATES]; /* exp of the logit less its block's maximum (same or all) */
    double total = 0.0;
    const double floor_weight = exp(EXP_FLOOR);
    (void)n;
    for (int64_t r = 0; r < n_rows; r++) {
        const int64_t i = rows[r];
        const int64_t *c_row = cand + r * m;
        const real *zi = z + i * d;
        double m_same = -INFINITY, m_all = -INFINITY;
        int64_t absent = 0;
        for (int64_t c = 0; c < m; c++) {
            const int64_t j = c_row[c];
            if (j < 0) {
                logit[c] = -INFINITY;
                absent++;
                continue;
            }
            const real *zj = z + j * d;
            real dot = 0;
            for (int64_t t = 0; t < d; t++) dot += zi[t] * zj[t];
            const double value = 2.0 * (double)dot - (double)sq[j];
            logit[c] = value;
            if (value > m_all) m_all = value;
            if (c < k_same && value > m_same) m_same = value;
        }
        if (m_same == -INFINITY) continue; /* no same-class candidate: p_i = 0, no gradient */
        double s_same = 0.0, s_all = absent * floor_weight;
        for (int64_t c = 0; c < m; c++) {
            if (logit[c] == -INFINITY) continue;
            const double e_all = floored_exp(logit[c] - m_all);
            s_all += e_all;
            if (c < k_same) {
                e[c] = floored_exp(logit[c] - m_same);
                s_same += e[c];
            } else {
                e[c] = e_all;
            }
        }
        const double log_p = (m_same + log(s_same)) - (m_all + log(s_all));
        const double shift = exp(m_same - m_all) / s_all; /* turns a same-class exp into p_ic */
        double same_factor, all_factor;                    /* W_ic from the exps */
        if (log_form) {
            total += log_p;
            same_factor = 1.0 / s_same - shift; /* p_ic / p_i - p_ic, per same-class exp */
            all_factor = -1.0 / s_all;          /* -p_ic, per exp of the row maximum */
        } else {
            const double p = exp(log_p);
            total += p;
            same_factor = shift * (1.0 - p); /* p_ic (1 - p_i) */
            all_factor = -p / s_all;         /* -p_ic p_i */
        }
        real *gi = grad + i * d;
        for (int64_t c = 0; c < m; c++) {
            if (logit[c] == -INFINITY) continue;
            const int64_t j = c_row[c];
            const double w = e[c] * (c < k_same ? same_factor : all_factor);
            const real w2 = (real)(2.0 * w);
            const real *zj = z + j * d;
            real *gj = grad + j * d;
            for (int64_t t = 0; t < d; t++) {
                gi[t] += w2 * zj[t];
                gj[t] += w2 * (zi[t] - zj[t]);
            }
        }
    }
    return total;
}

int64_t nca_candidates_max(void) { return MAX_CANDIDATES; }
