"""Speculative decoding (``vatspec.eval.decode``) on tiny random targets built in code.

Scripted drafters force known accept patterns (nanochat style), so the loop is tested without a
trained draft: greedy output must equal HF ``generate``; sampled output must follow the target's
own distribution (chi-square against the exact distribution, enumerated).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import StubTokenizer
from vatspec.drafters.sampling import Proposal, warp_logits
from vatspec.eval.decode import GenerationResult, generate, greedy_verify, speculative_verify
from vatspec.target import Target, open_target
from vatspec.target.rollback import plan

# A correct sampler fails one chi-square check with this probability (seeds are fixed, so a given
# run is deterministic; 1e-3 is the false-alarm rate over the choice of seed).
ALPHA = 1e-3
# Features of the same positions computed with and without the KV cache differ by float rounding
# (relative to their size: real targets have outlier dimensions in the hundreds).
FEATURE_ATOL, FEATURE_RTOL = 1e-3, 1e-4  # a shifted position differs by O(1)


pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- tiny targets
def tiny_target(vocab: int = 64, layers: int = 2, hidden: int = 32, seed: int = 0, init: float = 0.3) -> Target:
    """A random Llama with peaked next-token distributions (``init`` large), no EOS by default."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=init,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    return Target(model, StubTokenizer())


def hf_greedy(target: Target, prompt: list[int], max_new_tokens: int) -> list[int]:
    eos = target.eos_token_ids or None
    out = target.model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
        pad_token_id=eos[0] if eos else 0,
    )
    return out[0, len(prompt):].tolist()


PROMPTS = [[3, 17, 42, 5, 9], [11, 2], [60, 61, 62, 63, 1, 7, 7, 30]]
MAX_NEW = 24


@pytest.fixture(scope="module")
def greedy_setup():
    """A target whose EOS is a token the greedy path of PROMPTS[0] reaches after a few steps, so
    that prompt stops early; the others run to MAX_NEW (asserted in the test)."""
    target = tiny_target()
    free = hf_greedy(target, PROMPTS[0], MAX_NEW)
    j = next(j for j in range(4, MAX_NEW) if free[j] not in free[:j])
    target.model.generation_config.eos_token_id = free[j]
    refs = [hf_greedy(target, p, MAX_NEW) for p in PROMPTS]
    assert refs[0][-1] == free[j] and len(refs[0]) == j + 1
    return target, refs


# --------------------------------------------------------------------------- scripted drafters
class ScriptedDrafter:
    """Proposes the target's greedy continuation for the first ``pattern[r]`` tokens of round r
    (cycled), then one wrong token, then the greedy continuation again: drafts after the first
    rejection match the target, so counting them would be caught.

    ``reference`` is the whole greedy sequence (prompt + continuation). Each ``extend`` is checked
    against it: tokens must be the reference tokens following the positions, features must equal
    the target's uncached features there. ``k``: drafted tokens per round when ``generate`` gets none.
    """

    def __init__(self, target: Target, reference: list[int], pattern: list[int], layer_ids=(0, 1), k: int = 5):
        self.target_layer_ids = list(layer_ids)
        self.k = k
        self.reference = torch.tensor(reference)
        self.pattern = pattern
        self.vocab = target.vocab_size
        self.features = target(self.reference[None], layer_ids=self.target_layer_ids, logits=False).features[0]

    def new_session(self, head=None, exit_threshold=None):
        return ScriptedSession(self)


class ScriptedSession:
    def __init__(self, drafter: ScriptedDrafter):
        self.d = drafter
        self.processed = 0  # positions the target has processed and committed
        self.rounds = 0
        self.extends: list[int] = []

    def extend(self, features, tokens):
        m, ref = tokens.shape[0], self.d.reference
        assert features.shape == (m, self.d.features.shape[-1])
        end = min(self.processed + 1 + m, ref.numel())
        assert tokens[: end - self.processed - 1].tolist() == ref[self.processed + 1 : end].tolist()
        torch.testing.assert_close(
            features, self.d.features[self.processed : self.processed + m], atol=FEATURE_ATOL, rtol=FEATURE_RTOL
        )
        self.processed += m
        self.extends.append(m)

    def propose(self, k, *, temperature=0.0, top_k=0, top_p=1.0, generator=None):
        a = self.d.pattern[self.rounds % len(self.d.pattern)]
        self.rounds += 1
        ref = self.d.reference
        start = self.processed + 1  # d_1 sits right after the pending token
        idx = torch.arange(start, start + k).clamp_max(ref.numel() - 1)
        tokens = ref[idx].clone()
        if a < k:
            tokens[a] = (tokens[a] + 1) % self.d.vocab  # the first rejection
        return Proposal(tokens)


def scripted(pattern):
    return lambda target, reference: ScriptedDrafter(target, reference, pattern)


def real_drafter(**cfg):
    """A drafter of the package with random weights (it rarely matches; equality must hold anyway)."""

    def factory(target, reference):
        from vatspec.config import DrafterConfig
        from vatspec.drafters import build_drafter

        torch.manual_seed(0)
        return build_drafter(DrafterConfig(target_layer_ids=(0, 1), **cfg), target).eval()

    return factory


# Adding a drafter to the greedy-equality test is one line: name -> factory(target, reference).
DRAFTERS = {
    "ar": lambda target, reference: None,
    "all-accepted": scripted([99]),
    "none-accepted": scripted([0]),
    "mixed": scripted([2, 0, 5, 1, 3]),
    "eagle3": real_drafter(kind="eagle3", draft_vocab_size=48, ttt_steps=3),
    "dflash": real_drafter(kind="dflash", num_layers=1, block_size=5, mask_token_id=63),
}


@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equals_target_generate(greedy_setup, name, k):
    target, refs = greedy_setup
    for prompt, ref in zip(PROMPTS, refs):
        drafter = DRAFTERS[name](target, prompt + ref)
        res = generate(target, prompt, drafter, k=k, max_new_tokens=MAX_NEW)
        assert res.tokens == ref, f"prompt {prompt}"
        assert res.stop == ("eos" if len(ref) < MAX_NEW else "length")
        assert len(res.tokens) - 1 == sum(res.tokens_per_step)
    assert len(refs[0]) < MAX_NEW and len(refs[1]) == MAX_NEW  # one stopped on EOS, one ran out


def test_eos_in_the_middle_of_accepted_drafts(greedy_setup):
    """An all-accepting drafter runs past the EOS inside one round: the output stops at the EOS."""
    target, refs = greedy_setup
    drafter = DRAFTERS["all-accepted"](target, PROMPTS[0] + refs[0])
    res = generate(target, PROMPTS[0], drafter, k=MAX_NEW, max_new_tokens=MAX_NEW)
    assert res.tokens == refs[0] and res.stop == "eos"
    assert len(res.rounds) == 1 and res.rounds[0].committed == len(refs[0]) - 1


class CacheRecordingTarget(Target):
    """Records the KV-cache length before every forward and keeps the last cache."""

    cache_lens: list[int]
    last_cache = None

    def forward(self, input_ids, *args, past_key_values=None, **kw):
        n = past_key_values.get_seq_length() if past_key_values is not None else 0
        self.__dict__.setdefault("cache_lens", []).append(n)
        out = super().forward(input_ids, *args, past_key_values=past_key_values, **kw)
        self.last_cache = out.past_key_values
        return out

    __call__ = forward


def test_tau_bookkeeping_and_cache_rollback():
    base = tiny_target(seed=1)
    target = CacheRecordingTarget(base.model, base.tokenizer)
    prompt, k = [4, 8, 15, 16], 4
    max_new = 1 + (5 + 1 + 3) * 2  # prefill token + two cycles of the pattern below
    ref = hf_greedy(base, prompt, max_new)
    drafter = ScriptedDrafter(target, prompt + ref, pattern=[4, 0, 2])
    plan(target)  # the rollback probe, run once per target (vatspec.target.rollback), before the lengths are recorded
    target.cache_lens = []
    res = generate(target, prompt, drafter, k=k, max_new_tokens=max_new)
    assert res.tokens == ref
    # near the end a round drafts only what can still be committed: round 5 starts with 15 tokens
    # (room for 19 - 15 - 1 = 3 drafts), round 6 with 16 (2 drafts, and the pattern accepts both)
    assert [r.drafted for r in res.rounds] == [4, 4, 4, 4, 3, 2]
    assert res.num_accepted == [4, 0, 2, 4, 0, 2]
    assert res.tokens_per_step == [5, 1, 3, 5, 1, 3]
    assert res.tau == pytest.approx(18 / 6)
    assert res.histogram == [0, 2, 0, 2, 0, 2]
    # before each verify the cache holds the prompt and every committed token except the pending one
    committed = [sum(res.tokens_per_step[:i]) for i in range(len(res.rounds))]
    assert target.cache_lens == [0] + [len(prompt) + c for c in committed]
    assert target.last_cache.get_seq_length() == len(prompt) + max_new - 1
    assert all(r.draft_s >= 0 and r.verify_s > 0 for r in res.rounds) and res.wall_s > res.prefill_s > 0


def test_max_new_tokens_is_never_exceeded():
    target = tiny_target(seed=2)
    prompt = [1, 2, 3]
    for max_new in (1, 2, 3, 7):
        ref = hf_greedy(target, prompt, max_new)
        res = generate(target, prompt, ScriptedDrafter(target, prompt + ref + [0] * 8, [99]), k=5,
                       max_new_tokens=max_new)
        assert res.tokens == ref and len(res.tokens) == max_new
    assert generate(target, prompt, None, max_new_tokens=0).tokens == []


@pytest.mark.parametrize("name,k", [("eagle3", 3), ("dflash", 4)])  # ttt_steps=3; block_size=5 -> k = 4
def test_k_defaults_to_the_drafters_own(greedy_setup, name, k):
    target, refs = greedy_setup
    drafter = DRAFTERS[name](target, PROMPTS[1] + refs[1])
    assert drafter.k == drafter.config.k == k
    res = generate(target, PROMPTS[1], drafter, max_new_tokens=MAX_NEW)
    assert res.tokens == refs[1]
    n = 1  # the prefill's token; every round drafts k unless fewer can still be committed
    for r in res.rounds:
        assert r.drafted == min(k, MAX_NEW - n - 1)
        n += r.committed
    assert res.rounds[0].drafted == k


def test_ar_baseline_is_the_same_loop():
    target = tiny_target(seed=3)
    res = generate(target, [5, 6, 7], None, max_new_tokens=10)
    assert isinstance(res, GenerationResult)
    assert [r.drafted for r in res.rounds] == [0] * 9 and res.tau == 1.0 and res.histogram == [0, 9]


# --------------------------------------------------------------------------- verification rules
def test_greedy_verify_hand_made():
    logits = torch.full((4, 6), -1.0)
    logits[torch.arange(4), torch.tensor([3, 1, 4, 1])] = 1.0  # target argmax: 3 1 4 | bonus 1
    a, new = greedy_verify(logits, torch.tensor([3, 1, 5]))  # accepts 2
    assert a == 2 and new.tolist() == [3, 1, 4]
    a, new = greedy_verify(logits, torch.tensor([3, 1, 4]))  # accepts 3, bonus 1
    assert a == 3 and new.tolist() == [3, 1, 4, 1]
    a, new = greedy_verify(logits, torch.tensor([0, 1, 4]))  # accepts 0 although later drafts match
    assert a == 0 and new.tolist() == [3]
    a, new = greedy_verify(logits[:1], torch.tensor([], dtype=torch.long))  # AR round
    assert a == 0 and new.tolist() == [3]


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit; cells expected below ``min_expected`` are pooled."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    n = counts.sum()
    expected = n * probs
    assert counts[probs == 0].sum() == 0, "a token of probability 0 was generated"
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def test_speculative_verify_one_position_hand_made():
    """One draft position: the committed first token must be distributed as p, whatever q is."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7]])  # [pending, d_1] rows
    q = torch.tensor([[0.1, 0.6, 0.1, 0.2]])  # overproposes id 1, proposes id 3 that p forbids
    g = torch.Generator().manual_seed(0)
    N = 20000
    drafts = torch.multinomial(q[0], N, replacement=True, generator=g)
    first, accepted = torch.zeros(4), 0
    for d in drafts:
        a, new = speculative_verify(p, d[None], q, g)
        first[new[0]] += 1
        accepted += a
    assert chi2_pvalue(first, p[0]) > ALPHA
    # P(accept) = sum_x min(p, q) = 0.1 + 0.3 + 0.1 + 0 = 0.5; 4.5 sigma of a binomial(N, 0.5)
    assert abs(accepted / N - 0.5) < 4.5 * (0.25 / N) ** 0.5
    # argmax drafting (q one-hot at id 1): accept with p(1) = 0.3, else resample p without id 1
    first.zero_()
    for _ in range(N // 4):
        a, new = speculative_verify(p, torch.tensor([1]), None, g)
        first[new[0]] += 1
    assert chi2_pvalue(first, p[0]) > ALPHA


# --------------------------------------------------------------------------- sampling end to end
class BigramDrafter:
    """Proposes from its own random bigram table: q differs from p, so rejections and the residual
    path happen. Drafts its argmax at temperature 0 (draft_argmax mode)."""

    def __init__(self, vocab: int, seed: int = 0, sharpness: float = 1.5):
        g = torch.Generator().manual_seed(seed)
        self.table = sharpness * torch.randn(vocab, vocab, generator=g)  # [V, V] logits of next | last
        self.target_layer_ids = [0]

    def new_session(self, head=None, exit_threshold=None):
        return BigramSession(self)


class BigramSession:
    def __init__(self, drafter):
        self.table = drafter.table
        self.last = None

    def extend(self, features, tokens):
        self.last = int(tokens[-1])

    def propose(self, k, *, temperature=0.0, top_k=0, top_p=1.0, generator=None):
        tokens, qs, last = [], [], self.last
        for _ in range(k):
            if temperature == 0:
                last = int(self.table[last].argmax())
            else:
                qs.append(warp_logits(self.table[last], temperature, top_k, top_p))
                last = int(torch.multinomial(qs[-1], 1, generator=generator))
            tokens.append(last)
        return Proposal(torch.tensor(tokens), torch.stack(qs) if qs else None)


def exact_joint(target: Target, prompt: list[int], n: int, temperature, top_k, top_p) -> torch.Tensor:
    """The target's own sampling distribution of the first n new tokens, enumerated: [V] * n."""
    V = target.vocab_size
    joint = torch.ones(())
    seqs = torch.tensor([prompt])  # [V^i, T+i]
    for _ in range(n):
        logits = target(seqs).logits[:, -1]  # [V^i, V]
        joint = joint.reshape(-1, 1) * warp_logits(logits, temperature, top_k, top_p)  # [V^i, V]
        seqs = torch.cat([seqs.repeat_interleave(V, 0), torch.arange(V).repeat(seqs.shape[0])[:, None]], 1)
    return joint.reshape([V] * n)


def bigram(target):
    return BigramDrafter(target.vocab_size, seed=5)


T1 = dict(temperature=1.0, top_k=0, top_p=1.0)
# name -> (drafter factory(target), sampling options)
SAMPLING_CASES = {
    "q-differs": (bigram, dict(T1, draft_argmax=False)),
    "draft-argmax": (bigram, dict(T1, draft_argmax=True)),
    "top-k-top-p": (bigram, dict(temperature=0.8, top_k=5, top_p=0.9, draft_argmax=False)),
    "ar": (lambda target: None, dict(T1)),
    # a reduced draft vocabulary: q has mass only on 6 of the 8 target ids
    "eagle3": (lambda t: real_drafter(kind="eagle3", draft_vocab_size=6, ttt_steps=2)(t, None), dict(T1)),
    "dflash": (lambda t: real_drafter(kind="dflash", num_layers=1, block_size=3, mask_token_id=7)(t, None), dict(T1)),
}


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_sampling_matches_target_distribution(case):
    """Four new tokens with k = 2: the first comes from the prefill, tokens 2-3 from the first
    round's drafts (accepted or resampled), token 4 is that round's bonus or a later round's."""
    factory, opts = SAMPLING_CASES[case]
    V, N, n_new = 8, 800, 4
    target = tiny_target(vocab=V, layers=2, hidden=16, seed=4, init=0.15)
    prompt = [1, 5, 2]
    exact = exact_joint(target, prompt, n_new, opts["temperature"], opts["top_k"], opts["top_p"])
    drafter = factory(target)
    g = torch.Generator().manual_seed(6)
    samples = torch.tensor([
        generate(target, prompt, drafter, k=2, max_new_tokens=n_new, generator=g, **opts).tokens
        for _ in range(N)
    ])  # [N, 4]
    pos = list(range(n_new))
    for i in pos:  # per-position marginals
        marg = exact.sum(dim=[j for j in pos if j != i])
        assert chi2_pvalue(torch.bincount(samples[:, i], minlength=V), marg) > ALPHA, f"token {i + 1}"
    # the joint of tokens 2 and 3 (the chained drafts of one round)
    pair = torch.bincount(samples[:, 1] * V + samples[:, 2], minlength=V * V)
    assert chi2_pvalue(pair, exact.sum(dim=(0, 3))) > ALPHA


def test_sampling_check_has_power(monkeypatch):
    """Negative control: accepting every draft outputs the draft's distribution, which the same
    check must reject (otherwise passing it would mean nothing)."""
    V, N = 8, 600
    target = tiny_target(vocab=V, layers=2, hidden=16, seed=4, init=0.15)
    prompt = [1, 5, 2]
    exact = exact_joint(target, prompt, 2, 1.0, 0, 1.0)
    drafter = BigramDrafter(V, seed=5)
    g = torch.Generator().manual_seed(7)

    def accept_all(p, draft, q, generator=None):
        return draft.shape[0], torch.cat([draft, torch.multinomial(p[-1], 1, generator=generator)])

    monkeypatch.setattr("vatspec.eval.decode.speculative_verify", accept_all)
    second = torch.tensor([
        generate(target, prompt, drafter, k=1, max_new_tokens=3, temperature=1.0, generator=g).tokens[1]
        for _ in range(N)
    ])
    assert chi2_pvalue(torch.bincount(second, minlength=V), exact.sum(0)) < ALPHA


# --------------------------------------------------------------------------- the real target
@pytest.mark.slow
def test_smollm2_greedy_equals_generate_with_every_drafter():
    """Full-size numerics (49k vocab, 30 layers): outputs equal HF greedy, through an EOS."""
    from vatspec.config import DrafterConfig
    from vatspec.drafters import build_drafter
    from vatspec.eval.bench import prompt_ids

    target = open_target("default", device="cpu", dtype="float32")
    ids = prompt_ids(target.tokenizer, [{"role": "user", "content": "Write a haiku about the sea."}])
    ref = hf_greedy(target, ids, 64)
    assert ref[-1] in target.eos_token_ids and len(ref) < 64  # stops on <|im_end|>
    torch.manual_seed(0)
    drafters = {
        "scripted": ScriptedDrafter(target, ids + ref, [2, 0, 5], layer_ids=(1, 14, 26)),
        "eagle3": build_drafter(DrafterConfig(kind="eagle3", draft_vocab_size=4096), target).eval(),
        "dflash": build_drafter(DrafterConfig(kind="dflash", block_size=8), target).eval(),
    }
    for name, drafter in drafters.items():
        res = generate(target, ids, drafter, max_new_tokens=64)
        assert res.tokens == ref and res.stop == "eos", name
