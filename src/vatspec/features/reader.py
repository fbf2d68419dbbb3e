"""Reading a feature cache: ``FeatureCache`` (manifest, index, checked shard reads) and ``CachedTarget``,
a stand-in for ``Target`` whose forward reads the cache instead of running the model.

    cache = FeatureCache("cache/")                      # complete, index checksum, every shard present
    cache.check_run(target, {"eagle3": [1, 14, 26]}, max_length=2048)
    examples = cache.examples(range(len(cache)))        # token ids + loss masks, as tokenize_conversation
    cache.verify_rows(examples)                         # the shards these rows live in: sha256, shapes, finite
    source = CachedTarget(target, [cache])
    tout = source(batch.input_ids, batch.attention_mask, layer_ids, logits_at=at)   # a TargetOutput

A batch finds its rows by the token hash of each sequence (the index key), so batching, shuffling
and padding stay exactly those of online training. Shards are memory-mapped (safetensors) and read
row by row: memory stays bounded by the batch, whatever the cache's size.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from vatspec.features.format import (
    HIDDEN_KEY,
    IDS_KEY,
    INDEX,
    MASK_KEY,
    FeatureCacheError,
    check_layers,
    check_max_length,
    check_target,
    file_sha256,
    layer_key,
    manifest_precision,
    read_manifest,
    storage_dtype,
    token_hash,
)
from vatspec.target import TargetOutput

OPEN_SHARDS = 16  # memory-mapped shard files kept open (least recently used closed first)
FINITE_CHUNK = 1 << 14  # rows per chunk of the non-finite scan (bounded memory)


class FeatureCache:
    """A complete feature cache, opened: ``manifest``, ``rows`` (the index, in data order), reads.

    Opening checks the manifest (format, complete), the index (its sha256, one row per conversation,
    offsets consecutive within each shard) and that every shard file exists with its recorded size
    (a missing or truncated shard fails here, before anything is read). The content of a shard
    (sha256, tensor shapes, finite values, token hashes) is checked by ``verify_shard`` / ``verify_rows``
    before its features are used.
    """

    def __init__(self, root: str | Path, *, check_files: bool = True):
        self.root = Path(root)
        m = read_manifest(self.root)
        if not m.get("complete"):
            done = sum(1 for s in m["shards"] if (self.root / (s["file"] + ".json")).is_file())
            raise self._error(f"the cache is incomplete ({done} of {len(m['shards'])} shards "
                              "written); rerun vatspec cache-features with the same arguments to finish it")
        self.manifest = m
        self.layer_ids: list[int] = list(m["layer_ids"])
        self.hidden_size: int = int(m["target"]["hidden_size"])
        self.dtype: torch.dtype = storage_dtype(m["dtype"])
        self.precision: str = manifest_precision(m)  # the target pass's arithmetic: fp32 | bf16
        index = self.root / INDEX
        if not index.is_file():
            raise self._error(f"{INDEX} is missing")
        raw = index.read_bytes()
        if hashlib.sha256(raw).hexdigest() != m.get("index_sha256"):
            raise self._error(f"{INDEX}: sha256 differs from the manifest's index_sha256 (the index changed "
                              "after the cache was written)")
        self.rows: list[dict] = [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]
        if len(self.rows) != m["conversations"]:
            raise self._error(f"{INDEX}: {len(self.rows)} rows, the manifest says {m['conversations']}")
        self._check_layout()
        if check_files:
            for k in range(len(m["shards"])):
                self.check_file(k)
        self._row_of: dict[str, int] = {}
        for i, r in enumerate(self.rows):
            self._row_of.setdefault(r["token_hash"], i)  # equal tokens, equal features: the first serves
        self._starts = [s["rows"][0] for s in self.manifest["shards"]]  # first index row of each shard
        self._handles: OrderedDict[str, object] = OrderedDict()
        self._verified: set[int] = set()

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def ids(self) -> list[str]:
        return [r["id"] for r in self.rows]

    # ------------------------------------------------------------------ checks
    def _check_layout(self) -> None:
        for s in self.manifest["shards"]:
            a, b = s["rows"]
            off = 0
            for r in self.rows[a:b]:
                if r["shard"] != s["file"] or r["offset"] != off or r["length"] < 1:
                    raise self._error(f"{INDEX}: row {r.get('id')!r} does not follow the layout of "
                                      f"{s['file']} (shard, offset {off}, length >= 1 expected)")
                off += r["length"]
            if off != s["tokens"]:
                raise self._error(f"{INDEX}: rows of {s['file']} hold {off} tokens, the manifest "
                                  f"says {s['tokens']}")

    def check_file(self, k: int) -> None:
        """Shard k exists and has its recorded size (cheap: no read)."""
        s = self.manifest["shards"][k]
        path = self.root / s["file"]
        if not path.is_file():
            raise self._error(f"{s['file']} is missing (shard {k} of {len(self.manifest['shards'])}); rerun "
                              "vatspec cache-features with the same arguments to rewrite it")
        size = path.stat().st_size
        if size != s["bytes"]:
            raise self._error(f"{s['file']} is {size} bytes, the manifest records {s['bytes']} (truncated or "
                              "replaced); rerun vatspec cache-features with the same arguments to redo it")

    def check_run(self, target, layer_ids: dict[str, Iterable[int]], max_length: int, template=None) -> None:
        """The run fits the cache: the same target (weights, config, tokenizer, chat template and the arguments
        and date of ``template``, a ``ChatTemplate``), the cached layers cover each ``who -> layer ids``, the
        same max length. ``FeatureCacheError`` naming the manifest field otherwise."""
        try:
            check_target(self.manifest, target, template=template)
            for who, ids in layer_ids.items():
                check_layers(self.manifest, ids, who)
            check_max_length(self.manifest, max_length)
        except FeatureCacheError as e:
            raise self._error(str(e)) from None

    def _error(self, text: str) -> FeatureCacheError:
        """Every error of an opened cache names its folder first: ``DIR: FILE: what``."""
        return FeatureCacheError(f"{self.root}: {text}")

    def verify_shard(self, k: int) -> None:
        """Shard k's content: sha256, tensor names / dtypes / shapes, every value finite, every row's
        token ids hash to its index entry. Done once per shard per process."""
        if k in self._verified:
            return
        self.check_file(k)
        s = self.manifest["shards"][k]
        path = self.root / s["file"]
        if file_sha256(path) != s["sha256"]:
            raise self._error(f"{s['file']}: sha256 differs from the manifest (the file changed after it was "
                              "written); rerun vatspec cache-features --validate, then rebuild")
        f = self._handle(s["file"])
        N, H = s["tokens"], self.hidden_size
        want = {IDS_KEY: (torch.int32, (N,)), MASK_KEY: (torch.uint8, (N,)),
                **{layer_key(i): (self.dtype, (N, H)) for i in self.layer_ids}, HIDDEN_KEY: (self.dtype, (N, H))}
        keys = set(f.keys())  # a safetensors handle has no `in`
        for key, (dt, shape) in want.items():
            if key not in keys:
                raise self._error(f"{s['file']}: no tensor {key!r}")
            sl = f.get_slice(key)
            have_dt = sl.get_dtype()
            if tuple(sl.get_shape()) != shape or _st_dtype(dt) != have_dt:
                raise self._error(f"{s['file']}: tensor {key!r} is {have_dt} {tuple(sl.get_shape())}, expected "
                                  f"{_st_dtype(dt)} {shape}")
        a, b = s["rows"]
        rows = self.rows[a:b]
        for key in [*(layer_key(i) for i in self.layer_ids), HIDDEN_KEY]:
            sl = f.get_slice(key)
            for lo in range(0, N, FINITE_CHUNK):
                ok = torch.isfinite(sl[lo : lo + FINITE_CHUNK]).all(dim=-1)
                if not ok.all():
                    t = lo + int((~ok).nonzero()[0, 0])
                    r = next(r for r in rows if r["offset"] <= t < r["offset"] + r["length"])
                    raise self._error(f"{s['file']}: {key} of conversation {r['id']!r} (index row {r['row']}, token "
                                      f"{t - r['offset']}) is not finite (NaN or inf)")
        ids = f.get_tensor(IDS_KEY)
        for r in rows:
            if token_hash(ids[r["offset"] : r["offset"] + r["length"]]) != r["token_hash"]:
                raise self._error(f"{s['file']}: the token ids of conversation {r['id']!r} do not match the index's "
                                  "token_hash")
        self._verified.add(k)

    def verify_rows(self, examples: Iterable) -> list[int]:
        """``verify_shard`` for every shard holding one of ``examples`` (found by token hash); returns them."""
        shards = sorted({self._shard_k(self.find(e.input_ids)) for e in examples})
        for k in shards:
            self.verify_shard(k)
        return shards

    # ------------------------------------------------------------------ reads
    def examples(self, rows: Iterable[int]) -> list:
        """``Example`` (token ids, loss mask, id) of each index row, as ``tokenize_conversation`` made it;
        each row's ids are checked against its token hash."""
        from vatspec.data import Example

        rows = list(rows)
        by_shard: dict[str, list[int]] = {}
        for i in rows:
            by_shard.setdefault(self.rows[i]["shard"], []).append(i)
        out = {}
        for name, idx in by_shard.items():
            f = self._handle(name)
            ids, mask = f.get_tensor(IDS_KEY), f.get_tensor(MASK_KEY)
            for i in idx:
                r = self.rows[i]
                o, n = r["offset"], r["length"]
                if ids.shape[0] < o + n or token_hash(ids[o : o + n]) != r["token_hash"]:
                    raise self._error(f"{name}: the token ids of conversation {r['id']!r} do not "
                                      "match the index's token_hash")
                out[i] = Example(ids[o : o + n].tolist(), mask[o : o + n].bool().tolist(), r["id"])
        return [out[i] for i in rows]

    def find(self, input_ids: Sequence[int] | Tensor) -> int | None:
        """The index row holding exactly these token ids, or None."""
        return self._row_of.get(token_hash(input_ids))

    def read(self, row: int, layer_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
        """``(features [n, len(layer_ids) * H], hidden [n, H])`` of index row ``row``, storage dtype."""
        r = self.rows[row]
        k = self._shard_k(row)
        if k not in self._verified:
            self.verify_shard(k)
        f = self._handle(r["shard"])
        o, n = r["offset"], r["length"]
        feats = torch.cat([f.get_slice(layer_key(i))[o : o + n] for i in layer_ids], dim=-1) if layer_ids else None
        return feats, f.get_slice(HIDDEN_KEY)[o : o + n]

    def _shard_k(self, row: int | None) -> int:
        if row is None:
            raise self._error("a sequence is not in the cache (no index row has its token hash)")
        return bisect.bisect_right(self._starts, row) - 1

    def _handle(self, name: str):
        from safetensors import SafetensorError, safe_open

        if name in self._handles:
            self._handles.move_to_end(name)
            return self._handles[name]
        try:
            h = safe_open(self.root / name, framework="pt", device="cpu")
        except (OSError, SafetensorError) as e:
            raise self._error(f"{name}: not a readable safetensors file ({e})") from None
        self._handles[name] = h
        if len(self._handles) > OPEN_SHARDS:
            self._handles.popitem(last=False)
        return h


def _st_dtype(dt: torch.dtype) -> str:
    return {torch.int32: "I32", torch.uint8: "U8", torch.bfloat16: "BF16", torch.float16: "F16",
            torch.float32: "F32"}[dt]


class CachedTarget:
    """A ``Target`` whose forward reads features and the final hidden state from feature caches
    (the rows found by token hash) and computes only the logits, with the real target's lm_head
    (``Target.logits``). Everything else (tokenizer, sizes, lm_head, embedding) is the real target's.
    Serves training passes: right-padded batches, no KV cache."""

    def __init__(self, target, caches: Sequence[FeatureCache]):
        self.target = target
        self.caches = list(caches)

    # what the training loop reads from a target
    hidden_size = property(lambda self: self.target.hidden_size)
    num_layers = property(lambda self: self.target.num_layers)
    vocab_size = property(lambda self: self.target.vocab_size)
    tokenizer = property(lambda self: self.target.tokenizer)
    eos_token_ids = property(lambda self: self.target.eos_token_ids)
    device = property(lambda self: self.target.device)
    dtype = property(lambda self: self.target.dtype)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.target.logits(hidden)

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,  # [B, T]
        attention_mask: Tensor | None = None,  # [B, T], right-padded
        layer_ids: Sequence[int] = (),
        *,
        logits: bool = True,
        logits_at: Tensor | None = None,  # bool [B, T]
        position_ids: Tensor | None = None,
        past_key_values=None,
        use_cache: bool = False,
    ) -> TargetOutput:
        """``Target.forward``'s output for a training batch: features ``[B, T, n*H]`` and hidden
        ``[B, T, H]`` from the cache (zero on padding), in the target's dtype on its device;
        logits ``[B, T, V]`` or ``[N, V]`` at ``logits_at`` from the real lm_head."""
        assert input_ids.dim() == 2, f"input_ids must be [B, T], got {tuple(input_ids.shape)}"
        if position_ids is not None or past_key_values is not None or use_cache:
            raise ValueError("a cached target serves training passes only (no position_ids, no KV cache)")
        B, T = input_ids.shape
        H, dt = self.hidden_size, self.target.dtype
        ids = input_ids.cpu()
        lengths = attention_mask.sum(1).tolist() if attention_mask is not None else [T] * B
        feats = torch.zeros(B, T, len(layer_ids) * H, dtype=dt)
        hidden = torch.zeros(B, T, H, dtype=dt)
        for b, n in enumerate(lengths):
            cache, row = self._find(ids[b, :n])
            if cache.rows[row]["length"] != n:
                raise FeatureCacheError(f"{cache.root}: conversation {cache.rows[row]['id']!r} has "
                                        f"{cache.rows[row]['length']} tokens in the cache, {n} in the batch")
            f, h = cache.read(row, layer_ids)
            if (f is not None and not torch.isfinite(f).all()) or not torch.isfinite(h).all():
                raise FeatureCacheError(f"{cache.root}: conversation {cache.rows[row]['id']!r} has a non-finite "
                                        "feature (NaN or inf)")
            if f is not None:
                feats[b, :n] = f
            hidden[b, :n] = h
        dev = self.target.device
        feats, hidden = feats.to(dev), hidden.to(dev)
        lg = None
        if logits:
            lg = self.target.logits(hidden[logits_at] if logits_at is not None else hidden)
        return TargetOutput(lg, hidden, feats if layer_ids else None)

    __call__ = forward

    def _find(self, ids: Tensor) -> tuple[FeatureCache, int]:
        for cache in self.caches:
            row = cache.find(ids)
            if row is not None:
                return cache, row
        raise FeatureCacheError(f"a sequence of {len(ids)} tokens is in none of the feature caches "
                                f"({', '.join(str(c.root) for c in self.caches)})")
