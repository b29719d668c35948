/* kNCA's fast path in C: log P_i and d log P_i / d logit_ij for rows whose coefficients fit
   in double (training/knca.py's in_linear_range), in one pass a row.

   The same programme as training/knca.py (read its docstring first) on the coefficients
   themselves. For row i with candidates j (weights w_j = exp(logit_ij - shift_i), 0 where
   the logit is -inf) and compact classes c_j in 0..C-1:

       E_c(t) = prod_{j: c_j = c} (1 + w_j t), truncated at degree k      (the recurrence
                e_r <- e_r + w_j e_{r-1}, r = k..1, one candidate at a time)

   "all" (C = 2, class 0 is i's own, 1 every other):
       num = [t^k] E_0,   Z = sum_r [t^r] E_0 [t^(k-r)] E_1
   "majority" (y = i's class, Q = prod_{c != y} E_c, T_m the same product with every factor
   truncated below degree m, both truncated at degree k):
       Z = sum_r [t^r] E_y [t^(k-r)] Q,
       num = sum_{m=1..k} [t^m] E_y coef_m,  coef_m = [t^(k-m)] Q where k - m < m,
             [t^(k-m)] T_m for 2 <= m <= k/2, 0 for m = 1 < k

   and log P_i = log num - log Z (num floored at 1e-300, as in the torch programme).

   The backward is written out (reverse mode, in the order the forward ran):
   * d log P / d num = 1 / num, d log P / d Z = -1 / Z, which give the adjoints of E_y, of
     Q's coefficients and of each T_m's one coefficient;
   * a product's adjoint reaches factor l through the product of the other factors,
     d P[n] / d F_l[r] = L_l[n - r], L_l = prefix_l * suffix_l (prefix products are kept
     from the forward; suffix products are built going back), so no division happens;
   * the recurrence's adjoint runs over the candidates in reverse: for candidate j of class
     c with a the adjoint of E_c after j and e the state E_c before j,
         d / d w_j = sum_{r>=1} a_r e_{r-1},    a_r <- a_r + w_j a_{r+1}  (r = 0..k-1)
     and d / d logit_j = w_j d / d w_j.
   Every coefficient is a sum of non-negative terms, so nothing cancels; the torch programme
   computes the same sums in another order (tests: values within 1e-12, gradients 1e-9).

   Memory per call: O(M k + C k^2) doubles of scratch, allocated once. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NUM_FLOOR 1e-300

/* out[n] = sum_{r+s=n} a[r] b[s] for n = 0..deg; a has la coefficients, b has lb. */
static void poly_mul(const double *a, int64_t la, const double *b, int64_t lb, double *out,
                     int64_t deg) {
    for (int64_t n = 0; n <= deg; n++) out[n] = 0.0;
    for (int64_t r = 0; r < la && r <= deg; r++) {
        const double ar = a[r];
        if (ar == 0.0) continue;
        const int64_t top = deg - r < lb - 1 ? deg - r : lb - 1;
        for (int64_t s = 0; s <= top; s++) out[r + s] += ar * b[s];
    }
}

/* prefix (n+1, deg+1): prefix[l] = prod_{l' < l} f_l' truncated at deg, f_l the first
   `width` coefficients of row l of f (rows `stride` apart); prefix[n] is the whole product. */
static void prefix_products(const double *f, int64_t n, int64_t width, int64_t stride,
                            int64_t deg, double *prefix) {
    const int64_t d1 = deg + 1;
    memset(prefix, 0, d1 * sizeof(double));
    prefix[0] = 1.0;
    for (int64_t l = 0; l < n; l++)
        poly_mul(prefix + l * d1, d1, f + l * stride, width, prefix + (l + 1) * d1, deg);
}

/* Adds d out / d f_l[r] = sum_n g[n] L_l[n - r] to grad_f[l * stride + r] (r < width), for
   the product P = prod_l f_l of prefix_products and g[n] = d out / d P[n] (n = 0..deg).
   Scratch: suffix and next (deg+1 each), loo (deg+1). */
static void product_backward(const double *f, int64_t n, int64_t width, int64_t stride,
                             int64_t deg, const double *prefix, const double *g, double *grad_f,
                             double *suffix, double *next, double *loo) {
    const int64_t d1 = deg + 1;
    memset(suffix, 0, d1 * sizeof(double));
    suffix[0] = 1.0;
    for (int64_t l = n - 1; l >= 0; l--) {
        poly_mul(prefix + l * d1, d1, suffix, d1, loo, deg);  /* L_l */
        for (int64_t r = 0; r < width && r <= deg; r++) {
            double acc = 0.0;
            for (int64_t m = r; m <= deg; m++) acc += g[m] * loo[m - r];
            grad_f[l * stride + r] += acc;
        }
        poly_mul(suffix, d1, f + l * stride, width, next, deg);
        double *swap = suffix;
        suffix = next;
        next = swap;
    }
}

/* Scratch doubles one call needs for rows of m candidates, c classes, degree k. */
int64_t knca_linear_work_size(int64_t m, int64_t c, int64_t k) {
    const int64_t k1 = k + 1;
    return m                  /* w */
           + m * k1           /* state of the candidate's class before it */
           + 2 * c * k1       /* E, its adjoint */
           + 2 * c * k1       /* the other classes' factors, their adjoint */
           + (k1 + 1) * c * k1 /* prefix products of Q (m = 0) and of each T_m */
           + 5 * k1           /* g, suffix, next, loo, coef */
           + c;               /* seen (int64_t, the size of a double) */
}

/* Rows [0, b): logits (b, m), shift (b,), labels (b, m) in 0..c-1, own (b,) (ignored for
   "all", where labels are 0 / 1) -> log_p (b,), jac (b, m) = d log P_i / d logit_ij.
   work: knca_linear_work_size(m, c, k) doubles. Returns 0, or -1 for a label outside 0..c-1. */
int64_t knca_linear_rows(const double *logits, const double *shift, const int64_t *labels,
                         const int64_t *own, int64_t b, int64_t m, int64_t c, int64_t k,
                         int32_t variant_all, double *log_p, double *jac, double *work) {
    const int64_t k1 = k + 1;
    double *w = work;
    double *before = w + m;                 /* (m, k1) */
    double *e = before + m * k1;            /* (c, k1) */
    double *adj = e + c * k1;               /* (c, k1) */
    double *f = adj + c * k1;               /* (c, k1): the other classes' E, in order */
    double *grad_f = f + c * k1;            /* (c, k1) */
    double *prefix = grad_f + c * k1;       /* (k1, c, k1): Q's, then T_m's at m * c * k1 */
    double *g = prefix + k1 * c * k1;       /* (k1) */
    double *suffix = g + k1, *next = suffix + k1, *loo = next + k1, *coef = loo + k1;
    int64_t *seen = (int64_t *)(coef + k1); /* (c): whether class c has a candidate here */

    for (int64_t i = 0; i < b; i++) {
        const double *li = logits + i * m;
        const int64_t *ci = labels + i * m;
        double *ji = jac + i * m;
        for (int64_t j = 0; j < m; j++)
            if (ci[j] < 0 || ci[j] >= c) return -1;

        /* forward: the class polynomials, keeping each candidate's class state before it */
        memset(e, 0, c * k1 * sizeof(double));
        memset(seen, 0, c * sizeof(int64_t));
        for (int64_t cl = 0; cl < c; cl++) e[cl * k1] = 1.0;
        for (int64_t j = 0; j < m; j++) {
            const double wj = exp(li[j] - shift[i]);  /* exp(-inf) = 0: an absent candidate */
            double *ec = e + ci[j] * k1;
            w[j] = wj;
            seen[ci[j]] |= wj > 0.0;
            memcpy(before + j * k1, ec, k1 * sizeof(double));
            for (int64_t r = k; r >= 1; r--) ec[r] += wj * ec[r - 1];
        }

        memset(adj, 0, c * k1 * sizeof(double));
        double num, z;
        if (variant_all) {
            const double *e0 = e, *e1 = e + k1;
            num = e0[k];
            z = 0.0;
            for (int64_t r = 0; r <= k; r++) z += e0[r] * e1[k - r];
            const double inv_num = num > NUM_FLOOR ? 1.0 / num : 0.0, inv_z = 1.0 / z;
            for (int64_t r = 0; r <= k; r++) {
                adj[r] = -inv_z * e1[k - r];
                adj[k1 + r] = -inv_z * e0[k - r];
            }
            adj[k] += inv_num;
        } else {
            const int64_t y = own[i];
            if (y < 0 || y >= c) return -1;
            const double *ey = e + y * k1;
            /* the other classes' polynomials, in order; a class with no candidate here has
               E_c = 1, which changes no product, so it is left out */
            int64_t n_other = 0;
            for (int64_t cl = 0; cl < c; cl++)
                if (cl != y && seen[cl])
                    memcpy(f + (n_other++) * k1, e + cl * k1, k1 * sizeof(double));
            const int64_t block = c * k1;  /* prefix products per m */
            prefix_products(f, n_other, k1, k1, k, prefix);
            const double *q = prefix + n_other * k1;  /* (k1): Q */
            z = 0.0;
            for (int64_t r = 0; r <= k; r++) z += ey[r] * q[k - r];
            num = 0.0;
            for (int64_t mm = 1; mm <= k; mm++) {
                coef[mm] = 0.0;
                if (k - mm < mm) {
                    coef[mm] = q[k - mm];
                } else if (mm > 1) {  /* T_m up to degree k - m, factors cut below degree m */
                    double *pm = prefix + mm * block;
                    prefix_products(f, n_other, mm, k1, k - mm, pm);
                    coef[mm] = pm[n_other * (k - mm + 1) + (k - mm)];
                }
                num += ey[mm] * coef[mm];
            }
            const double inv_num = num > NUM_FLOOR ? 1.0 / num : 0.0, inv_z = 1.0 / z;
            double *adj_y = adj + y * k1;
            for (int64_t r = 0; r <= k; r++) {
                adj_y[r] = -inv_z * q[k - r] + (r >= 1 ? inv_num * coef[r] : 0.0);
                g[r] = -inv_z * ey[k - r];  /* d log P / d Q[r] */
            }
            for (int64_t mm = 1; mm <= k; mm++)
                if (k - mm < mm) g[k - mm] += inv_num * ey[mm];
            memset(grad_f, 0, c * k1 * sizeof(double));
            product_backward(f, n_other, k1, k1, k, prefix, g, grad_f, suffix, next, loo);
            for (int64_t mm = 2; mm <= k; mm++) {
                if (k - mm < mm) continue;
                const int64_t deg = k - mm;
                memset(g, 0, (deg + 1) * sizeof(double));
                g[deg] = inv_num * ey[mm];
                product_backward(f, n_other, mm, k1, deg, prefix + mm * block, g, grad_f,
                                 suffix, next, loo);
            }
            int64_t l = 0;
            for (int64_t cl = 0; cl < c; cl++) {
                if (cl == y || !seen[cl]) continue;
                for (int64_t r = 0; r <= k; r++) adj[cl * k1 + r] += grad_f[l * k1 + r];
                l++;
            }
        }
        log_p[i] = log(num > NUM_FLOOR ? num : NUM_FLOOR) - log(z);

        /* backward through the recurrence, candidates in reverse */
        for (int64_t j = m - 1; j >= 0; j--) {
            double *a = adj + ci[j] * k1;
            const double *prev = before + j * k1;
            const double wj = w[j];
            double dw = 0.0;
            for (int64_t r = 1; r <= k; r++) dw += a[r] * prev[r - 1];
            ji[j] = wj * dw;
            for (int64_t r = 0; r < k; r++) a[r] += wj * a[r + 1];
        }
    }
    return 0;
}
