"""Taking the target's cache back after a verify pass, for any cache.

A verify pass runs ``[pending, d_1..d_k']`` on the target's cache; the drafts it rejects must leave the cache as
if they had never run. How, depends on what each cache layer keeps, and the cache is asked (``plan``), never the
model's name:

``crop``    the layer keeps every position's keys and values (full attention, MLA): the last positions are cut.
``record``  the layer forgets as it goes: a sliding or chunked window drops its oldest entries, a linear-attention,
            gated delta-net, Mamba or short-convolution layer keeps one running state. During the pass it records
            what a crop needs instead: the entries the window would drop, the convolution inputs, and one recurrent
            state per token, which the model's recurrent kernel computes anyway (transformers'
            ``activate_past_recording``, the mechanism of its own assisted generation). The crop then restores the
            state at the last accepted token and trims the records: no extra target pass.
``replay``  a layer that forgets and cannot record (a model whose kernel returns only its last state): the layer
            is copied before the pass and restored after it, and the accepted tokens run again, one extra target
            pass of ``a + 1`` tokens on a round that rejected drafts.

``tools/bench_rollback.py`` measures what ``record`` and ``replay`` cost per round beside a plain crop.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor

from vatspec.target.model import TargetError

__all__ = ["Rollback", "RollbackError", "RollbackPlan", "plan"]


class RollbackError(TargetError):
    """The target's cache cannot be taken back: the target cannot be verified."""


@dataclass(frozen=True)
class RollbackPlan:
    """How each layer of a target's cache is taken back."""

    kinds: dict  # layer index -> (layer class name, "crop" | "record" | "replay")

    @property
    def mode(self) -> str:
        """The whole cache's way: the most general of its layers' (replay > record > crop)."""
        ways = {how for _, how in self.kinds.values()}
        return "replay" if "replay" in ways else "record" if "record" in ways else "crop"

    def describe(self) -> str:
        return ", ".join(f"{n} x{c}: {how}" for (n, how), c in _counted(self.kinds))


def _counted(kinds: dict) -> list:
    seen: dict = {}
    for name, how in kinds.values():
        seen[(name, how)] = seen.get((name, how), 0) + 1
    return list(seen.items())


def _forgets(layer) -> bool:
    """A layer whose cache drops past states as it goes (sliding window, recurrent state): it can only be taken back
    if it records them (``activate_past_recording``)."""
    return hasattr(layer, "activate_past_recording")


def _records_per_token(layer, fed: int) -> bool:
    """After a pass of ``fed`` tokens with recording on: did the layer keep a recurrent state per token? (A
    convolution-only layer has none to keep: its inputs are recorded by the cache itself.)"""
    history = getattr(layer, "recurrent_states_history", None)
    if history is None:
        return True
    started = getattr(layer, "is_recurrent_states_initialized", {})
    return all(len(history[i]) >= fed for i, on in started.items() if on)


def _fresh_histories(cache) -> None:
    """transformers starts every state of a layer on one shared history list (``dict.fromkeys(.., [])``); a layer
    with two recurrent states would then mix their records before the first crop. One list per state."""
    for layer in getattr(cache, "layers", []):
        history = getattr(layer, "recurrent_states_history", None)
        if isinstance(history, dict):
            layer.recurrent_states_history = {i: [] for i in history}


@torch.inference_mode()
def plan(target) -> RollbackPlan:
    """How ``target``'s cache rolls back, found once per target by a probe on 2 + 3 tokens: the cache's layer
    kinds, and whether its forgetting layers record per-token states. ``RollbackError`` (one line naming the model,
    or the layer) when the model returns no cache, or a cache layer that neither forgets nor can be cut."""
    cached = getattr(target, "_rollback_plan", None)
    if cached is not None:
        return cached
    device = target.device
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    cache = target(ids, logits=False, use_cache=True).past_key_values
    if cache is None:
        raise RollbackError(f"{type(target.model).__name__} returns no cache: its drafts cannot be verified")
    layers = getattr(cache, "layers", None)
    if layers is None:  # a model's own cache class, without transformers' layers
        kinds = {0: (type(cache).__name__, "crop" if hasattr(cache, "crop") and not _forgets(cache) else "replay")}
        result = RollbackPlan(kinds)
    else:
        fed = 3
        if any(_forgets(layer) for layer in layers):
            cache.activate_past_recording(recurrent_states_to_keep=fed)
            _fresh_histories(cache)
            target(torch.zeros(1, fed, dtype=torch.long, device=device), logits=False, use_cache=True,
                   past_key_values=cache)
        kinds = {}
        for i, layer in enumerate(layers):
            name = type(layer).__name__
            if not _forgets(layer):
                if not hasattr(layer, "crop"):
                    model = type(target.model).__name__
                    raise RollbackError(f"cache layer {i} ({name}) of {model} cannot be cut back: "
                                        "its drafts cannot be verified")
                kinds[i] = (name, "crop")
            else:
                kinds[i] = (name, "record" if _records_per_token(layer, fed) else "replay")
        result = RollbackPlan(kinds)
    target._rollback_plan = result
    return result


class Rollback:
    """The target's cache in a decode loop, taken back after each verify pass as ``plan`` says.

        rollback = Rollback(target, cache, most_fed=k + 1)   # after the prefill
        rollback.before()                                    # before each verify pass
        out = target(x, past_key_values=cache, ...)
        rollback.drop(x, n)                                  # the last n of x's positions leave the cache

    ``mode`` may force ``record`` or ``replay`` (for measuring them side by side); ``record`` where a layer cannot
    record raises ``RollbackError``.
    """

    def __init__(self, target, cache, most_fed: int, mode: str | None = None):
        self.target, self.cache = target, cache
        self.plan = plan(target)
        self.mode = mode or self.plan.mode
        if self.mode not in ("crop", "record", "replay"):
            raise ValueError(f"rollback mode must be crop, record or replay, got {self.mode!r}")
        if self.mode == "crop" and self.plan.mode != "crop" or self.mode == "record" and self.plan.mode == "replay":
            raise RollbackError(f"the target's cache cannot roll back by {self.mode}: {self.plan.describe()}")
        layers = getattr(cache, "layers", None)
        # the layers a replay copies before each pass: those that forget (all of a cache without layers)
        self._copied = [i for i, (_, how) in self.plan.kinds.items() if how != "crop"] if layers is not None else None
        if self.mode == "record":
            cache.activate_past_recording(recurrent_states_to_keep=most_fed)
            _fresh_histories(cache)
        self._saved = None

    def before(self) -> None:
        """Before a verify pass: a replay copies the layers that forget."""
        if self.mode != "replay":
            return
        if self._copied is None:
            self._saved = copy.deepcopy(self.cache)
        else:
            self._saved = {i: copy.deepcopy(self.cache.layers[i]) for i in self._copied}

    def drop(self, fed: Tensor, n: int) -> None:
        """After the pass of ``fed`` ([1, T] ids): the last ``n`` positions leave the cache (0 <= n <= T)."""
        if self.mode == "crop":
            if n:
                self.cache.crop(-n)
        elif self.mode == "record":
            self.cache.crop(-n)  # crop(0) too: it trims the records back to what the next pass needs
        elif n:
            self._restore(fed.shape[1])
            keep = fed.shape[1] - n
            if keep:
                self.target(fed[:, :keep], logits=False, use_cache=True, past_key_values=self.cache)

    def _restore(self, fed: int) -> None:
        if self._copied is None:
            self.cache.__dict__.update(self._saved.__dict__)
        else:
            for i, layer in enumerate(self.cache.layers):
                if i in self._saved:
                    self.cache.layers[i] = self._saved[i]
                else:
                    layer.crop(-fed)
        self._saved = None
