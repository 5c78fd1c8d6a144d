"""Which ``metrics.jsonl`` keys make which curve: the viewer's panels and the report's plots.

A panel lists exact keys (``rollout/reward``) and key fragments (``stale``
matches any key holding it), so a key the trainer adds later under a
fragment's name shows up without a change here. ``eval/*`` keys are the
held-out evaluations: drawn as points, not lines. Two series are derived from
the rows: ``rollout/tokens_per_s`` (generated tokens over rollout seconds) and
``ppo/clip_frac`` (the low and high clip fractions summed).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["PANELS", "Panel", "curve_panels", "series"]

# (title, exact keys, key fragments, what the page says when none is logged)
Panel = tuple[str, tuple[str, ...], tuple[str, ...], str]

PANELS: tuple[Panel, ...] = (
    ("reward", ("rollout/reward", "eval/reward"), (), ""),
    ("success", ("rollout/success", "eval/success"), (), ""),
    ("KL", ("mismatch/kl", "ppo/approx_kl", "loss/kl", "distill/reverse_kl"), (), ""),
    ("entropy", ("loss/entropy_mean", "loss/entropy"), (), ""),
    ("clip fraction", ("ppo/clip_frac", "ppo/clip_frac_low", "ppo/clip_frac_high", "ppo/clip_frac_dual"), (), ""),
    ("staleness", (), ("stale",), "no staleness key in this run's metrics (the trainer logs one when "
                                  "rollouts and updates overlap; in-process training is on-policy: 0)"),
    ("tokens/s", ("train/tokens_per_s", "rollout/tokens_per_s"), (), ""),
)


def _num(v: Any) -> float | None:
    """``v`` as a finite float; None for anything else (text, NaN, an integer past float's range)."""
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int):
        v = float(v) if -1e308 < v < 1e308 else math.inf  # float() of a 400-digit integer raises
    if isinstance(v, float) and math.isfinite(v):
        return v
    return None


def _derived(row: dict[str, Any]) -> dict[str, float]:
    out = {}
    gen, secs = _num(row.get("rollout/generated_tokens")), _num(row.get("time/rollout_s"))
    if gen is not None and secs:
        out["rollout/tokens_per_s"] = gen / secs
    lo, hi = _num(row.get("ppo/clip_frac_low")), _num(row.get("ppo/clip_frac_high"))
    if lo is not None and hi is not None:
        out["ppo/clip_frac"] = lo + hi
    return out


def series(rows: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """``(step, value)`` of ``key`` over the rows that hold a finite number for it."""
    out = []
    for row in rows:
        v = _num(row.get(key, _derived(row).get(key)))
        step = _num(row.get("step"))
        if v is not None and step is not None:
            out.append((step, v))
    return out


def curve_panels(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every panel of ``PANELS`` with its series (JSON-ready); a panel without data keeps
    its note so the page can say why it is empty."""
    keys = dict.fromkeys(k for row in rows for k in (*row, *_derived(row)))
    out = []
    for title, exact, fragments, missing in PANELS:
        names = [k for k in exact if k in keys]
        names += [k for k in keys if any(f in k for f in fragments) and k not in names]
        if title == "clip fraction" and "ppo/clip_frac" in names:  # the sum stands for its parts
            names = [k for k in names if k not in ("ppo/clip_frac_low", "ppo/clip_frac_high")]
        out.append({"title": title, "missing": missing or "not logged by this run",
                    "series": [{"key": k, "eval": k.startswith("eval/"),
                                "points": [list(p) for p in series(rows, k)]} for k in names]})
    return out
