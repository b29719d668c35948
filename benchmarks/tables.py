"""Markdown tables from benchmarks/results/*.json (pasted into benchmarks/README.md).

Usage: python benchmarks/tables.py
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def load(name):
    path = RESULTS / name
    return json.loads(path.read_text()) if path.is_file() else None


def fmt(v, digits=3):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def fmt_objective(v):
    return "-" if v is None else f"{v:.1f}"


def md(rows, headers):
    out = ["| " + " | ".join(h for h, _ in headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        out.append("| " + " | ".join(fn(r) for _, fn in headers) + " |")
    return "\n".join(out)


def train_tables(r):
    parts = []
    if r.get("small"):
        parts.append(
            "Small sets (70/30 stratified splits, seeds 0-4; medians of time and memory, means of the rest):\n"
        )
        parts.append(
            md(
                r["small"],
                [
                    ("data", lambda x: x["data"]),
                    ("d", lambda x: str(x["d"])),
                    ("method", lambda x: x["method"]),
                    ("fit s", lambda x: fmt(x["seconds_median"])),
                    ("peak RSS MiB", lambda x: fmt(x["peak_rss_mib_median"])),
                    ("f(A) = sum p_i", lambda x: f"{x['objective_mean']:.2f}"),
                    ("1-NN test", lambda x: f"{x['test_acc_1nn_mean']:.4f}"),
                    ("5-NN test", lambda x: f"{x['test_acc_5nn_mean']:.4f}"),
                ],
            )
        )
    for part, title in (
        ("usps", "USPS, standard split, d = 32, 50 iterations"),
        ("scale", "Synthetic D = 784, 10 classes, d = 32"),
        ("large", "N = 60k x 784 -> d = 32, ours alone"),
    ):
        if r.get(part):
            parts.append(f"\n{title}:\n")
            parts.append(
                md(
                    r[part],
                    [
                        ("N", lambda x: fmt(x.get("n", 7291))),
                        ("method", lambda x: x.get("label", x["method"])),
                        ("fit s", lambda x: fmt(x.get("seconds"))),
                        ("s to sklearn's f", lambda x: fmt(x.get("seconds_to_target"))),
                        ("speed-up to same f", lambda x: fmt(x.get("speedup_to_target"))),
                        ("peak RSS MiB", lambda x: fmt(x.get("peak_rss_mib"))),
                        (
                            "fit MiB (peak - before fit)",
                            lambda x: fmt(
                                x["peak_rss_mib"] - x["rss_before_fit_mib"]
                                if "rss_before_fit_mib" in x
                                else None
                            ),
                        ),
                        ("f(A)", lambda x: fmt_objective(x.get("objective"))),
                        ("iters", lambda x: fmt(x.get("n_iter"))),
                        ("1-NN test", lambda x: f"{x['test_acc_1nn']:.4f}"),
                        ("5-NN test", lambda x: f"{x['test_acc_5nn']:.4f}"),
                    ],
                )
            )
    if r.get("kernel"):
        parts.append(
            "\nOne objective + gradient evaluation (exact, fused kernel, d = 32, D = 784):\n"
        )
        parts.append(
            md(
                r["kernel"],
                [
                    ("N", lambda x: fmt(x["n"])),
                    ("s / evaluation", lambda x: fmt(x["seconds_per_evaluation"])),
                    ("GFLOP/s (GEMM-equivalent)", lambda x: fmt(x["gflops"])),
                    ("float32 GEMM ceiling GFLOP/s", lambda x: fmt(x["gemm_ceiling_gflops"])),
                ],
            )
        )
    return "\n".join(parts)


def main():
    r = load("train_vs_sklearn.json")
    if r:
        print("## Training: ours vs scikit-learn\n")
        print(train_tables(r))
    s = load("search_raw_vs_projected.json")
    if s:
        print("\n## Search: raw D against projected d, through service/search/index.py\n")
        data = {
            "usps": "real digits at MNIST size (USPS resampled to 28 x 28, augmented; queries "
            "from held-out source images)",
            "synthetic": "the synthetic 784-dim set",
        }[s.get("data", "synthetic")]
        print(
            f"Data: {data}. {s['n']:,} references, {s['queries']:,} test queries, k = "
            f"{s['k']}, {s['rule']} rule, batches of {s['batch']}, {s['threads']} thread. "
            f"Approximate indexes tuned by `service.search.tuning.tune` on {s['validation']:,} "
            f"validation queries (95 % Wilson lower bound of label agreement >= "
            f"{s['target_label_agreement']}), then judged on the test queries. 'tuner choice' "
            "marks the plan the command picks; the row after a two-stage choice is the best "
            "one-stage setting, for comparison.\n"
        )
        print(
            md(
                s["rows"],
                [
                    ("index", lambda x: x["index"]),
                    ("space / setting", lambda x: x["space"]),
                    ("tuner choice", lambda x: "yes" if x.get("tuner_choice") else ""),
                    ("s for the queries", lambda x: fmt(x["seconds"])),
                    ("speed-up vs raw Flat", lambda x: fmt(x["speedup_vs_raw_flat"])),
                    ("label agreement (test)", lambda x: fmt(x.get("label_agreement"), 4)),
                    ("accuracy delta, points", lambda x: fmt(x.get("accuracy_delta_points"))),
                    ("recall@5", lambda x: fmt(x.get("recall_at_5"), 4)),
                    ("test accuracy", lambda x: fmt(x.get("test_accuracy"), 4)),
                    ("index bytes", lambda x: f"{x['index_bytes']:,}"),
                ],
            )
        )
    c = load("index_cost.json")
    if c:
        print("\n## Cost as N grows (d = 32, through service/search/index.py, one thread)\n")
        print(
            md(
                c["rows"],
                [
                    ("N", lambda x: f"{x['n']:,}"),
                    ("index", lambda x: x["index"]),
                    ("setting (agreement >= target)", lambda x: x["setting"] or "exact"),
                    ("build s", lambda x: fmt(x["build_seconds"])),
                    ("load s", lambda x: fmt(x["load_seconds"])),
                    ("index MiB", lambda x: fmt(x["index_mib"])),
                    ("1 query us", lambda x: fmt(x["single_query_us"])),
                    ("batched q/s", lambda x: fmt(x["batched_queries_per_second"])),
                    ("label agreement", lambda x: fmt(x["label_agreement"], 4)),
                ],
            )
        )
        if c.get("ready"):
            r = c["ready"]
            print(
                f"\nSeconds from `python -m service` to /readyz 200 at N = {r['n']:,} (median of "
                f"3): Flat {fmt(r['flat_seconds_to_ready'])}, IVF built at start "
                f"{fmt(r['ivf_built_at_start_seconds_to_ready'])}, IVF prebuilt in the artifact "
                f"{fmt(r['ivf_prebuilt_seconds_to_ready'])}. Plot: `results/index_cost.png`."
            )
    h = load("http_load.json")
    if h:
        print("\n## HTTP (wrk, loopback, 1 instance of 64 numbers per request)\n")
        print(f"{h['pinning']}; {h['seconds']} s per cell, medians of {h['rounds']} rounds.\n")
        print(
            md(
                h["rows"],
                [
                    ("conns", lambda x: str(x["connections"])),
                    ("server", lambda x: x["server"]),
                    ("req/s", lambda x: fmt(x["requests_per_second"])),
                    ("p50 ms", lambda x: fmt(x["p50_ms"])),
                    ("p99 ms", lambda x: fmt(x["p99_ms"])),
                    ("p99/p50", lambda x: fmt(x["p99_over_p50"])),
                    ("errors", lambda x: str(x["errors"])),
                    ("x naive (best)", lambda x: fmt(x["over_naive_best"])),
                    ("x FastAPI parse-only", lambda x: fmt(x["over_fastapi_noop"])),
                    ("x our parse-only", lambda x: fmt(x["over_our_noop"])),
                ],
            )
        )
        print("\nWorkers (our /v1/classify, exact Flat):\n")
        print(
            md(
                h["workers"],
                [
                    ("setting", lambda x: x["setting"]),
                    ("conns", lambda x: str(x["connections"])),
                    ("req/s", lambda x: fmt(x["requests_per_second"])),
                    ("p50 ms", lambda x: fmt(x["p50_ms"])),
                    ("p99 ms", lambda x: fmt(x["p99_ms"])),
                    ("errors", lambda x: str(x["errors"])),
                ],
            )
        )
        for name, e in h["large_requests"].items():
            print(
                f"\n1,024-row /v1/classify ({name}): JSON {e['json_rows_per_second']:,.0f} "
                f"rows/s, npy body + JSON answer {e['npy_body_rows_per_second']:,.0f} rows/s, "
                f"npy in and out {e['npy_rows_per_second']:,.0f} rows/s "
                f"({e['npy_over_json']:.2f}x JSON)."
            )
    k = load("knca_cost.json")
    if k:
        print(
            f"\n## kNCA cost ({k['data']}, N = {k['n']}, {k['candidates']} candidates per point)\n"
        )
        print(
            md(
                k["rows"],
                [
                    ("objective", lambda x: x["objective"]),
                    ("k", lambda x: str(x["k"])),
                    ("s / epoch", lambda x: fmt(x["seconds_per_epoch"])),
                    ("ratio vs NCA", lambda x: fmt(x["ratio_vs_nca"])),
                ],
            )
        )


def knca_noise_table(r) -> str:
    lines = [
        "| noise | method | k=1 | k=5 | k=10 | k=15 | best (test k) | fit s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = [
        "Euclidean",
        "NCA",
        "kNCA-majority k=5",
        "kNCA-majority k=10",
        "kNCA-all k=5",
        "kNCA-all k=10",
        "LMNN (metric-learn)",
    ]
    runs = sorted(
        r["runs"].values(),
        key=lambda x: (x["noise"], order.index(x["method"]) if x["method"] in order else 99),
    )
    for run in runs:
        acc = {int(k): v for k, v in run["accuracy"].items()}
        best = max(acc, key=acc.get)
        lines.append(
            f"| {run['noise']:.0%} | {run['method']} | {acc[1]:.4f} | {acc[5]:.4f} | {acc[10]:.4f} | "
            f"{acc[15]:.4f} | {acc[best]:.4f} ({best}) | {run['seconds']:.0f} |"
        )
    return "\n".join(lines)


def knca_main():
    r = load("knca_usps_noise.json")
    if r:
        print("\n## kNCA on USPS under label noise (the kNCA paper's Fig. 4)\n")
        print(
            "Votes from the corrupted training labels, accuracy on the true test labels; d = 32. "
            "Plot: `results/knca_usps_noise.png`.\n"
        )
        print(knca_noise_table(r))


def candidate_quality_table(r) -> str:
    """One line per (data, noise, method): test accuracy at k = 1 and 5, seconds, audit."""
    lines = [
        "| data | label noise | method | 1-NN | 5-NN | fit s | audit: largest gap | warned "
        "| K at the end | l2 | exact finish iterations |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    merged: dict[tuple, dict] = {}
    for row in r["rows"]:
        key = (row["data"], row["noise"], row["method"])
        merged.setdefault(key, dict(row))[f"k{row['k']}"] = row["accuracy"]
    for (data, noise, method), row in merged.items():
        gap = row.get("largest_gap")
        lines.append(
            f"| {data} | {noise:.0%} | {method} | {row['k1']:.4f} | {row['k5']:.4f} | "
            f"{fmt(row.get('seconds', '')) if 'seconds' in row else ''} | "
            f"{'' if gap is None else f'{gap:.3f}'} | "
            f"{'' if row.get('warned') is None else row['warned']} | "
            f"{'' if row.get('final_k') is None else row['final_k']} | "
            f"{'' if row.get('l2') is None else format(row['l2'], 'g')} | "
            f"{row.get('finish_iter', '')} |"
        )
    return "\n".join(lines)


def candidate_main():
    r = load("candidate_quality.json")
    if r:
        print(
            f"\n## Candidate sets against exact training (d = {r['d']}, {r['max_iter']} iterations)\n"
        )
        print(candidate_quality_table(r))


if __name__ == "__main__":
    main()
    knca_main()
    candidate_main()
