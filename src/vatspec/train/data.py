"""Training data: conversations read, rendered with the template as served, split into training and
held-out, tokenized (or the rows of a feature cache), and this rank's share batched.

    data = load_training_data(cfgs, target, device=device, rank=0, world=1)
    data.batches, data.held_ex, data.total, data.stats    # what the loop needs
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from vatspec import data as D
from vatspec.config import Config
from vatspec.features import CachedTarget
from vatspec.train.errors import TrainError


@dataclass
class TrainData:
    """What every arm of a lockstep group trains and is evaluated on."""

    target: object  # the loaded target
    source: object  # what the loop asks for target outputs: the target, or the feature cache (CachedTarget)
    template: D.ChatTemplate  # the chat template every sequence was rendered with, as served
    train_ex: list
    held_ex: list
    batches: D.BatchIterator
    counts: object  # answer-token counts: the EAGLE-3 draft vocabulary
    total: int  # optimiser steps
    stats: dict  # what was read, skipped and dropped (data_stats.json)
    cached: list = field(default_factory=list)  # (cache, "data.features=...") for each cache read

    @property
    def settings(self) -> dict:
        """The template's settings, recorded in the run's config and checkpoints."""
        return self.template.settings(self.target.tokenizer)


def load_training_data(cfgs: list[Config], target=None, *, device, rank: int = 0, world: int = 1) -> TrainData:
    """Read, render, split and tokenize ``cfgs[0].data`` (shared by the arms), loading the target unless given
    (from a feature cache only its embedding and lm_head). This rank's share of the training examples is
    batched in the seeded order every rank shares."""
    from vatspec.target import open_target
    from vatspec.target.architecture import describe

    base = cfgs[0]
    dcfg = base.data
    if not dcfg.train and not dcfg.features:
        raise TrainError("data.train is empty: name a conversations file (JSONL/JSON/HF dataset folder) "
                         "or a feature cache (data.features)")
    stats: dict = {}
    convs = None
    if dcfg.train:  # before the model
        stats["data.train"] = read = {}
        convs = D.load_conversations(dcfg.train, skip_bad=dcfg.skip_bad, stats=read)
    if target is None:  # from a cache the target's layers never run: its embedding and lm_head are all it reads
        if base.target.device_map and world > 1:
            raise TrainError("target.device_map spreads one target over the visible GPUs: run one process "
                             "(not torchrun), or train from a feature cache (data.features)")
        target = open_target(base.target.path, device=device, dtype=base.target.dtype,
                             heads_only=bool(dcfg.features),
                             device_map=None if dcfg.features else base.target.device_map)
        if rank == 0:
            print("\n".join(describe(target)), file=sys.stderr)
    # the template every sequence is rendered with (as served); recorded in config.yaml, checked against the data's
    template = D.attach_template(target, dcfg.chat_template, dcfg.chat_template_kwargs, dcfg.chat_template_date or None)
    # a template that stamps a date renders the one recorded with the data (or the cache): the same sequences
    template = D.pin_date(template, target.tokenizer,
                          D.recorded_settings(convs) if convs is not None else cache_settings(dcfg.features))
    settings = template.settings(target.tokenizer)
    if convs is not None:
        D.check_data_template(convs, settings, f"data.train={dcfg.train}")
        convs = D.split_turns(convs, target.tokenizer, template)
    train_ex, held_ex, cached = _examples(cfgs, target, template, settings, convs, stats)
    counts = D.token_counts(train_ex, target.vocab_size)  # the draft vocabulary: from the answer tokens
    if dcfg.loss_on == "all":
        train_ex = [ex.supervise_all() for ex in train_ex]
    if world > 1:  # each rank its own equal share, same seeded order: every rank takes the same steps
        share = len(train_ex) // world
        if share < dcfg.batch_size:
            raise TrainError(f"{len(train_ex)} examples are too few for {world} ranks of batch {dcfg.batch_size}")
        train_ex = train_ex[rank * share : (rank + 1) * share]
    source = target
    if cached:  # the loop asks the cache for target outputs (then only the lm_head runs)
        source = CachedTarget(target, list({id(c): c for c, _ in cached}.values()))
        for (cache, src), exs in zip(cached, (train_ex, held_ex)):  # the shards this rank reads: sha256, finite
            checked(cache.verify_rows, exs, where=src, root=cache.root)
    batches = D.BatchIterator(train_ex, dcfg.batch_size, pad_id=pad_id(target), seed=base.train.seed)
    total = base.train.steps or max(1, len(batches) // base.optim.grad_accum) * base.train.epochs
    return TrainData(target, source, template, train_ex, held_ex, batches, counts, total, stats, cached)


def _examples(cfgs, target, template, settings, convs, stats) -> tuple[list, list, list]:
    """(training examples, held-out examples, caches read): ``data.heldout``, or the held-out split of the
    training items; conversations tokenized, or the rows of ``data.features``."""
    dcfg, tok = cfgs[0].data, target.tokenizer
    train_cache = open_cache(dcfg.features, "data.features", target, template, cfgs, convs) if dcfg.features else None
    held_cache = train_cache
    items = list(range(len(train_cache))) if train_cache else convs  # cache rows stand for the conversations
    if dcfg.heldout:
        if train_cache:
            if Path(dcfg.heldout).resolve() == Path(dcfg.features).resolve():
                raise TrainError(f"data.heldout={dcfg.heldout} is data.features: held-out metrics would score the "
                                 "training conversations")
            held_cache = open_cache(dcfg.heldout, "data.heldout", target, template, cfgs, None)
            held_items = list(range(len(held_cache)))
        else:
            stats["data.heldout"] = read = {}
            held_items = D.load_conversations(dcfg.heldout, skip_bad=dcfg.skip_bad, stats=read)
            D.check_data_template(held_items, settings, f"data.heldout={dcfg.heldout}")
            check_disjoint(convs, held_items, dcfg)
            held_items = D.split_turns(held_items, tok, template)
        train_items = items
    else:
        train_items, held_items = heldout_split(items, dcfg, cfgs[0].train.seed)
    train_src = f"data.features={dcfg.features}" if train_cache else dcfg.train
    held_src = ((f"data.heldout={dcfg.heldout}" if train_cache else dcfg.heldout) if dcfg.heldout
                else f"the held-out split of {train_src} (data.heldout_fraction={dcfg.heldout_fraction})")
    stats["train"], stats["heldout"] = {}, {}
    train_ex = tokenize_items(train_items, tok, dcfg.max_length, train_src, train_cache, stats["train"], template)
    held_ex = tokenize_items(held_items, tok, dcfg.max_length, held_src, held_cache, stats["heldout"], template)
    if not train_ex:
        raise TrainError(f"{train_src}: no conversation has a supervised (assistant) token")
    cached = [(train_cache, train_src), (held_cache, held_src)] if train_cache else []
    return train_ex, held_ex, cached


def heldout_split(items: list, data_cfg, seed: int) -> tuple[list, list]:
    """(train, held-out) items as training splits them when ``data.heldout`` is not given:
    ``heldout_fraction`` of the first ``heldout_pool`` items (0: of all), at most ``heldout_max``, at
    least 1 (none of a single item); the items after the pool all train."""
    pool = min(data_cfg.heldout_pool or len(items), len(items))
    n_held = min(data_cfg.heldout_max, max(1, round(pool * data_cfg.heldout_fraction)))
    train, held = D.split_heldout(items[:pool], n_held if pool > 1 else 0, seed=seed)
    return train + list(items[pool:]), held


MIN_SUPERVISED = 2  # a conversation with one supervised token has nothing to draft after it


def tokenize_items(convs, tok, max_length: int, source: str, cache=None, stats: dict | None = None, template=None):
    """The examples worth training on: ``convs`` tokenized, or (``cache``) the cache rows ``convs``,
    without those that keep fewer than ``MIN_SUPERVISED`` supervised tokens; ``stats`` gets the counts."""
    if cache is not None:
        examples = checked(cache.examples, convs, where=source, root=cache.root)
    else:
        examples = [D.tokenize_conversation(conv, tok, max_length, template) for conv in convs]
    out = [ex for ex in examples if not dropped_and_cut(ex, max_length)[0]]
    if stats is not None:
        stats.update(sequence_stats(examples, max_length))
    if convs and not out:
        raise TrainError(f"{source}: none of {len(convs)} conversations keeps {MIN_SUPERVISED} supervised "
                         f"(assistant) tokens within data.max_length={max_length}")
    return out


def dropped_and_cut(ex, max_length: int) -> tuple[bool, bool]:
    """``(dropped, cut)`` for an example tokenized at ``max_length``: training drops it (fewer than
    ``MIN_SUPERVISED`` supervised tokens); it reached ``max_length`` (counted as cut)."""
    return sum(ex.loss_mask) < MIN_SUPERVISED, len(ex) >= max_length


def sequence_stats(examples, max_length: int) -> dict:
    """What ``tokenize_items`` counts of ``examples`` (tokenized at ``max_length``): the conversations, those
    kept, dropped because the answer lay beyond ``max_length`` or too short, and kept but cut."""
    flags = [dropped_and_cut(ex, max_length) for ex in examples]
    return dict(conversations=len(examples), kept=sum(not d for d, _ in flags),
                dropped_over_length=sum(d and m for d, m in flags),  # the answer lay beyond
                dropped_too_short=sum(d and not m for d, m in flags),
                kept_truncated=sum(m and not d for d, m in flags))


def cache_settings(path: str) -> dict | None:
    """The template settings a feature cache's manifest records (None: no cache, or one ``open_cache`` refuses)."""
    from vatspec.features.format import FeatureCacheError, read_manifest

    try:
        return read_manifest(Path(path)) if path else None
    except FeatureCacheError:
        return None  # open_cache says what is wrong with it


def open_cache(path: str, field: str, target, template, cfgs: list[Config], convs):
    """The feature cache at ``path``, checked against the run: the target and its chat ``template``, every arm's
    layers, the max length, and (``convs``: data.train given too) the conversations it was built from."""
    from vatspec.features import FeatureCache, config_layer_ids
    from vatspec.features.format import conversations_sha256

    def layers(c: Config):
        try:
            return config_layer_ids(c.drafter, target.num_layers)
        except ValueError as e:
            raise TrainError(f"drafter.target_layer_ids: {e}") from None

    cache = checked(FeatureCache, path, where=f"{field}={path}", root=Path(path))
    if cache.precision != cfgs[0].train.precision:  # the cached features would not be the ones online training sees
        raise TrainError(f"{field}={path}: the cache's target pass ran in {cache.precision}, the run trains in "
                         f"train.precision={cfgs[0].train.precision}; rebuild it with cache-features --precision "
                         f"{cfgs[0].train.precision}, or set train.precision={cache.precision}")
    who = {f"the {c.drafter.kind} drafter of {c.train.out_dir}": layers(c) for c in cfgs}
    checked(cache.check_run, target, who, cfgs[0].data.max_length, template, where=f"{field}={path}", root=cache.root)
    src = cache.manifest["source"]
    if convs is not None and conversations_sha256(convs) != src["sha256"]:
        raise TrainError(f"data.train={cfgs[0].data.train}: not the conversations the cache was built from "
                         f"({field}={path} holds {src['conversations']} conversations of {src['path']}); "
                         "leave data.train empty or rebuild the cache")
    return cache


def check_disjoint(train_convs, held_convs, dcfg) -> None:
    """A ``TrainError`` when the held-out conversations share ids or first prompts with the training ones:
    held-out metrics would score conversations the drafter trained on."""
    def key(c):
        return next((m["content"].strip() for m in c.messages if m["role"] == "user"), "")

    ids, prompts = {c.id for c in train_convs}, {key(c) for c in train_convs}
    shared = [c for c in held_convs if c.id in ids or key(c) in prompts]
    if shared:
        raise TrainError(f"data.heldout={dcfg.heldout} shares {len(shared)} of {len(held_convs)} conversations with "
                         f"data.train={dcfg.train} (by id or first prompt, e.g. {shared[0].id!r}): held-out metrics "
                         "would score training conversations; hold out others, or leave data.heldout empty for a split")


def checked(fn, *args, where: str, root=None):
    """``fn(*args)``, a feature-cache error turned into a one-line TrainError: ``WHERE: what`` (the
    cache's own ``ROOT: `` prefix replaced by ``where``, e.g. ``data.features=DIR``)."""
    from vatspec.features import FeatureCacheError

    try:
        return fn(*args)
    except FeatureCacheError as e:
        msg = str(e).removeprefix(f"{root}: ") if root is not None else str(e)
        raise TrainError(f"{where}: {msg}") from None


def pad_id(target) -> int:
    tok = target.tokenizer
    return tok.pad_token_id if tok.pad_token_id is not None else target.eos_token_ids[0]
