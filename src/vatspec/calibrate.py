"""Choose the draft length k from measured acceptance and measured round cost.

At temperature 0 a drafter proposes by argmax, so the first k proposals of a round do not depend
on how many it is asked for. One calibration decode at ``k_max`` therefore tells how a round at any
k <= k_max would end: if A of the k_max drafts are accepted, a round drafting k commits
``1 + min(A, k)`` tokens. With ``S(j) = P(A >= j)``::

    expected tokens per round(k) = 1 + S(1) + ... + S(k)
    expected speedup(k)          = expected tokens per round(k) / cost(k)

where ``cost(k)`` is the wall time of a round drafting k tokens (the drafter's ``extend`` +
``propose(k)``, then one target pass over k + 1 tokens with the drafter's feature capture) in
units of one autoregressive step (a 1-token target pass, no capture), so ``cost(0) = 1`` and
``k = 0`` is the autoregressive baseline. On a CPU a target pass over 8 tokens costs well over one
1-token pass, so the best k is often smaller than the k the draft was trained for.

Worked example: S = [0.5, 0.25], cost = [1, 1.2, 1.5] -> tokens per round 1, 1.5, 1.75 -> speedups
1.0, 1.25, 1.17: k = 1. The choice is among k >= 1 (k = 0 measures nothing about the draft); when
even the best k is expected to be slower than the AR baseline, ``Calibration.ar_wins`` says so.

A longer draft has to earn its place with confidence. S(j) for large j rests on the few rounds
that got that far, so two k whose expected speedups are close are a coin flip on a few calibration
prompts, and the longer one pays its larger verify on every round if the flip was wrong. So the
rounds are resampled with replacement (a bootstrap of the survival curve; the round costs are
medians of interleaved timings and are held fixed), and, from k = 1 upwards, a larger k replaces
the current choice only when it is faster in at least ``confidence`` (95%) of the resamples. Rounds
of one prompt are correlated, so this interval is if anything narrow: the rule still leans to the
longer k less than the point estimate does, on purpose: a longer k chosen on a lead inside the noise
decodes slower than the shorter one would have (docs/results.md, "Every lever at a glance").

    cal = calibrate(target, drafter, calibration_prompts)      # held-out prompts, never the benchmarks
    generate(target, ids, drafter, k=cal.k)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from vatspec.decode import Round, generate


@dataclass(frozen=True)
class Calibration:
    """What ``calibrate`` measured and chose. Lists are indexed by k = 0 .. k_max."""

    k: int  # the chosen draft length
    survival: list[float]  # survival[j] = P(A >= j) (survival[0] = 1)
    cost: list[float]  # round cost in AR steps (cost[0] = 1)
    tokens_per_round: list[float]  # expected committed tokens per round
    speedup: list[float]  # expected speedup over the AR baseline
    rounds: int  # calibration rounds the survival curve rests on
    ar_step_s: float  # one AR step, seconds
    faster: list[float]  # faster[j]: share of bootstrap resamples in which k = j beats the chosen k
    confidence: float  # the share a larger k needs to replace a smaller one

    @property
    def ar_wins(self) -> bool:
        """Even the chosen k is expected to be slower than decoding without the draft."""
        return self.speedup[self.k] < 1.0

    def to_dict(self) -> dict:
        return {**asdict(self), "ar_wins": self.ar_wins}


def acceptance_survival(rounds: Sequence[Round], k_max: int) -> list[float]:
    """``[k_max + 1]`` survival curve S(j) = P(A >= j) from decode rounds (``Round.accepted``,
    ``Round.drafted``). S(j) counts only rounds that drafted at least j tokens (the last rounds of a
    decode draft fewer), so a short round does not read as a rejection."""
    out = [1.0]
    for j in range(1, k_max + 1):
        seen = [r for r in rounds if r.drafted >= j]
        out.append(sum(r.accepted >= j for r in seen) / len(seen) if seen else 0.0)
    return out


def expected_speedup(survival: Sequence[float], cost: Sequence[float]) -> tuple[list[float], list[float]]:
    """(tokens per round, speedup) for every k = 0 .. len(cost) - 1."""
    if len(survival) != len(cost) or not cost or cost[0] <= 0:
        raise ValueError(f"survival ({len(survival)}) and cost ({len(cost)}) must both cover k = 0..k_max")
    tokens, acc = [], 0.0
    for j in range(len(cost)):
        acc += survival[j] if j > 0 else 1.0
        tokens.append(acc)
    return tokens, [t / c for t, c in zip(tokens, cost)]


def bootstrap_survival(rounds: Sequence[Round], k_max: int, *, resamples: int = 2000, seed: int = 0) -> np.ndarray:
    """``[resamples, k_max + 1]`` survival curves (``acceptance_survival``) of the rounds resampled
    with replacement."""
    acc = np.array([r.accepted for r in rounds])
    drafted = np.array([r.drafted for r in rounds])
    counts = np.random.default_rng(seed).multinomial(len(rounds), np.full(len(rounds), 1 / len(rounds)),
                                                     size=resamples) if len(rounds) else np.zeros((resamples, 0))
    out = np.ones((resamples, k_max + 1))
    for j in range(1, k_max + 1):
        seen = counts @ (drafted >= j)
        hit = counts @ ((drafted >= j) & (acc >= j))
        out[:, j] = np.divide(hit, seen, out=np.zeros(resamples), where=seen > 0)
    return out


def choose_k(survival: Sequence[float], cost: Sequence[float], k_min: int = 1, *,
             resampled: np.ndarray | None = None, confidence: float = 0.95) -> int:
    """The k >= ``k_min`` with the highest expected speedup (the smallest such k on a tie). ``k_min``
    is 1 by default: k = 0 would decode without the draft, so nothing about the draft would be
    measured; ``Calibration.ar_wins`` says when even the best k is expected to lose to it.

    With ``resampled`` survival curves (``bootstrap_survival``), from ``k_min`` upwards a larger k
    replaces the current choice only when it is faster in at least ``confidence`` of them."""
    _, speedup = expected_speedup(survival, cost)
    k_min = min(k_min, len(speedup) - 1)
    if resampled is None:
        return max(range(k_min, len(speedup)), key=lambda k: (speedup[k], -k))
    fast = _resampled_speedup(resampled, cost)
    k = k_min
    for j in range(k_min + 1, len(speedup)):
        if np.mean(fast[:, j] > fast[:, k]) >= confidence:
            k = j
    return k


def _resampled_speedup(resampled: np.ndarray, cost: Sequence[float]) -> np.ndarray:
    """``[resamples, k_max + 1]`` expected speedups of resampled survival curves."""
    tokens = np.cumsum(np.concatenate([np.ones((len(resampled), 1)), resampled[:, 1:]], axis=1), axis=1)
    return tokens / np.asarray(cost, dtype=float)


@dataclass(frozen=True)
class RoundCostPieces:
    """The parts of a round, in AR steps: ``verify[n]`` a target pass over n = 1 .. k_max + 1 tokens with the
    drafter's feature capture (``verify[0]`` unused, 0), ``draft[k]`` the drafter's ``extend`` + ``propose(k)``
    for k = 0 .. k_max; ``ar_step_s`` one AR step (a 1-token pass, no capture) in seconds."""

    verify: list[float]
    draft: list[float]
    ar_step_s: float

    def cost(self) -> list[float]:
        """``[k_max + 1]`` round cost: ``cost[k] = draft[k] + verify[k + 1]`` for k >= 1, ``cost[0] = 1``."""
        return [1.0] + [self.draft[k] + self.verify[k + 1] for k in range(1, len(self.draft))]


@torch.inference_mode()
def measure_round_pieces(target, drafter, prompt_ids: Sequence[int], k_max: int, *, reps: int = 7) -> RoundCostPieces:
    """``RoundCostPieces`` on one prompt's context. Every piece is timed ``reps`` times, pieces interleaved so
    drifts of the machine hit all alike, after one warm-up pass each; the median is kept. The target's cache
    is cropped back after each pass."""
    device = target.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=device)[None]
    layer_ids = list(drafter.target_layer_ids)
    tout = target(ids, layer_ids=layer_ids, logits=False, use_cache=True)
    cache = tout.past_key_values
    session = drafter.new_session()
    session.extend(tout.features[0], torch.cat([ids[0, 1:], ids[0, -1:]]))
    feat1, tok1 = tout.features[0, -1:], ids[0, -1:]

    def timed(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    def verify(n: int, capture: bool):
        def run():
            out = target(ids[:, -1:].expand(1, n), layer_ids=layer_ids if capture else [], past_key_values=cache,
                         use_cache=True)
            out.logits[0].argmax(-1).tolist()  # the host sync the decode loop makes to read acceptance
            cache.crop(-n)
        return run

    def draft(k: int):
        def run():
            session.extend(feat1, tok1)
            session.propose(k).tokens.tolist()
        return run

    ar, ver, dra = [], [[] for _ in range(k_max + 2)], [[] for _ in range(k_max + 1)]
    for _ in range(reps + 1):  # the first pass of each piece warms up and is dropped
        ar.append(timed(verify(1, capture=False)))
        for k in range(k_max + 1):
            ver[k + 1].append(timed(verify(k + 1, capture=True)))
            dra[k].append(timed(draft(k)))
    ar_s = statistics.median(ar[1:])
    return RoundCostPieces([0.0] + [statistics.median(v[1:]) / ar_s for v in ver[1:]],
                           [statistics.median(d[1:]) / ar_s for d in dra], ar_s)


def measure_round_cost(
    target, drafter, prompt_ids: Sequence[int], k_max: int, *, reps: int = 7
) -> tuple[list[float], float]:
    """``([k_max + 1] round cost in AR steps, seconds of one AR step)`` on one prompt's context: a round drafting
    k costs the drafter's ``extend`` + ``propose(k)`` and one target pass over k + 1 tokens
    (``measure_round_pieces``)."""
    pieces = measure_round_pieces(target, drafter, prompt_ids, k_max, reps=reps)
    return pieces.cost(), pieces.ar_step_s


def calibrate(target, drafter, prompts: Sequence[Sequence[int]], *, k_max: int | None = None,
              max_new_tokens: int = 64, reps: int = 7, confidence: float = 0.95, seed: int = 0) -> Calibration:
    """Decode ``prompts`` (token ids; held-out prompts, never the evaluation set) at T = 0 with
    ``k_max`` (default ``drafter.k``), measure the round cost on the first prompt, choose k: the
    fastest expected, a longer k only when faster with ``confidence`` over resampled rounds."""
    if not prompts:
        raise ValueError("calibrate: no calibration prompts")
    k_max = drafter.k if k_max is None else int(k_max)
    if k_max < 1:
        raise ValueError(f"calibrate: k_max must be >= 1, got {k_max}")
    if not 0.5 <= confidence <= 1.0:
        raise ValueError(f"calibrate: confidence must be in [0.5, 1], got {confidence}")
    rounds: list[Round] = []
    for ids in prompts:
        rounds += generate(target, ids, drafter, k=k_max, max_new_tokens=max_new_tokens).rounds
    survival = acceptance_survival(rounds, k_max)
    cost, ar_s = measure_round_cost(target, drafter, prompts[0], k_max, reps=reps)
    tokens, speedup = expected_speedup(survival, cost)
    resampled = bootstrap_survival(rounds, k_max, seed=seed)
    k = choose_k(survival, cost, resampled=resampled, confidence=confidence)
    fast = _resampled_speedup(resampled, cost)
    faster = [float(np.mean(fast[:, j] > fast[:, k])) for j in range(k_max + 1)]
    return Calibration(k, survival, cost, tokens, speedup, len(rounds), ar_s, faster, confidence)
