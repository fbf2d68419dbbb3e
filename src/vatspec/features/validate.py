"""Validating a feature cache: every shard re-read and checked, and a sample of rows compared with
a fresh target forward (``vatspec cache-features --validate DIR``).

    report = validate_cache("cache/", target)   # target None: opened from the manifest's target path
    report.ok, report.problems, report.summary
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vatspec.features.format import FeatureCacheError, check_target, layer_key
from vatspec.features.reader import FeatureCache

# Largest relative error ||cached - fresh|| / ||fresh|| (per row and tensor, fresh rounded to the storage
# dtype) accepted. Caused by the compute, not the storage: another batch composition changes the
# float rounding of the forward, ~1e-6 in float32 and ~1e-2 in bfloat16 after 30 layers. A wrong
# layer is off by 0.1 or more (neighbouring layers of SmolLM2 differ by ~0.2).
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}


@dataclass
class ValidationReport:
    problems: list[str] = field(default_factory=list)
    summary: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


def validate_cache(root: str | Path, target=None, *, sample: int = 4, seed: int = 0) -> ValidationReport:
    """Check the cache in ``root``: manifest and index, then every shard (size, sha256, tensor shapes
    and dtypes, finite values, token hashes), then ``sample`` rows against ``target`` run afresh.
    ``target`` None: the manifest's target path is opened (on the CPU, in the dtype the cache was
    computed in). Problems are collected, one line each, rather than raised."""
    root = Path(root)
    rep = ValidationReport()
    try:
        cache = FeatureCache(root, check_files=False)
    except FeatureCacheError as e:
        rep.problems.append(str(e))
        return rep
    m = cache.manifest
    good = []
    for k in range(len(m["shards"])):
        try:
            cache.verify_shard(k)
            good.append(k)
        except FeatureCacheError as e:
            rep.problems.append(str(e))
    rep.summary = {"conversations": m["conversations"], "tokens": m["tokens"], "shards": len(m["shards"]),
                   "bytes": sum(s["bytes"] for s in m["shards"]), "layer_ids": m["layer_ids"], "dtype": m["dtype"],
                   "precision": cache.precision, "shards_ok": len(good)}
    rep.summary["bytes_per_token"] = rep.summary["bytes"] / max(1, m["tokens"])
    if sample <= 0 or not good:
        return rep
    if target is None:
        from vatspec.target import TargetError, open_target

        path = m["target"].get("path")
        try:
            target = open_target(path, device="cpu", dtype=m["target"]["dtype"])
        except TargetError as e:
            rep.problems.append(f"cannot open the cache's target to compare a sample ({e}); pass --target")
            return rep
    try:
        from vatspec.data.chat import ChatTemplate

        # the rows' token ids are stored: the same target is asked, not another rendering
        recorded = ChatTemplate(kwargs=m.get("chat_template_kwargs") or {}, date=m.get("chat_template_date"))
        check_target(m, target, template=recorded, what="--target")
    except FeatureCacheError as e:
        rep.problems.append(str(e))
        return rep
    rows = [i for k in good for i in range(*m["shards"][k]["rows"])]
    picked = sorted(random.Random(seed).sample(rows, min(sample, len(rows))))
    worst = _compare(cache, target, picked, rep)
    rep.summary.update(sampled=len(picked), max_rel_error=worst)
    return rep


@torch.no_grad()
def _compare(cache: FeatureCache, target, rows: list[int], rep: ValidationReport) -> float:
    """Fresh forward of each row alone; per tensor, the relative error against the cached one."""
    from vatspec.target.precision import precision_context

    # a pass in bfloat16 products (target dtype or autocast) rounds as they do, whatever the storage
    tol = max(TOLERANCE[cache.manifest["dtype"]], TOLERANCE.get(cache.manifest["target"]["dtype"], 0.0),
              TOLERANCE["bfloat16"] if cache.precision == "bf16" else 0.0)
    worst = 0.0
    for i, ex in zip(rows, cache.examples(rows)):
        ids = torch.tensor([ex.input_ids], device=target.device)
        with precision_context(target.device, cache.precision):
            fresh = target(ids, torch.ones_like(ids), cache.layer_ids, logits=False)
        feats, hidden = cache.read(i, cache.layer_ids)
        H = cache.hidden_size
        pairs = {layer_key(l): (feats[:, c * H : (c + 1) * H], fresh.features[0, :, c * H : (c + 1) * H])
                 for c, l in enumerate(cache.layer_ids)}
        pairs["hidden"] = (hidden, fresh.hidden[0])
        for key, (have, want) in pairs.items():
            want = want.cpu().to(cache.dtype).float()
            err = float((have.float() - want).norm() / want.norm().clamp_min(1e-12))
            worst = max(worst, err)
            if err > tol:
                rep.problems.append(f"conversation {ex.id!r} (index row {i}): {key} differs from a fresh target "
                                    f"forward by {err:.2e} relative (tolerance {tol:.0e}): wrong layer or target")
    return worst
