"""What each table's numbers say: the discussion points computed from a grid table's cells (which differences exceed
seed noise, which heads beat the pretrained floor) and the per-epoch curves, so that they follow the numbers. The
prose around them lives in docs/RESULTS.md itself."""

from __future__ import annotations

from typing import Any

from retrieval.analysis.results import difference


def _rows(block: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["label"]: row for row in block["rows"] if not row.get("floor")}


def _points(delta: float) -> str:
    return f"{100 * delta:+.1f}"


def _complete(*cells: dict[str, Any] | None) -> bool:
    return all(c is not None and c.get("n", 0) > 0 for c in cells)


def discuss_pairs(entry: dict[str, Any], suffix: str, name: str) -> list[str]:
    """Tables 1-2: does adding the method raise Recall@1 (and MAP@R) over the same loss without it?"""
    points = []
    for block in entry["blocks"]:
        rows = _rows(block)
        comparisons = []
        for label, row in rows.items():
            variant = rows.get(f"{label} + {suffix}")
            if variant is None or not _complete(row["cells"].get("recall@1"), variant["cells"].get("recall@1")):
                continue
            d_r1, clear_r1 = difference(variant["cells"]["recall@1"], row["cells"]["recall@1"])
            d_map, _ = difference(variant["cells"]["map@r"], row["cells"]["map@r"])
            comparisons.append((label, d_r1, clear_r1, d_map))
        if not comparisons:
            continue
        better = sum(d > 0 for _, d, _, _ in comparisons)
        clear_up = [c for c in comparisons if c[1] > 0 and c[2]]
        clear_down = [c for c in comparisons if c[1] < 0 and c[2]]
        detail = ", ".join(f"{label} {_points(d)} (MAP@R {_points(m)})" for label, d, _, m in comparisons)
        n = len(comparisons)
        if better == n:
            verdict = ("The paper's direction holds here." if len(clear_up) == n else
                       f"The direction holds for every loss, but only {len(clear_up)} of the {n} gains exceed seed "
                       "noise.")
        else:
            verdict = f"The paper's direction {'holds only in part' if better else 'does not hold'} here."
        points.append(
            f"{block['short']}: + {name} raises Recall@1 for {better} of {n} losses "
            f"({len(clear_up)} beyond seed noise, {len(clear_down)} clearly lower); change in points: {detail}. "
            + verdict
        )
    return points


def discuss_ranking(entry: dict[str, Any]) -> list[str]:
    """Tables 3-4: the order of the methods by Recall@1, and which differences exceed seed noise."""
    points = []
    for block in entry["blocks"]:
        rows = [r for r in _rows(block).values() if _complete(r["cells"].get("recall@1"))]
        if len(rows) < 2:
            continue
        rows.sort(key=lambda r: -r["cells"]["recall@1"]["mean"])
        order = " > ".join(f"{r['label']} ({100 * r['cells']['recall@1']['mean']:.1f})" for r in rows)
        top, second = rows[0], rows[1]
        _, clear = difference(top["cells"]["recall@1"], second["cells"]["recall@1"])
        points.append(f"{block['short']}: Recall@1 order {order}; the lead of {top['label']} over {second['label']} "
                      f"is {'beyond' if clear else 'within'} seed noise.")
    return points


def discuss_sct(entry: dict[str, Any]) -> list[str]:
    """Table 3: the ranking, and how the share of hard triplets moves from the first epoch to the last."""
    points = discuss_ranking(entry)
    for block in entry["blocks"]:
        finals = []
        for row in _rows(block).values():
            curves = [c for c in row.get("curves", []) if c]
            if curves:
                finals.append(f"{row['label']} {100 * sum(c[0] for c in curves) / len(curves):.0f}% -> "
                              f"{100 * sum(c[-1] for c in curves) / len(curves):.0f}%")
        if finals:
            points.append(f"{block['short']}: share of hard triplets in the training batches, first -> last epoch: "
                          + "; ".join(finals) + " (figure below).")
    return points


def discuss_unified(entry: dict[str, Any]) -> list[str]:
    """Table 4: the ranking, and what VTHM mining changes for binomial deviance and for RAW."""
    points = discuss_ranking(entry)
    for block in entry["blocks"]:
        rows = _rows(block)
        for base, mined in (("binomial", "binomial + VTHM"), ("RAW", "RAW + VTHM (= MS)")):
            if base in rows and mined in rows and _complete(rows[base]["cells"].get("recall@1"),
                                                            rows[mined]["cells"].get("recall@1")):
                d, clear = difference(rows[mined]["cells"]["recall@1"], rows[base]["cells"]["recall@1"])
                points.append(f"{block['short']}: VTHM changes {base}'s Recall@1 by {_points(d)} points "
                              f"({'beyond' if clear else 'within'} seed noise).")
    return points


def discuss_dcdl(entry: dict[str, Any]) -> list[str]:
    """Table 5: per discrepancy term, in how many (loss, noise) cells it raises the linear probe's accuracy."""
    points = []
    columns = [c["key"] for c in entry["columns"]]
    for phi in ("MMD-Laplacian", "Sinkhorn"):
        wins = clear_wins = clear_losses = total = 0
        deltas = []
        for block in entry["blocks"]:
            rows = _rows(block)
            local = block["short"]
            alone, added = rows.get(local), rows.get(f"{local} + {phi}")
            if alone is None or added is None:
                continue
            for column in columns:
                if not _complete(alone["cells"].get(column), added["cells"].get(column)):
                    continue
                d, clear = difference(added["cells"][column], alone["cells"][column])
                total += 1
                wins += d > 0
                clear_wins += d > 0 and clear
                clear_losses += d < 0 and clear
                deltas.append(d)
        if total:
            points.append(f"+ {phi}: higher linear-probe accuracy than the local loss alone in {wins} of {total} "
                          f"(loss, noise) cells ({clear_wins} beyond seed noise, {clear_losses} clearly lower); "
                          f"mean change {_points(sum(deltas) / len(deltas))} points, from {_points(min(deltas))} "
                          f"to {_points(max(deltas))}.")
    return points


def discuss_floor(entry: dict[str, Any]) -> list[str]:
    """How many trained heads end above the pretrained-only features, per block and column that matter."""
    points = []
    columns = ["recall@1", "map@r"] if any(c["key"] == "map@r" for c in entry["columns"]) else \
        [c["key"] for c in entry["columns"]]
    for block in entry["blocks"]:
        floor = next((r for r in block["rows"] if r.get("floor")), None)
        if floor is None:
            continue
        parts = []
        for column in columns:
            base = floor["cells"].get(column)
            rows = [r for r in _rows(block).values() if _complete(base, r["cells"].get(column))]
            if rows:
                above = sum(r["cells"][column]["mean"] > base["mean"] for r in rows)
                label = next(c["label"] for c in entry["columns"] if c["key"] == column)
                parts.append(f"{above} of {len(rows)} above it on {label}")
        if parts:
            points.append(f"{block['short']}: against the pretrained-only floor, " + ", ".join(parts) + ".")
    return points


def discuss_proxy(entry: dict[str, Any]) -> list[str]:
    """Table 6: the ranking, where the best proxy loss stands against MS, and what the memory adds to each loss."""
    points = discuss_ranking(entry) + discuss_pairs(entry, "XBM", "XBM")
    proxies = ("Proxy-Anchor", "ProxyNCA++", "NormSoftmax", "CosFace", "ArcFace", "SoftTriple")
    for block in entry["blocks"]:
        rows = _rows(block)
        done = [rows[label] for label in proxies if label in rows and _complete(rows[label]["cells"].get("recall@1"))]
        ms = rows.get("MS")
        if not done or ms is None or not _complete(ms["cells"].get("recall@1")):
            continue
        best = max(done, key=lambda r: r["cells"]["recall@1"]["mean"])
        delta, clear = difference(best["cells"]["recall@1"], ms["cells"]["recall@1"])
        verdict = ("the proxy papers' claim holds here" if delta > 0 and clear else
                   "the proxy papers' claim does not hold here" if delta < 0 and clear else
                   "within seed noise of each other")
        points.append(f"{block['short']}: the best proxy loss, {best['label']}, is {_points(delta)} Recall@1 points "
                      f"from MS: {verdict}.")
    return points


DISCUSSIONS = {
    "proxy": discuss_proxy,
    "loop": lambda e: discuss_pairs(e, "LoOp", "LoOp"),
    "symm": lambda e: discuss_pairs(e, "Symm", "Symm"),
    "sct": discuss_sct,
    "unified": discuss_unified,
    "dcdl": discuss_dcdl,
}


def curves(tables: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Seed-averaged per-epoch curves of the tables that record one (SCT Figure 6)."""
    out = []
    for table in tables:
        series = {}
        for block in table["blocks"]:
            lines = {}
            for row in _rows(block).values():
                runs = [c for c in row.get("curves", []) if c]
                if runs:
                    length = min(len(c) for c in runs)
                    lines[row["label"]] = [sum(c[i] for c in runs) / len(runs) for i in range(length)]
            if lines:
                series[block["short"]] = lines
        if series:
            out.append({"id": table["id"], "title": "Share of hard triplets in the training batches (SCT Figure 6)",
                        "ylabel": "hard triplets (S_an > S_ap)", "series": series})
    return out
