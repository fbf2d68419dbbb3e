"""Writing a feature cache: the target run once over tokenized conversations, stored in shards.

    manifest = write_cache(target, convs, "cache/", layer_ids=[1, 14, 15, 26], dtype="bfloat16", precision="bf16")

Resumable: the shard plan is a function of the token lengths and the settings, so a restart
recomputes it; a shard counts as written when its file and its sidecar (``shard-K.safetensors.json``:
rows, bytes, sha256) are both in place with matching sizes. Every file is written under a temporary
name, fsync'ed and renamed, so a kill leaves at worst a ``*.tmp-*`` file (removed on restart) or a
shard without a sidecar (redone). Nothing already written is rewritten. ``finalize_cache`` merges the
sidecars into ``index.jsonl`` and marks the manifest complete.

Under ``torchrun`` each rank writes the shards ``k % world == rank`` (``rank``, ``world``); one
process then calls ``finalize_cache``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from vatspec.features.format import (
    FORMAT,
    FORMAT_VERSION,
    HIDDEN_KEY,
    IDS_KEY,
    INDEX,
    MANIFEST,
    MASK_KEY,
    PRECISIONS,
    FeatureCacheError,
    atomic_write,
    bytes_per_token,
    chat_template_sha256,
    conversations_sha256,
    file_sha256,
    fsync_dir,
    layer_key,
    read_manifest,
    shard_name,
    storage_dtype,
    target_identity,
    token_hash,
    tokenizer_sha256,
    write_failure,
    write_manifest,
)
from vatspec.outputs import user_mode

# manifest fields a restart must find unchanged (the rest are outcomes: sizes, checksums, timings)
SETTINGS = ("target", "tokenizer_sha256", "chat_template_sha256", "chat_template_kwargs", "layer_ids", "dtype",
            "precision", "max_length", "source", "shard_size")


def plan_shards(lengths: Sequence[int], bytes_per_tok: int, shard_size: int) -> list[tuple[int, int]]:
    """Consecutive conversations ``[start, end)`` per shard: a new shard starts when the next
    conversation would take this one past ``shard_size`` bytes (a shard holds at least one)."""
    plan, start, size = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and size + n * bytes_per_tok > shard_size:
            plan.append((start, i))
            start, size = i, 0
        size += n * bytes_per_tok
    if start < len(lengths):
        plan.append((start, len(lengths)))
    return plan


def write_cache(
    target,
    convs: Sequence,
    out: str | Path,
    *,
    layer_ids: Sequence[int],
    dtype: str = "bfloat16",
    precision: str = "fp32",
    shard_size: int = 1 << 30,
    max_length: int = 2048,
    batch_size: int = 8,
    source: str = "",
    template=None,
    rank: int = 0,
    world: int = 1,
    finalize: bool = True,
    progress: bool = True,
    on_shard: Callable[[int], None] | None = None,
) -> dict:
    """Run ``target`` over ``convs`` (every one, in order: the training split is computed on this
    list) and write the cache to ``out``; return its manifest (complete when ``finalize``). One function:
    the checks, the plan, the resume state and the shard loop all read the same manifest in order.

    layer_ids:  captured layers (this project's ids: output of layer i), stored sorted, no repeats.
    dtype:      storage dtype of the features and hidden states: bfloat16 | float16 | float32.
    precision:  the target pass's arithmetic: ``fp32`` (the target's dtype) or ``bf16`` (bfloat16 autocast,
                as ``train.precision=bf16`` runs the target online: a run at that precision then trains
                from the cache as it would online; faster where the CPU multiplies bf16 in hardware,
                AVX512-BF16 or AMX).
    shard_size: bytes per shard file (a shard holds whole conversations, at least one).
    template:   the ``ChatTemplate`` the conversations are rendered with, as served (None: the tokenizer's own,
                no arguments); its arguments and date are recorded in the manifest.
    batch_size: conversations per target forward (within a shard, longest first, to pad little).
    on_shard:   called with k after shard k is in place (tests use it to simulate a kill).
    The returned manifest carries ``written``: shards, tokens and seconds of this call (not saved).
    Raises ``FeatureCacheError`` when ``out`` holds another cache or the target returns a non-finite value,
    ``DataError`` for a conversation the chat template cannot render.
    """
    from vatspec import data as D

    out = Path(out)
    layer_ids = sorted(dict.fromkeys(int(i) for i in layer_ids))
    if not layer_ids:
        raise FeatureCacheError("no layer ids to capture (pass --layers or --drafter)")
    target.check_layer_ids(layer_ids)
    sdt = storage_dtype(dtype)
    if precision not in PRECISIONS:
        raise FeatureCacheError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    tok = target.tokenizer
    template = template or D.ChatTemplate()
    examples = [D.tokenize_conversation(c, tok, max_length, template) for c in convs]
    if not examples:
        raise FeatureCacheError(f"{source or 'the data'}: no conversations to cache")
    bpt = bytes_per_token(len(layer_ids), target.hidden_size, dtype)
    plan = plan_shards([len(e) for e in examples], bpt, shard_size)
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "complete": False,
        "target": target_identity(target),
        "tokenizer_sha256": tokenizer_sha256(tok), "chat_template_sha256": chat_template_sha256(tok),
        "chat_template_kwargs": dict(sorted(template.kwargs.items())),
        **({"chat_template_date": template.date} if template.date else {}),
        "layer_ids": layer_ids, "hidden": "final-normed last hidden state (what the lm_head reads)",
        "dtype": dtype, "precision": precision, "max_length": max_length,
        "source": {"path": str(source), "conversations": len(convs), "sha256": conversations_sha256(convs)},
        "shard_size": shard_size, "bytes_per_token": bpt,
        "conversations": len(examples), "tokens": sum(len(e) for e in examples),
        "shards": [{"file": shard_name(k), "rows": [a, b], "tokens": sum(len(e) for e in examples[a:b])}
                   for k, (a, b) in enumerate(plan)],
        "vatspec_version": _version(),
    }
    out.mkdir(parents=True, exist_ok=True)
    existing = _resume_state(out, manifest)
    if existing is not None and existing.get("complete"):
        return {**existing, "written": {"shards": 0, "tokens": 0, "seconds": 0.0}}
    if rank == 0:
        write_manifest(out, manifest)
    for stale in out.glob("*.tmp-*"):  # a killed run's unfinished files: each rank removes its own shards'
        k = _shard_of(stale.name)
        if (k is None and rank == 0) or (k is not None and k % world == rank):
            stale.unlink(missing_ok=True)

    pad_id = tok.pad_token_id if tok.pad_token_id is not None else target.eos_token_ids[0]
    from tqdm.auto import tqdm

    mine = [k for k in range(len(plan)) if k % world == rank]
    todo = [k for k in mine if not _shard_done(out, k)]
    if todo and target.device.type == "meta":
        raise FeatureCacheError(f"{out}: {len(todo)} shard(s) are not written yet, and a target on the meta device "
                                "has no weights to compute them; finish every part first")
    bar = tqdm(total=sum(manifest["shards"][k]["tokens"] for k in todo), unit="tok", desc="cache-features",
               disable=not progress)
    t0 = time.perf_counter()
    for k in todo:
        a, b = plan[k]
        tensors, rows = _compute_shard(target, examples[a:b], a, layer_ids, sdt, precision, batch_size, pad_id, bar)
        _write_shard(out, k, tensors, rows, {"layer_ids": layer_ids, "dtype": dtype})
        if on_shard is not None:
            on_shard(k)
    bar.close()
    written = {"shards": len(todo), "tokens": sum(manifest["shards"][k]["tokens"] for k in todo),
               "seconds": time.perf_counter() - t0}
    if finalize and world == 1:
        manifest = finalize_cache(out)
    return {**manifest, "written": written}


def finalize_cache(out: str | Path) -> dict:
    """Merge the shards' sidecars into ``index.jsonl``, record each shard's bytes and sha256 in the
    manifest and mark it complete; then remove the sidecars. Every shard must be written."""
    out = Path(out)
    manifest = read_manifest(out)
    if manifest.get("complete"):
        return manifest
    missing = [s["file"] for k, s in enumerate(manifest["shards"]) if not _shard_done(out, k)]
    if missing:
        raise FeatureCacheError(f"{out}: {len(missing)} of {len(manifest['shards'])} shards are not written yet "
                                f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); rerun "
                                "vatspec cache-features to write them")
    lines = []
    for k, shard in enumerate(manifest["shards"]):
        side = json.loads(_sidecar(out, k).read_text())
        shard.update(bytes=side["bytes"], sha256=side["sha256"])
        lines += [json.dumps(r, ensure_ascii=False) for r in side["rows"]]
    index = ("\n".join(lines) + "\n").encode("utf-8")
    atomic_write(out / INDEX, index)
    manifest["index_sha256"] = hashlib.sha256(index).hexdigest()
    manifest["complete"] = True
    write_manifest(out, manifest)
    for k in range(len(manifest["shards"])):
        _sidecar(out, k).unlink(missing_ok=True)
    return manifest


# ----------------------------------------------------------------------------- pieces
def _version() -> str:
    from vatspec import __version__

    return __version__


def _shard_of(name: str) -> int | None:
    """k of ``shard-0000k.safetensors*``, None for other files."""
    head = name.split(".", 1)[0]
    return int(head[len("shard-"):]) if head.startswith("shard-") and head[len("shard-"):].isdigit() else None


def _sidecar(out: Path, k: int) -> Path:
    return out / (shard_name(k) + ".json")


def _shard_done(out: Path, k: int) -> bool:
    """Shard k is in place: its sidecar exists and its file has the size the sidecar recorded
    (a truncated or missing file is a torn shard, redone)."""
    side, path = _sidecar(out, k), out / shard_name(k)
    if not side.is_file() or not path.is_file():
        return False
    try:
        return json.loads(side.read_text())["bytes"] == path.stat().st_size
    except (OSError, ValueError, KeyError):
        return False


def _resume_state(out: Path, manifest: dict) -> dict | None:
    """The manifest already in ``out`` (None if there is none). Refuses a folder that holds anything
    else or a cache with other settings; a complete cache with a missing or torn shard is reopened
    for repair (sidecars rebuilt from its index for the intact shards)."""
    if not (out / MANIFEST).is_file():
        foreign = [p.name for p in out.iterdir() if not p.name.startswith(("shard-", INDEX)) and ".tmp-" not in p.name]
        if foreign:
            raise FeatureCacheError(f"{out} is not empty and holds no {MANIFEST} (found {foreign[0]}); "
                                    "choose another --out")
        return None
    old = read_manifest(out)
    for key in SETTINGS:
        if key not in old or _setting(old[key]) != _setting(manifest[key]):
            raise FeatureCacheError(f"{out} holds a cache written with other settings ({key} differs); "
                                    "choose another --out, or delete it to rebuild")
    if not old.get("complete"):
        return old
    broken = [s["file"] for s in old["shards"]
              if not (out / s["file"]).is_file() or (out / s["file"]).stat().st_size != s["bytes"]]
    if not broken:
        return old
    rows = [json.loads(line) for line in (out / INDEX).read_text().splitlines() if line.strip()]
    for k, s in enumerate(old["shards"]):
        if s["file"] in broken:
            (out / s["file"]).unlink(missing_ok=True)
            continue
        a, b = s["rows"]
        side = {"bytes": s["bytes"], "sha256": s["sha256"], "rows": rows[a:b]}
        atomic_write(_sidecar(out, k), json.dumps(side).encode())
    return None


def _setting(value) -> str:
    """A setting as compared on restart: a moved target or data file (``path``) is the same one."""
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if k != "path"}
    return json.dumps(value, sort_keys=True)


@torch.no_grad()
def _compute_shard(target, examples, first_row: int, layer_ids, sdt, precision: str, batch_size: int, pad_id: int,
                   bar):
    """The shard's tensors (conversations in data order) and its index rows."""
    from vatspec import data as D
    from vatspec.target.precision import precision_context

    lengths = [len(e) for e in examples]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    N, H = offsets[-1], target.hidden_size
    feats = {layer_key(i): torch.empty(N, H, dtype=sdt) for i in layer_ids}
    hidden = torch.empty(N, H, dtype=sdt)
    order = sorted(range(len(examples)), key=lambda j: -lengths[j])  # longest first: little padding
    for s in range(0, len(order), batch_size):
        idx = order[s : s + batch_size]
        batch = D.collate([examples[j] for j in idx], pad_id).to(target.device)
        with precision_context(target.device, precision):
            tout = target(batch.input_ids, batch.attention_mask, layer_ids, logits=False)
        f = tout.features.to("cpu", torch.float32)  # [B, T, n*H]
        h = tout.hidden.to("cpu", torch.float32)  # [B, T, H]
        for b, j in enumerate(idx):
            n, o = lengths[j], offsets[j]
            if not (torch.isfinite(f[b, :n]).all() and torch.isfinite(h[b, :n]).all()):
                raise FeatureCacheError(f"conversation {examples[j].id!r}: the target returned a non-finite value "
                                        "(NaN or inf); nothing of its shard was written")
            for c, i in enumerate(layer_ids):
                feats[layer_key(i)][o : o + n] = f[b, :n, c * H : (c + 1) * H]
            hidden[o : o + n] = h[b, :n]
            bar.update(n)
    ids = torch.tensor([t for e in examples for t in e.input_ids], dtype=torch.int32)
    mask = torch.tensor([m for e in examples for m in e.loss_mask], dtype=torch.uint8)
    rows = [{"id": e.id, "row": first_row + j, "offset": offsets[j], "length": lengths[j],
             "supervised": int(sum(e.loss_mask)), "token_hash": token_hash(e.input_ids)}
            for j, e in enumerate(examples)]
    return {IDS_KEY: ids, MASK_KEY: mask, **feats, HIDDEN_KEY: hidden}, rows


def _write_shard(out: Path, k: int, tensors: dict, rows: list[dict], meta: dict) -> None:
    """shard file: tmp -> fsync -> sha256 -> rename -> fsync folder; then its sidecar, the same way."""
    from safetensors.torch import save_file

    final = out / shard_name(k)
    tmp = final.with_name(final.name + f".tmp-{os.getpid()}")
    with write_failure(final, tmp):
        # one metadata key: safetensors writes several in hash order, and a shard's bytes must be reproducible
        save_file(tensors, tmp, metadata={FORMAT: json.dumps({"format_version": FORMAT_VERSION, **meta},
                                                              sort_keys=True)})
        user_mode(tmp)  # a cache is read by other users and jobs
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        sha = file_sha256(tmp)
        size = tmp.stat().st_size
        os.replace(tmp, final)
    fsync_dir(out)
    for r in rows:
        r["shard"] = final.name
    side = {"bytes": size, "sha256": sha, "rows": rows}
    atomic_write(_sidecar(out, k), json.dumps(side).encode())
