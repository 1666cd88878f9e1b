"""The generate suite's Markdown tables: attnlab against transformers in every case, and a
row per engine and precision in the batch-1 cases (:func:`summary_table`)."""

from __future__ import annotations

from . import first_token
from .engines import BASELINE, CEILING, REFERENCE


def summary_table(records: list[dict]) -> str:
    """Markdown: per case, attnlab's and transformers' tokens/s, their peaks over the
    weights' bytes, and attnlab's share of the ceiling and of transformers' speed
    (empty where no case has both); then :func:`engines_table` where it has rows."""
    return "\n\n".join(t for t in (_attnlab_table(records), engines_table(records)) if t)


def _attnlab_table(records: list[dict]) -> str:
    lines = ["| case | attnlab | transformers | peak / weights (attnlab, transformers) "
             "| attnlab: share of the ceiling, x transformers' tokens/s |",
             "|---|---:|---:|---:|---:|"]
    for case in dict.fromkeys(r["case"] for r in records):
        by_impl = {r["impl"]: r for r in records if r["case"] == case}
        ours, peer = by_impl.get("attnlab", {}), by_impl.get(BASELINE, {})
        if not ours.get("tokens_per_s") or not peer.get("tokens_per_s"):
            continue
        peaks = ", ".join("-" if r.get("peak_x_weights") is None else f"{r['peak_x_weights']:.2f}x"
                          for r in (ours, peer))
        share = "-" if ours.get("of_ceiling") is None else f"{ours['of_ceiling']:.0%}"
        name = case.split(" +")[0]
        lines.append(f"| {name} | {ours['tokens_per_s']:.1f} tok/s | {peer['tokens_per_s']:.1f} "
                     f"tok/s | {peaks} ({ours['weight_mb']:.0f} MB) | {share}, "
                     f"{ours['tokens_per_s'] / peer['tokens_per_s']:.2f}x |")
    return "\n".join(lines) if len(lines) > 2 else ""


def engines_table(records: list[dict]) -> str:
    """Markdown: a row per engine and precision in every batch-1 case that has one beyond
    attnlab and transformers (a peer, attnlab's bf16 or int8, the read bandwidth):
    tokens/s, x attnlab float32's, its greedy tokens equal to attnlab's, peak memory, the
    weights it reads per token, its share of the one-row ceiling and of the read bound;
    then its time to the first token and the decoding steps' rate after it, with that
    rate's share of the read bound (:mod:`.first_token`)."""
    lines = ["| case | engine | tokens/s | x attnlab | tokens = attnlab's | peak MB (x weights) "
             "| weights read per token | of the one-row ceiling | of the read bound "
             "| first token | decode tok/s | decode: of the read bound |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    plain = {REFERENCE, BASELINE, CEILING, "attnlab-nocache"}
    for case in dict.fromkeys(r["case"] for r in records):
        rows = [r for r in records if r["case"] == case]
        if all(r["impl"] in plain or first_token.is_twin(r["impl"]) for r in rows):
            continue
        ours = next((r for r in rows if r["impl"] == REFERENCE), {})
        for r in rows:
            if r.get("gb_per_s") is not None:
                lines.append(f"| {case} | {r['impl']} | {r['gb_per_s']:.1f} GB/s "
                             "| | | | | | | | | |")
            if not r.get("tokens_per_s"):
                continue
            speed = (f"{r['tokens_per_s'] / ours['tokens_per_s']:.2f}x"
                     if ours.get("tokens_per_s") else "-")
            agree = (f"{r['tokens_agree']}/{r['tokens_checked']}"
                     if r.get("tokens_agree") is not None else "-")
            peak = (f"{r['peak_mb']:.0f} ({r['peak_x_weights']:.2f}x)"
                    if r.get("peak_x_weights") is not None else "-")
            per_token = (f"{r['bytes_per_token'] / 2**20:.0f} MB"
                         if r.get("bytes_per_token") else "-")
            shares = ["-" if r.get(k) is None else f"{r[k]:.0%}"
                      for k in ("of_ceiling", "of_bound")]
            decode = ["-" if r.get("first_token_ms") is None else f"{r['first_token_ms']:.1f} ms",
                      "-" if r.get("decode_tokens_per_s") is None
                      else f"{r['decode_tokens_per_s']:.1f}",
                      "-" if r.get("decode_of_bound") is None else f"{r['decode_of_bound']:.0%}"]
            lines.append(f"| {case} | {r['impl']} | {r['tokens_per_s']:.1f} | {speed} | {agree} "
                         f"| {peak} | {per_token} | {' | '.join(shares + decode)} |")
    return "\n".join(lines) if len(lines) > 2 else ""
