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

    cal = calibrate(target, drafter, calibration_prompts)      # held-out prompts, never the benchmarks
    generate(target, ids, drafter, k=cal.k)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

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


def choose_k(survival: Sequence[float], cost: Sequence[float], k_min: int = 1) -> int:
    """The k >= ``k_min`` with the highest expected speedup (the smallest such k on a tie). ``k_min``
    is 1 by default: k = 0 would decode without the draft, so nothing about the draft would be
    measured; ``Calibration.ar_wins`` says when even the best k is expected to lose to it."""
    _, speedup = expected_speedup(survival, cost)
    return max(range(min(k_min, len(speedup) - 1), len(speedup)), key=lambda k: (speedup[k], -k))


@torch.inference_mode()
def measure_round_cost(
    target, drafter, prompt_ids: Sequence[int], k_max: int, *, reps: int = 7
) -> tuple[list[float], float]:
    """``([k_max + 1] round cost in AR steps, seconds of one AR step)`` on one prompt's context.

    Every size is timed ``reps`` times, sizes interleaved so drifts of the machine hit all alike;
    the median is kept. The target's cache is cropped back after each pass."""
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

    ar, ver, dra = [], [[] for _ in range(k_max + 1)], [[] for _ in range(k_max + 1)]
    for _ in range(reps + 1):  # the first pass of each size warms up and is dropped
        ar.append(timed(verify(1, capture=False)))
        for k in range(1, k_max + 1):
            ver[k].append(timed(verify(k + 1, capture=True)))
            dra[k].append(timed(draft(k)))
    ar_s = statistics.median(ar[1:])
    cost = [1.0] + [(statistics.median(dra[k][1:]) + statistics.median(ver[k][1:])) / ar_s
                    for k in range(1, k_max + 1)]
    return cost, ar_s


def calibrate(target, drafter, prompts: Sequence[Sequence[int]], *, k_max: int | None = None,
              max_new_tokens: int = 64, reps: int = 7) -> Calibration:
    """Decode ``prompts`` (token ids; held-out prompts, never the evaluation set) at T = 0 with
    ``k_max`` (default ``drafter.k``), measure the round cost on the first prompt, choose k."""
    if not prompts:
        raise ValueError("calibrate: no calibration prompts")
    k_max = drafter.k if k_max is None else int(k_max)
    if k_max < 1:
        raise ValueError(f"calibrate: k_max must be >= 1, got {k_max}")
    rounds: list[Round] = []
    for ids in prompts:
        rounds += generate(target, ids, drafter, k=k_max, max_new_tokens=max_new_tokens).rounds
    survival = acceptance_survival(rounds, k_max)
    cost, ar_s = measure_round_cost(target, drafter, prompts[0], k_max, reps=reps)
    tokens, speedup = expected_speedup(survival, cost)
    return Calibration(choose_k(survival, cost), survival, cost, tokens, speedup, len(rounds), ar_s)
