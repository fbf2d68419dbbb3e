"""Speculative decoding, batch size 1.

One loop, in the shape of gpt-fast's ``speculative_decode`` and DFlash's ``dflash_generate``::

    prefill   target(prompt)                     -> KV cache, layer features, the first new token
    repeat:   draft   session.extend(new features, new tokens); session.propose(k)  -> d_1..d_k', k' <= k
              verify  target([pending, d_1..d_k'])  in one pass, on the cache
              commit  accepted drafts + one target token (the correction, or the bonus)
              crop    the target cache back to the committed length (``vatspec.target.rollback``: any cache)

``drafter=None`` is the autoregressive baseline on the same code path: a round drafts nothing and
verifies only the pending token, so a speedup compares like with like.

Bookkeeping: ``num_accepted`` = drafts accepted by verification (0..k'),
``tokens_per_step`` = tokens a round commits = ``num_accepted + 1`` (the correction / bonus token),
and ``tau`` = mean ``tokens_per_step`` over verify rounds. The prefill's first token is not a
round. A round that an EOS cuts short commits fewer tokens (up to and including the EOS); its
``tokens_per_step`` counts what it committed, so ``tau == (len(tokens) - 1) / len(rounds)`` always.

Verification rules:
  * ``temperature == 0``: accept ``d_j`` iff it is the target's argmax given the accepted prefix.
    The output is token-for-token the target's greedy output.
  * ``temperature > 0``: exact speculative sampling (Leviathan et al.; Chen et al.): accept ``d_j``
    with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection sample from
    ``normalise(max(0, p_j - q_j))``; after k' acceptances sample a bonus from ``p_{k'+1}``. p and
    q are warped the same way (temperature, top-k, top-p). The output is distributed as the
    target's own sampling.
  * ``draft_argmax=True`` at ``temperature > 0`` (what vLLM does): the drafter proposes its argmax,
    so q is one-hot: accept with probability ``p(d_j)``, resample from p with ``d_j`` removed.

Batch size 1 only: one sequence, no padding, no per-row acceptance lengths.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vatspec.drafters.sampling import Proposal, warp_logits
from vatspec.eval.kernels import few_row_kernel
from vatspec.target.rollback import Rollback

__all__ = [
    "GenerationResult",
    "Proposal",
    "Round",
    "generate",
    "greedy_verify",
    "speculative_verify",
]


@dataclass
class Round:
    """One draft + verify round."""

    drafted: int  # k': tokens the drafter proposed (0 for the AR baseline)
    accepted: int  # drafts that verification accepted, 0..k'
    committed: int  # tokens this round added to the output: accepted + 1, fewer only when an EOS cut it
    draft_s: float  # session.extend (last round's commit) + session.propose
    verify_s: float  # target forward + acceptance + commit + cache crop


@dataclass
class GenerationResult:
    """What ``generate`` returns. ``tokens`` are the new tokens only (the EOS included when one
    stopped the run, as HF ``generate`` does)."""

    tokens: list[int]
    prompt_len: int
    rounds: list[Round] = field(default_factory=list)
    prefill_s: float = 0.0
    wall_s: float = 0.0  # prefill + all rounds
    stop: str = "length"  # "eos" | "length"

    @property
    def num_accepted(self) -> list[int]:
        return [r.accepted for r in self.rounds]

    @property
    def tokens_per_step(self) -> list[int]:
        return [r.committed for r in self.rounds]

    @property
    def tau(self) -> float:
        """Tokens committed per target verify pass, the bonus included (NaN when no round ran)."""
        return sum(self.tokens_per_step) / len(self.rounds) if self.rounds else float("nan")

    @property
    def histogram(self) -> list[int]:
        """``histogram[n]`` = rounds that committed ``n`` tokens (index 0 is always 0)."""
        return histogram(self.tokens_per_step)

    @property
    def draft_s(self) -> float:
        return sum(r.draft_s for r in self.rounds)

    @property
    def verify_s(self) -> float:
        return sum(r.verify_s for r in self.rounds)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else float("nan")


def histogram(tokens_per_step: list[int]) -> list[int]:
    """Counts of each acceptance length: ``out[n]`` = how many rounds committed ``n`` tokens."""
    out = [0] * (max(tokens_per_step, default=0) + 1)
    for n in tokens_per_step:
        out[n] += 1
    return out


# --------------------------------------------------------------------------- verification rules
def greedy_verify(logits: Tensor, draft: Tensor) -> tuple[int, Tensor]:
    """Greedy verification of one round.

    logits: [k'+1, V] target logits at [pending, d_1..d_k']; draft: [k'] drafted ids.
    Returns (num_accepted a, committed tokens [a+1]) where the committed tokens are the target's
    argmax at the first a+1 positions (equal to d_1..d_a, then the correction or bonus).
    """
    g = logits.argmax(-1)  # [k'+1]
    # 1. accept bits, 2. accepted prefix length
    a = int((draft == g[:-1]).long().cumprod(0).sum())
    return a, g[: a + 1]


def speculative_verify(
    p: Tensor, draft: Tensor, q: Tensor | None, generator: torch.Generator | None = None
) -> tuple[int, Tensor]:
    """Speculative sampling for one round.

    p:     [k'+1, V] the target's warped probabilities at [pending, d_1..d_k'].
    draft: [k'] drafted ids, sampled from q.
    q:     [k', V] the draft's warped probabilities, or None when the draft is an argmax (q one-hot).
    Returns (num_accepted a, committed tokens [a+1]) = d_1..d_a followed by a resampled or bonus token.
    """
    drafted = draft.shape[0]
    idx = torch.arange(drafted, device=p.device)
    # 1. acceptance probability min(1, p(d)/q(d)): accept iff r * q(d) < p(d), r ~ U[0, 1)
    p_d = p[idx, draft]  # [k']
    q_d = q[idx, draft] if q is not None else torch.ones_like(p_d)
    r = torch.rand(drafted, generator=generator, device=p.device, dtype=p.dtype)
    # 2. the accepted prefix ends at the first rejection
    a = int((r * q_d < p_d).long().cumprod(0).sum())
    # 3. the next token: residual max(0, p - q) at the first rejection, else the bonus from p
    if a < drafted:
        if q is None:
            residual = p[a].clone()
            residual[draft[a]] = 0.0
        else:
            residual = (p[a] - q[a]).clamp_min_(0.0)
        if not bool(residual.sum() > 0):  # p <= q everywhere: rejection had probability 0; guard rounding
            residual = p[a]
        nxt = torch.multinomial(residual, 1, generator=generator)
    else:
        nxt = torch.multinomial(p[drafted], 1, generator=generator)
    return a, torch.cat([draft[:a], nxt])


# --------------------------------------------------------------------------- the loop
@torch.inference_mode()
def generate(
    target,
    prompt_ids: Tensor | list[int],
    drafter=None,
    *,
    k: int | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    draft_argmax: bool = False,
    head=None,
    exit_threshold: float | None = None,
    generator: torch.Generator | None = None,
    rollback: str | None = None,
    kernel: str = "auto",
) -> GenerationResult:
    """Decode up to ``max_new_tokens`` after ``prompt_ids`` ([T] or [1, T]); batch size 1. One function: the
    round (draft, verify, accept, roll the caches back) is the timed unit, its state and timers shared.

    ``drafter=None`` runs the autoregressive baseline through the same loop (k = 0). ``k`` is the number
    of tokens drafted per round (default ``drafter.k``: DFlash fills its block, EAGLE-3 unrolls as many
    steps as it was trained for); the drafter may return fewer
    (early exit with ``head`` / ``exit_threshold``). Stops after an EOS (``target.eos_token_ids``,
    kept in the output) or after exactly ``max_new_tokens`` tokens: the last rounds draft fewer
    tokens so no round commits past the limit. ``rollback`` forces how the target's cache drops rejected drafts
    (``vatspec.target.rollback``: crop, record or replay; default what the cache can do, cheapest first).
    ``kernel``: the few-row CPU kernel the target's and the draft's linears run in the loop
    (``vatspec.eval.kernels.few_row_kernel``: auto, matmul or linear); the models are as before after it.
    """
    device = target.device
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    if ids.dim() == 2:
        assert ids.shape[0] == 1, f"batch size 1 only: prompt_ids has shape {tuple(ids.shape)}"
        ids = ids[0]
    assert ids.dim() == 1 and ids.numel() > 0, f"prompt_ids must be a non-empty [T], got {tuple(ids.shape)}"
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    sampling = temperature > 0
    k = 0 if drafter is None else (drafter.k if k is None else int(k))
    assert k >= 0, f"k must be >= 0, got {k}"
    layer_ids = list(drafter.target_layer_ids) if drafter is not None else []
    P = ids.numel()
    result = GenerationResult(tokens=[], prompt_len=P)
    if max_new_tokens <= 0:
        return result

    with few_row_kernel(getattr(target, "model", None), drafter, head, kind=kernel):  # this loop's few-row products
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        is_eos = torch.zeros(target.vocab_size, dtype=torch.bool, device=device)  # [V]
        is_eos[torch.tensor(target.eos_token_ids, dtype=torch.long, device=device)] = True
        # Preallocated once: the new tokens (a round may write up to k+1 past n) and the verify input.
        out = torch.empty(max_new_tokens + k + 1, dtype=torch.long, device=device)
        block = torch.empty(1, k + 1, dtype=torch.long, device=device)  # [1, k+1] = [pending, d_1..d_k]

        def next_token(logits: Tensor) -> Tensor:  # [1, V] -> [1]
            if not sampling:
                return logits.argmax(-1)
            probs = warp_logits(logits, temperature, top_k, top_p)
            return torch.multinomial(probs, 1, generator=generator)[:, 0]

        sync()
        t_start = time.perf_counter()
        # 1. prefill: the prompt's KV cache and layer features; the first new token from the last position
        tout = target(ids[None], layer_ids=layer_ids, logits=False, use_cache=True)
        cache = tout.past_key_values
        undo = Rollback(target, cache, most_fed=k + 1, mode=rollback)
        out[:1] = next_token(target.logits(tout.hidden[0, -1:]))
        n = 1  # new tokens so far; out[n-1] is the pending token (committed, not yet run by the target)
        session = None
        if drafter is not None:
            session = drafter.new_session(head=head, exit_threshold=exit_threshold)
            # position j's features and the token that follows it (the last one is the pending token)
            new_features, new_tokens = tout.features[0], torch.cat([ids[1:], out[:1]])
        stop = "eos" if bool(is_eos[out[0]]) else "length"
        sync()
        result.prefill_s = time.perf_counter() - t_start

        while n < max_new_tokens and stop != "eos":
            # 2. draft: hand the last commit to the drafter, then ask for k' <= cap <= k tokens
            t0 = time.perf_counter()
            cap = min(k, max_new_tokens - n - 1)  # this round's most drafts: it commits at most cap + 1 tokens
            q = None
            if session is not None:
                session.extend(new_features, new_tokens)
            if session is not None and cap > 0:
                proposal = session.propose(
                    cap,
                    temperature=0.0 if draft_argmax else temperature,
                    top_k=top_k,
                    top_p=top_p,
                    generator=generator,
                )
                draft = proposal.tokens
                assert draft.dim() == 1 and draft.shape[0] <= cap, (
                    f"drafter proposed {tuple(draft.shape)} tokens, expected [k'] with k' <= {cap}"
                )
                if sampling and not draft_argmax:
                    q = proposal.q
                    if q is None:
                        raise ValueError(
                            "temperature > 0 needs the draft's probabilities (Proposal.q), got None; "
                            "pass draft_argmax=True to verify argmax drafts"
                        )
                    want = (draft.shape[0], target.vocab_size)
                    assert q.shape == want, f"Proposal.q must be [k', V] = {list(want)}, got {tuple(q.shape)}"
            else:
                draft = block[0, 1:1]  # empty [0]
            drafted = draft.shape[0]  # k'
            sync()
            t1 = time.perf_counter()

            # 3. verify [pending, d_1..d_k'] in one target pass on the cache
            x = block[:, : drafted + 1]
            x[0, 0] = out[n - 1]
            x[0, 1:] = draft
            undo.before()
            tout = target(x, layer_ids=layer_ids, past_key_values=cache, use_cache=True)
            logits = tout.logits[0]  # [k'+1, V]
            if sampling:
                p = warp_logits(logits, temperature, top_k, top_p)  # [k'+1, V]
                a, new = speculative_verify(p, draft, q, generator)
            else:
                a, new = greedy_verify(logits, draft)

            # 4. commit the accepted drafts and the correction / bonus token; stop after an EOS
            c = a + 1
            hit = is_eos[new]  # [a+1]
            if bool(hit.any()):
                c = int(hit.long().argmax()) + 1
                stop = "eos"
            out[n : n + c] = new[:c]

            # 5. take the cache back to the committed positions: prompt + committed tokens except the new pending one
            undo.drop(x, drafted - a)
            if session is not None:
                # positions n-1 .. n-1+a are now committed: their features, and the tokens that follow them
                new_features, new_tokens = tout.features[0, : a + 1], out[n : n + a + 1]
            n += c
            sync()
            t2 = time.perf_counter()
            result.rounds.append(Round(drafted, a, c, t1 - t0, t2 - t1))

        result.wall_s = time.perf_counter() - t_start
        result.tokens = out[:n].tolist()
        result.stop = stop
        return result
