"""The architecture matrix: every family of ``tests/arch_targets.py`` (tiny random targets from transformers' own
config classes) through what the project does with a target.

    test_logits[arch]               Target.logits(hidden) is the model's own forward logits (its caps, its scales)
    test_greedy_ar[arch]            decode.generate with no drafter = HF generate(do_sample=False)
    test_greedy_speculative[arch]   a scripted drafter accepting 0..K drafts a round (many rollbacks) = HF greedy
    test_regenerate_rows[arch]      in-process regeneration's batched loop = HF greedy, prompt by prompt
    test_sampling[qwen3_5]          T > 0 on a gated delta-net hybrid: the target's own distribution (chi-square)
    test_cache_features[arch]       (slow) cache-features ->
    test_train[arch-kind-source]    (slow) train EAGLE-3 / DFlash, online and from the cache ->
    test_export[arch-format]        (slow) export every served format ->
    test_check[arch-format]         (slow) check it against the target, decoding past the window

The prompt (~40 tokens) plus 24 new tokens crosses every sliding window and attention chunk (``WINDOW``), and every
hybrid decodes through its recurrent layers, so each rejected draft crops caches that cannot simply be cut.
The table of results: ``pytest tests/test_architectures.py -rA -q`` lists ``test_X[arch...]`` PASSED / FAILED
with the first line of each failure; ``tools/architecture_table.py`` turns a JUnit XML report into the docs' table.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.arch_targets import ARCHS, WINDOW, build_target, model_class
from tests.conftest import COUNT_CONVS
from tests.test_decode import ALPHA, ScriptedDrafter, chi2_pvalue, hf_greedy
from vatspec.cli import main
from vatspec.drafters.sampling import Proposal, warp_logits
from vatspec.eval.decode import generate, speculative_verify
from vatspec.target import Target

pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = list(ARCHS)
QUESTION = "Count from 3 to 8, please."
MAX_NEW, K = 24, 5
PATTERN = [0, 3, 1, 5, 2, 4]  # drafts accepted in round r (cycled): every count 0..K in the first six rounds
# Target.logits against the model's forward: the same float32 product, computed by another kernel (skinny_linear)
LOGITS_ATOL, LOGITS_RTOL = 1e-4, 1e-5


# ----------------------------------------------------------------------------- the targets, built once
class Lazy(dict):
    """key -> ``make(key)``, made on first use and kept; a failure is kept too and raised again, so every test of a
    stage that failed once fails with that stage's own first line."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        try:
            self[key] = self.make(key)
        except Exception as e:  # noqa: BLE001 - raised below, and again at every later use
            self[key] = e
        return self[key]

    def __getitem__(self, key):
        value = super().__getitem__(key)
        if isinstance(value, Exception):
            raise value
        return value


@pytest.fixture(scope="module")
def tokenizer(default_target_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_target_path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer) -> Lazy:
    """name -> the saved tiny target (a few hundred ms each)."""
    return Lazy(lambda name: build_target(name, tmp_path_factory.mktemp(name), tokenizer))


@pytest.fixture(scope="module")
def targets(folders) -> Lazy:
    """name -> ``Target.from_pretrained`` of its folder: what every command opens."""
    return Lazy(lambda name: Target.from_pretrained(folders[name]))


def prompt(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def greedy(folders, tokenizer) -> Lazy:
    """name -> (prompt ids, HF ``generate(do_sample=False)``'s new tokens) of the model as its published class
    loads it (``arch_targets.model_class``), apart from ``Target.from_pretrained``."""

    def make(name: str):
        model = model_class(name).from_pretrained(folders[name]).eval()
        ids = prompt(tokenizer)
        return ids, hf_greedy(Target(model, tokenizer), ids, MAX_NEW)

    return Lazy(make)


# ----------------------------------------------------------------------------- logits, decoding
@pytest.mark.parametrize("name", NAMES)
def test_logits(targets, tokenizer, name):
    target = targets[name]
    ids = torch.tensor([prompt(tokenizer)])
    ours = target(ids).logits  # Target.logits(final hidden state)
    theirs = target.model(input_ids=ids).logits.float()
    torch.testing.assert_close(ours, theirs, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_ar(targets, greedy, name):
    ids, ref = greedy[name]
    assert len(set(ref)) > MAX_NEW // 2, f"greedy output barely varies: {ref}"  # the builder's INIT at work
    assert len(ids) > WINDOW  # the window has slid before the first new token
    assert generate(targets[name], ids, None, max_new_tokens=MAX_NEW).tokens == ref


@pytest.mark.parametrize("name", NAMES)
def test_greedy_speculative(targets, greedy, name):
    target, (ids, ref) = targets[name], greedy[name]
    drafter = ScriptedDrafter(target, ids + ref, PATTERN, layer_ids=(0, 1), k=K)
    res = generate(target, ids, drafter, max_new_tokens=MAX_NEW)
    assert res.tokens == ref
    assert set(res.num_accepted) == set(range(K + 1))  # rolled back by every count, none at all included


@pytest.mark.parametrize("name", NAMES)
def test_regenerate_rows(targets, greedy, tokenizer, name):
    """In-process regeneration's batched loop (``data.regen.generate_rows``: left-padded rows, finished rows dropped
    from the cache, recurrent states included) says what HF greedy says for each prompt alone."""
    from vatspec.data.regen import generate_rows

    target, (ids, ref) = targets[name], greedy[name]
    short = tokenizer("Count to five.")["input_ids"]
    longer = tokenizer("What is the capital of France, and why is it famous for its food and its art?")["input_ids"]
    alone = [hf_greedy(target, p, 12) for p in (short, longer)]
    rows = generate_rows(target, [ids, short, longer], [MAX_NEW, 3, 12], eos=target.eos_token_ids, pad_id=0)
    assert rows == [ref, alone[0][:3], alone[1]]  # the short row leaves the batch after 3 tokens


# ----------------------------------------------------------------------------- sampling, on a hybrid
class TableDrafter:
    """Drafts new token i from a fixed distribution ``q[i]`` ([n_new, V]), whatever came before it: no forward of
    its own."""

    target_layer_ids = (0,)

    def __init__(self, q: torch.Tensor, prompt_len: int):
        self.q, self.prompt_len = q, prompt_len

    def new_session(self, head=None, exit_threshold=None):
        return TableSession(self)


class TableSession:
    def __init__(self, drafter: TableDrafter):
        self.d, self.seen = drafter, 1  # the prompt's first token; extend() brings every token after it

    def extend(self, features, tokens):
        self.seen += tokens.shape[0]

    def propose(self, k, *, temperature=0.0, top_k=0, top_p=1.0, generator=None):
        new = self.seen - self.d.prompt_len  # new tokens committed: the first draft is new token `new`
        q = self.d.q[new: new + k]  # [k, V]
        return Proposal(torch.multinomial(q, 1, generator=generator)[:, 0], q)


def exact_support(target: Target, ids: list[int], n: int, temperature: float, top_k: int) -> dict[tuple, float]:
    """The target's own sampling distribution of its first n new tokens under top-k, enumerated over its support
    (top_k^n sequences, not V^n): {token tuple: probability}."""
    dist = {(): 1.0}
    for _ in range(n):
        seqs = list(dist)
        logits = target(torch.tensor([ids + list(s) for s in seqs])).logits[:, -1]  # [top_k^i, V]
        probs = warp_logits(logits, temperature, top_k, 1.0)
        dist = {s + (int(t),): dist[s] * float(probs[i, t]) for i, s in enumerate(seqs)
                for t in probs[i].nonzero()[:, 0]}
    return dist


def sample(target, ids, drafter, dist, n_samples: int, **opts) -> list[tuple]:
    """``n_samples`` decodes of as many new tokens as ``dist``'s sequences hold, k = 2 (one outside ``dist``
    fails: a sequence of probability 0)."""
    g = torch.Generator().manual_seed(6)
    n = len(next(iter(dist)))
    out = [tuple(generate(target, ids, drafter, k=2, max_new_tokens=n, generator=g, **opts).tokens)
           for _ in range(n_samples)]
    assert all(s in dist for s in out), f"{set(out) - set(dist)}: sampled with probability 0 under top-k"
    return out


def pvalues(samples: list[tuple], dist: dict[tuple, float]) -> dict[tuple, float]:
    """Chi-square p-value of each new token's marginal, and of tokens 2 and 3 together (one round's chained
    drafts), against ``dist``'s (the whole joint has too many cells for a few hundred samples)."""
    out = {}
    n = len(next(iter(dist)))
    for at in [(i,) for i in range(n)] + [(1, 2)]:
        marginal: dict[tuple, float] = {}
        for s, p in dist.items():
            marginal[tuple(s[i] for i in at)] = marginal.get(tuple(s[i] for i in at), 0.0) + p
        seen = [tuple(s[i] for i in at) for s in samples]
        counts = torch.tensor([float(seen.count(key)) for key in marginal])
        out[at] = chi2_pvalue(counts, torch.tensor(list(marginal.values())))
    return out


SAMPLING = dict(temperature=1.0, top_k=3)  # top-3: 3^4 = 81 sequences to enumerate, a few tokens per position
N_SAMPLES, N_CONTROL = 400, 200
HYBRID_SAMPLED = "qwen3_5"  # gated delta-net layers 3:1 with full attention


def table_drafter(ids: list[int], dist: dict[tuple, float], vocab_size: int, favour: float = 0.0) -> TableDrafter:
    """q_i uniform over the tokens p may sample at new position i (after any prefix) and token 0, which p never
    samples there: q overlaps p without being it, so drafts are accepted, rejected (always, token 0) and resampled
    from the residual. ``favour``: that much of q_i on the position's most likely token instead."""
    n = len(next(iter(dist)))
    q = torch.zeros(n, vocab_size)  # [n_new, V]
    for i in range(n):
        marginal: dict[int, float] = {}
        for s, p in dist.items():
            marginal[s[i]] = marginal.get(s[i], 0.0) + p
        assert 0 not in marginal
        q[i, [0, *marginal]] = (1 - favour) / (len(marginal) + 1)
        q[i, max(marginal, key=marginal.get)] += favour
    return TableDrafter(q, len(ids))


@pytest.fixture(scope="module")
def supports(targets, tokenizer) -> Lazy:
    """name -> (target, prompt ids, the target's own distribution of 4 new tokens under SAMPLING)."""

    def make(name: str):
        target, ids = targets[name], prompt(tokenizer)
        return target, ids, exact_support(target, ids, 4, **SAMPLING)

    return Lazy(make)


@pytest.mark.parametrize("name", [HYBRID_SAMPLED])
def test_sampling(supports, name):
    """Four new tokens, k = 2: the first from the prefill, the next from drafts accepted or resampled (the linear
    attention state rolled back after each rejection), each against the target's own enumerated distribution."""
    target, ids, dist = supports[name]
    samples = sample(target, ids, table_drafter(ids, dist, target.vocab_size), dist, N_SAMPLES, **SAMPLING)
    assert min(pvalues(samples, dist).values()) > ALPHA, pvalues(samples, dist)


@pytest.mark.parametrize("name", [HYBRID_SAMPLED])
def test_sampling_has_power(supports, name, monkeypatch):
    """Negative control: verification told the wrong draft probabilities (uniform over the vocabulary, so nearly
    every draft p allows is accepted) outputs only tokens p allows, but in the proportions of a draft that favours
    one token a position: the same check rejects it."""
    target, ids, dist = supports[name]

    def wrong_q(p, draft, q, generator=None):  # q is None in a round with nothing left to draft
        return speculative_verify(p, draft, None if q is None else torch.full_like(q, 1 / q.shape[-1]), generator)

    monkeypatch.setattr("vatspec.eval.decode.speculative_verify", wrong_q)
    drafter = table_drafter(ids, dist, target.vocab_size, favour=0.8)
    samples = sample(target, ids, drafter, dist, N_CONTROL, **SAMPLING)
    assert min(pvalues(samples, dist).values()) < ALPHA, pvalues(samples, dist)


# ----------------------------------------------------------------------------- train, export, check
MAX_LEN, BLOCK, TTT, STEPS = 64, 4, 2, 2
LAYERS = [0, 1, 2]  # EAGLE-3's default (1, L//2 - 1, L - 4) repeats a layer on 4 layers
KINDS = ("eagle3", "dflash")
FORMATS = {"eagle3-hf": "eagle3", "speculators": "eagle3", "dflash": "dflash"}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("arch_data")
    (root / "train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in COUNT_CONVS[:4]))
    (root / "prompts.jsonl").write_text(json.dumps({"id": "p", "messages": [{"role": "user", "content": QUESTION}]})
                                        + "\n")
    return root


@pytest.fixture(scope="module")
def caches(folders, data, tmp_path_factory) -> Lazy:
    """name -> its feature cache of the four conversations (EAGLE-3's LAYERS and DFlash's default)."""

    def make(name: str) -> Path:
        out = tmp_path_factory.mktemp(name) / "features"
        assert main(["cache-features", str(data / "train.jsonl"), "--out", str(out), "--target", str(folders[name]),
                     "--layers", *map(str, LAYERS), "--drafter", "dflash", "--feature-dtype", "float32",
                     "--max-length", str(MAX_LEN), "--batch-size", "4", "--device", "cpu", "--no-progress",
                     "--debug"]) == 0
        return out

    return Lazy(make)


@pytest.fixture(scope="module")
def runs(folders, caches, data, tmp_path_factory) -> Lazy:
    """(name, kind, source) -> a training run of STEPS steps: from the cache, or online from the conversations."""

    def make(key: tuple[str, str, str]) -> Path:
        name, kind, source = key
        out = tmp_path_factory.mktemp(name) / f"{kind}-{source}"
        src = f"data.features={caches[name]}" if source == "cached" else f"data.train={data / 'train.jsonl'}"
        layers = [f"drafter.target_layer_ids=[{','.join(map(str, LAYERS))}]"] if kind == "eagle3" else []
        assert main(["train", f"target.path={folders[name]}", src, f"train.out_dir={out}", "target.device=cpu",
                     f"drafter.kind={kind}", "loss.kind=vat", "data.batch_size=2", f"data.max_length={MAX_LEN}",
                     "data.heldout_max=1", "drafter.draft_vocab_size=64", f"drafter.ttt_steps={TTT}",
                     f"drafter.block_size={BLOCK}", "drafter.num_anchors=4", f"train.steps={STEPS}", "optim.lr=1e-3",
                     *layers, "--no-progress", "--debug"]) == 0
        return out

    return Lazy(make)


@pytest.fixture(scope="module")
def exports(runs, tmp_path_factory) -> Lazy:
    """(name, format) -> the export of the run trained from the cache."""

    def make(key: tuple[str, str]) -> Path:
        name, fmt = key
        out = tmp_path_factory.mktemp(name) / fmt
        assert main(["export", str(runs[name, FORMATS[fmt], "cached"]), "--format", fmt, "--out", str(out),
                     "--debug"]) == 0
        return out

    return Lazy(make)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_cache_features(caches, name):
    man = json.loads((caches[name] / "manifest.json").read_text())
    assert man["conversations"] == 4 and set(LAYERS) <= set(man["layer_ids"])


@pytest.mark.slow
@pytest.mark.parametrize("source", ["cached", "online"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", NAMES)
def test_train(runs, name, kind, source):
    records = [json.loads(line) for line in (runs[name, kind, source] / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == STEPS and "eval/tau_sim" in records[-1]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("name", NAMES)
def test_export(exports, name, fmt):
    from vatspec.export import validate_export

    assert validate_export(exports[name, fmt]) == fmt


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("name", NAMES)
def test_check(exports, folders, data, name, fmt, tmp_path, capsys):
    report = tmp_path / "check.json"
    code = main(["check", str(exports[name, fmt]), "--target", str(folders[name]), "--prompts",
                 str(data / "prompts.jsonl"), "--num-prompts", "1", "--max-new-tokens", str(MAX_NEW), "--device",
                 "cpu", "--json", str(report), "--debug"])
    out = capsys.readouterr().out
    assert report.is_file(), out
    failed = [f"{f['what']}: {f['detail']}" for f in json.loads(report.read_text())["findings"] if not f["ok"]]
    assert code == 0 and not failed, "; ".join(failed) or out
    assert "served: 1 held-out prompts" in out, out  # decoded past the window
