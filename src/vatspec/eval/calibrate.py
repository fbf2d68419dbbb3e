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

The cost is timed so that a burst of load cannot fool it (``measure_round_timings``): the AR step and
every piece of a round run interleaved, in a rotated order, for many repetitions; each piece is taken
relative to the AR step of its own repetition, and the median over repetitions is kept. A target pass
over more tokens, or a longer draft, cannot cost less, so the medians are fitted non-decreasing in k
(``fit_cost``; ``Calibration.cost_measured`` keeps them as timed).

A longer draft has to earn its place with confidence. S(j) for large j rests on the few rounds
that got that far, and the costs of two k differ by a few hundredths of an AR step, so two k whose
expected speedups are close are a coin flip, and the longer one pays its larger verify on every
round if the flip was wrong. So the rounds and the timing repetitions are resampled with
replacement (a bootstrap of the survival curve and of the cost), and, from k = 1 upwards, a larger
k replaces the current choice only when it is faster in at least ``confidence`` (95%) of the
resamples. Rounds of one prompt are correlated, so this interval is if anything narrow: the rule
still leans to the longer k less than the point estimate does, on purpose: a longer k chosen on a
lead inside the noise decodes slower than the shorter one would have. The evaluation decodes a
chosen k > 1 at k = 1 too (``bench.evaluate``'s ``recheck``) and its report says whether the choice
held.

    cal = calibrate(target, drafter, calibration_prompts)      # held-out prompts, never the benchmarks
    generate(target, ids, drafter, k=cal.k)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from vatspec.eval.decode import Round, generate
from vatspec.eval.kernels import few_row_kernel
from vatspec.eval.machine import OtherLoad
from vatspec.target.rollback import Rollback


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
    cost_measured: list[float]  # the round cost as timed (medians), before the non-decreasing fit
    reps: int  # timing repetitions the costs are medians of
    others_cores: float | None = None  # cores other work took while the costs were timed (machine.OtherLoad)

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
             resampled: np.ndarray | None = None, resampled_cost: np.ndarray | None = None,
             confidence: float = 0.95) -> int:
    """The k >= ``k_min`` with the highest expected speedup (the smallest such k on a tie). ``k_min``
    is 1 by default: k = 0 would decode without the draft, so nothing about the draft would be
    measured; ``Calibration.ar_wins`` says when even the best k is expected to lose to it.

    With ``resampled`` survival curves (``bootstrap_survival``; and ``resampled_cost``, ``[resamples,
    k_max + 1]`` costs, ``RoundTimings.resampled_cost``, paired with them row by row), from ``k_min`` upwards a
    larger k replaces the current choice only when it is faster in at least ``confidence`` of them."""
    _, speedup = expected_speedup(survival, cost)
    k_min = min(k_min, len(speedup) - 1)
    if resampled is None:
        return max(range(k_min, len(speedup)), key=lambda k: (speedup[k], -k))
    fast = _resampled_speedup(resampled, cost if resampled_cost is None else resampled_cost)
    k = k_min
    for j in range(k_min + 1, len(speedup)):
        if np.mean(fast[:, j] > fast[:, k]) >= confidence:
            k = j
    return k


def _resampled_speedup(resampled: np.ndarray, cost) -> np.ndarray:
    """``[resamples, k_max + 1]`` expected speedups of resampled survival curves (``cost``: ``[k_max + 1]``,
    or ``[resamples, k_max + 1]`` resampled with them)."""
    tokens = np.cumsum(np.concatenate([np.ones((len(resampled), 1)), resampled[:, 1:]], axis=1), axis=1)
    return tokens / np.asarray(cost, dtype=float)


@dataclass(frozen=True)
class RoundTimings:
    """Seconds of every piece of a round in every repetition: ``ar[r]`` one AR step (a 1-token pass, no
    capture), ``verify[r, n]`` a target pass over n = 1 .. k_max + 1 tokens with the drafter's feature capture
    (column 0 unused), ``draft[r, k]`` the drafter's ``extend`` + ``propose(k)`` for k = 0 .. k_max."""

    ar: np.ndarray  # [reps]
    verify: np.ndarray  # [reps, k_max + 2]
    draft: np.ndarray  # [reps, k_max + 1]

    def ratios(self) -> tuple[np.ndarray, np.ndarray]:
        """(verify, draft) of each repetition in units of the AR step of the same repetition: a burst of load
        that slows a whole repetition leaves its ratios alone."""
        return self.verify / self.ar[:, None], self.draft / self.ar[:, None]

    def cost(self, reps: np.ndarray | None = None) -> tuple[list[float], list[float]]:
        """(round cost fitted non-decreasing in k, round cost as measured), ``[k_max + 1]`` each, in AR steps,
        from the median ratios over the repetitions ``reps`` (indices; default all)."""
        v, d = self.ratios()
        if reps is not None:
            v, d = v[reps], d[reps]
        return fit_cost(np.median(v, axis=0), np.median(d, axis=0))

    def resampled_cost(self, resamples: int, seed: int) -> np.ndarray:
        """``[resamples, k_max + 1]`` fitted round costs of the repetitions resampled with replacement: how much
        the cost itself could move on another draw of the machine's noise."""
        rng = np.random.default_rng(seed)
        n = len(self.ar)
        return np.array([self.cost(rng.integers(0, n, size=n))[0] for _ in range(resamples)])


def nondecreasing(values: Sequence[float]) -> list[float]:
    """The least-squares non-decreasing fit of ``values`` (pool adjacent violators): each run that goes down is
    replaced by its mean. Worked example: [1, 0.68, 0.66, 1.3] -> [0.78, 0.78, 0.78, 1.3]."""
    blocks: list[list[float]] = []  # [mean, count]
    for x in values:
        blocks.append([float(x), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(int(c))]


def fit_cost(verify: Sequence[float], draft: Sequence[float]) -> tuple[list[float], list[float]]:
    """(fitted, measured) ``[k_max + 1]`` round costs from ``verify[n]`` (n = 0 .. k_max + 1, AR steps; [0]
    unused) and ``draft[k]`` (k = 0 .. k_max): ``cost[k] = draft[k] + verify[k + 1]``, ``cost[0] = 1``. A
    target pass over more tokens, or a longer draft, cannot cost less, so each piece is fitted non-decreasing
    before they are added, and no k >= 1 costs less than the AR step (the least-squares fit under that bound
    is the unbounded one clipped to it). Worked example: verify [-, 0.93, 0.92, 1.3], draft [0.03, 0.06, 0.09]
    -> verify 0.925 0.925 1.3; costs as timed 1, 0.98, 1.39 -> fitted 1, 1.0, 1.39."""
    k_max = len(draft) - 1
    v = nondecreasing(verify[1:])  # v[k]: a pass over k + 1 tokens
    d = nondecreasing(draft)
    fitted = [1.0] + [max(1.0, d[k] + v[k]) for k in range(1, k_max + 1)]
    measured = [1.0] + [float(draft[k] + verify[k + 1]) for k in range(1, k_max + 1)]
    return fitted, measured


@torch.inference_mode()
def measure_round_timings(target, drafter, prompt_ids: Sequence[int], k_max: int, *, reps: int = 15) -> RoundTimings:
    """Every piece of a round (``RoundTimings``) timed ``reps`` times on one prompt's context, after one
    untimed warm-up repetition. Within a repetition the pieces run back to back, in an order rotated by the
    repetition (each piece runs first, last and next to every other one alike), so a burst of load hits a few
    pieces of a few repetitions: ``RoundTimings.cost`` compares each piece with the AR step of its own
    repetition and keeps medians over repetitions. The target's cache is cropped back after each pass."""
    device = target.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=device)[None]
    layer_ids = list(drafter.target_layer_ids)
    tout = target(ids, layer_ids=layer_ids, logits=False, use_cache=True)
    cache = tout.past_key_values
    undo = Rollback(target, cache, most_fed=k_max + 1)
    session = drafter.new_session()
    session.extend(tout.features[0], torch.cat([ids[0, 1:], ids[0, -1:]]))
    feat1, tok1 = tout.features[0, -1:], ids[0, -1:]

    def verify(n: int, capture: bool):
        def run():
            x = ids[:, -1:].expand(1, n)
            undo.before()
            out = target(x, layer_ids=layer_ids if capture else [], past_key_values=cache, use_cache=True)
            out.logits[0].argmax(-1).tolist()  # the host sync the decode loop makes to read acceptance
            undo.drop(x, n)
        return run

    def draft(k: int):
        def run():
            session.extend(feat1, tok1)
            session.propose(k).tokens.tolist()
        return run

    pieces = [("ar", 0, verify(1, capture=False))]
    pieces += [("verify", n, verify(n, capture=True)) for n in range(1, k_max + 2)]
    pieces += [("draft", k, draft(k)) for k in range(k_max + 1)]
    ar, ver, dra = np.zeros(reps), np.zeros((reps, k_max + 2)), np.zeros((reps, k_max + 1))
    with few_row_kernel(target.model, drafter):  # the decode loop's kernel, as in ``generate``
        for r in range(-1, reps):  # repetition -1 warms up and is dropped
            shift = r % len(pieces)
            for kind, i, run in pieces[shift:] + pieces[:shift]:
                sync()
                t0 = time.perf_counter()
                run()
                sync()
                if r >= 0:
                    seconds = time.perf_counter() - t0
                    if kind == "ar":
                        ar[r] = seconds
                    else:
                        (ver if kind == "verify" else dra)[r, i] = seconds
    return RoundTimings(ar, ver, dra)


def measure_round_cost(
    target, drafter, prompt_ids: Sequence[int], k_max: int, *, reps: int = 15
) -> tuple[list[float], float]:
    """``([k_max + 1] round cost in AR steps, fitted non-decreasing in k; seconds of one AR step)`` on one
    prompt's context (``measure_round_timings``)."""
    timings = measure_round_timings(target, drafter, prompt_ids, k_max, reps=reps)
    return timings.cost()[0], float(np.median(timings.ar))


def calibrate(target, drafter, prompts: Sequence[Sequence[int]], *, k_max: int | None = None,
              max_new_tokens: int = 64, reps: int = 15, confidence: float = 0.95, seed: int = 0,
              resamples: int = 2000) -> Calibration:
    """Decode ``prompts`` (token ids; held-out prompts, never the evaluation set) at T = 0 with
    ``k_max`` (default ``drafter.k``), time the round's pieces on the first prompt, choose k: the
    fastest expected, a longer k only when faster with ``confidence`` over resamples of both the rounds
    (acceptance) and the timing repetitions (cost)."""
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
    with OtherLoad() as load:
        timings = measure_round_timings(target, drafter, prompts[0], k_max, reps=reps)
    cost, measured = timings.cost()
    tokens, speedup = expected_speedup(survival, cost)
    resampled = bootstrap_survival(rounds, k_max, resamples=resamples, seed=seed)
    resampled_cost = timings.resampled_cost(resamples, seed + 1)
    k = choose_k(survival, cost, resampled=resampled, resampled_cost=resampled_cost, confidence=confidence)
    fast = _resampled_speedup(resampled, resampled_cost)
    faster = [float(np.mean(fast[:, j] > fast[:, k])) for j in range(k_max + 1)]
    return Calibration(k, survival, cost, tokens, speedup, len(rounds), float(np.median(timings.ar)), faster,
                       confidence, measured, reps, load.cores)
