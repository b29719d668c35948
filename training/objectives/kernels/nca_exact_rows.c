/* The row pass of exact NCA in float32: the exps and their sums of query rows against every
   point, in place, in one pass over each row.

   The gradient's mathematics is in training/objectives/nca_kernel.py (its docstring and
   _scores_and_row_scale's). Its torch path takes each chunk of B query rows of one class
   through a GEMM with a bias row (the logits), torch's softmax over each row, a threshold
   pass (no subnormal p_ij) and the block's sum: four passes over the (B, N) buffer. Here the
   GEMM writes the dot products z_i.z_j alone and one call makes, for each row i,

       L'_ij = 2 z_i.z_j - ||z_j||^2     (= ||z_i||^2 - ||z_i - z_j||^2)
       e_ij  = exp(L'_ij - ||z_i||^2) = exp(-||z_i - z_j||^2), or 0 where that is below
               exp(EXP_CUT), and e_ii = 0
       S_i   = sum_j e_ij,    S_i^c = sum_{s <= j < e} e_ij   (the same-class block [s, e))

   in one pass that reads the dot products and writes the exps over them. The caller divides
   by S_i (p_ij = e_ij / S_i, p_i = S_i^c / S_i) where the row meets the (B, d) side of its
   products, never in another pass over (B, N).

   The shift ||z_i||^2 is the row's bound (the logit of j = i), not its maximum, which would
   cost a pass of its own: the exps stay in range while i's nearest point lies within
   squared distance 20 (the row's largest e_ij at least PEAK_FLOOR = exp(-20)), and those
   cut to 0 then lie at least 50 below the largest in the exponent (each below 2e-22 of it).
   A row whose nearest point is farther, or whose sums are not finite (an infinite dot
   product, or an argument above EXP_TOP, which rounding can make where ||z|| is in the
   thousands), gets NaN sums, and the caller recomputes it from its logits with their own
   maximum (nca_kernel._far_rows). The cut is absolute, so relative to S_i it may drop
   exps up to exp(-50) of it: the caller also recomputes a row whose same-class sum is too
   small for that to stay below float32's resolution of p_i.

   EXP_CUT is just above log(numerics.TINY_P) (-70.008), so every exp kept exceeds TINY_P:
   as the torch path sets p_ij <= TINY_P to 0, and with the caller's block factor (0, or at
   least eps / 2), the products never meet a subnormal float (a microcode assist per
   element on an Intel Xeon). exp itself is Cephes' expf: x = n ln2 + r with |r| <= ln2/2, a
   degree-7 polynomial in r times 2^n built from the exponent's bits (about 1 ulp).

   The loop runs on GCC's vector extensions, 16, 8 or 4 floats wide for the AVX-512, AVX and
   baseline builds (setup.py builds each x86-64 level): the same operations in the same
   order at every level. exp's multiply-adds are fused where the level has FMA (AVX2 and
   AVX-512: a fifth faster, and the same floats at both), separate at the baseline (within an
   ulp or two of those). A row's sums add 16 float sums over PART columns, then those in
   double.

   The caller passes finite embeddings only (a NaN dot product would get e_ij = 0). */

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));

/* a b + c, fused (one rounding) where the level has FMA, else a product and a sum */
#if defined(__AVX512F__)
#include <immintrin.h>
#define MADD(a, b, c) ((vf)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
#elif defined(__FMA__)
#include <immintrin.h>
#define MADD(a, b, c) ((vf)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

#define STEP 16             /* columns a step of the sums takes, whatever LANES is */
#define PART 1024           /* columns whose 16 float sums are added into the double sum */
#define EXP_CUT (-69.9996f) /* above log(TINY_P) = -70.008, TINY_P = 4 FLT_MIN / FLT_EPSILON */
#define EXP_TOP 88.0f        /* exp of more than this is not a float (2^n would wrap) */
#define PEAK_FLOOR 2.0611536e-9f /* exp(-20): a row's largest e_ij at least this */

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* a where mask (all bits set), else b */
static inline vf pick(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* exp(x) for EXP_CUT <= x <= EXP_TOP, 0 below EXP_CUT (and for NaN x), +inf above EXP_TOP
   (where 2^n would wrap: the caller's row sum is then not finite) */
static inline vf exp_or_zero(vf x) {
    const vi keep = x >= EXP_CUT;
    const vi above = x > EXP_TOP;
    x = pick(keep & ~above, x, (vf){0} + EXP_CUT);
    const vf zero = {0};
    const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round(x/ln2) */
    vf r = MADD(n, zero - 0.693359375f, x);                              /* x - n ln2 */
    r = MADD(n, zero + 2.12194440e-4f, r);
    vf p = zero + 1.9875691500e-4f;
    p = MADD(p, r, zero + 1.3981999507e-3f);
    p = MADD(p, r, zero + 8.3334519073e-3f);
    p = MADD(p, r, zero + 4.1665795894e-2f);
    p = MADD(p, r, zero + 1.6666665459e-1f);
    p = MADD(p, r, zero + 5.0000001201e-1f);
    p = MADD(p, r * r, r) + 1.0f;
    const vi two_to_n = (__builtin_convertvector(n, vi) + 127) << 23;
    return pick(above, (vf){0} + INFINITY, (vf)((vi)(p * (vf)two_to_n) & keep));
}

/* the same for one float (a row's last columns, fewer than LANES) */
static inline float exp_or_zero_1(float x) {
    float lane[LANES] = {x};
    store(lane, exp_or_zero(load(lane)));
    return lane[0];
}

/* x_j = exp(2 x_j - sq_j - m) (or 0) for lo <= j < hi, in place; returns their sum, added
   as 16 float sums (column j into sum j mod 16 from lo) over each PART columns, then those in
   double: the same additions in the same order at every vector width. *peak becomes the
   largest of them if that is larger. */
static double exp_sum(float *x, const float *sq, int64_t lo, int64_t hi, float m, float *peak) {
    double total = 0.0;
    vf top = {0};
    int64_t j = lo;
    while (j + STEP <= hi) {
        const int64_t stop = j + PART < hi ? j + PART : hi;
        vf part[STEP / LANES] = {{0}};
        for (; j + STEP <= stop; j += STEP) {
            for (int k = 0; k < STEP / LANES; k++) {
                const int64_t at = j + k * LANES;
                const vf e = exp_or_zero(load(x + at) * 2.0f - load(sq + at) - m);
                store(x + at, e);
                part[k] += e;
                top = pick(e > top, e, top);
            }
        }
        for (int k = 0; k < STEP / LANES; k++)
            for (int l = 0; l < LANES; l++) total += part[k][l];
    }
    for (; j < hi; j++) {
        x[j] = exp_or_zero_1(2.0f * x[j] - sq[j] - m);
        total += x[j];
        *peak = x[j] > *peak ? x[j] : *peak;
    }
    for (int l = 0; l < LANES; l++) *peak = top[l] > *peak ? top[l] : *peak;
    return total;
}

/* dots (b, n): z_i.z_j of b query rows against every point, row-major; replaced by e_ij.
   sq (n,): ||z_j||^2; self (b,): each row's own column (e_ii = 0); [s, e): the same-class
   block of every row. row_sum (b,) and block_sum (b,) receive S_i and S_i^c, both NaN for a
   row whose largest e_ij is below PEAK_FLOOR (its nearest point farther than that) or whose
   sums are not finite: the caller recomputes those rows from their logits. */
void nca_exact_rows_f32(float *dots, int64_t b, int64_t n, const float *sq, const int64_t *self,
                        int64_t s, int64_t e, double *row_sum, double *block_sum) {
    for (int64_t r = 0; r < b; r++) {
        float *x = dots + r * n;
        const float shift = sq[self[r]]; /* ||z_i||^2 = L'_ii >= L'_ij (rounding aside) */
        float peak = 0.0f;
        x[self[r]] = -INFINITY; /* its exp is 0 */
        const double inside = exp_sum(x, sq, s, e, shift, &peak);
        const double total = inside + exp_sum(x, sq, 0, s, shift, &peak) +
                             exp_sum(x, sq, e, n, shift, &peak);
        const int kept = peak >= PEAK_FLOOR && isfinite(total);
        row_sum[r] = kept ? total : NAN;
        block_sum[r] = kept ? inside : NAN;
    }
}
