"""A Qwen3-architecture target end to end on CPU, through the CLI.

A small random-weight ``Qwen3ForCausalLM`` (the real ``Qwen3Config``: q_norm/k_norm per head) with
the SmolLM2 fast tokenizer (ChatML ``<|im_start|>``/``<|im_end|>``, as Qwen's) and the real Qwen3
chat template, in thinking-off mode (``enable_thinking=false``, the kwargs every command is given):
``regenerate`` -> ``cache-features`` (both drafters) -> ``train`` EAGLE-3 + VAT and DFlash + VAT from
the cache -> ``export`` in every format -> ``vatspec check`` -> the exports loaded by the real
vllm-project ``speculators`` and z-lab ``dflash`` loaders and compared with this project's drafters.

The template reaches the commands both ways: as the tokenizer's own (the folder's
``chat_template.jinja``, as a real Qwen3 checkpoint ships it) and as ``--chat-template FILE`` /
``data.chat_template=FILE`` (the same text, so the same recorded hash).
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import pytest
import torch

from tests.test_third_party import ATOL, SEQ, speculators_logits
from vatspec.cli import main

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

QWEN3_TEMPLATE = Path(__file__).resolve().parent / "fixtures" / "chat_templates" / "Qwen-Qwen3-8B.jinja"
KWARGS = "enable_thinking=false"
THINK_OFF = "<think>\n\n</think>\n\n"  # what Qwen3's generation prompt holds with enable_thinking=false
MAX_LEN, NEW_TOKENS, BLOCK, TTT = 96, 12, 4, 3
TEMPLATE_FLAGS = ["--chat-template", str(QWEN3_TEMPLATE), "--chat-template-kwargs", KWARGS]

PROMPTS = [
    {"id": "s0", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"id": "s1", "messages": [{"role": "user", "content": "Count from 1 to 10."}]},
    {"id": "s2", "messages": [{"role": "user", "content": "Write a haiku about the sea."}]},
    {"id": "s3", "messages": [{"role": "user", "content": "Name three primary colours."}]},
    {"id": "m0", "messages": [{"role": "user", "content": "Tell me a fact about cats."},
                              {"role": "user", "content": "And one about dogs?"}]},
    {"id": "m1", "messages": [{"role": "user", "content": "What is 2 + 2?"},
                              {"role": "user", "content": "Now multiply that by 3."}]},
]


def template_sha256(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ----------------------------------------------------------------------------- the pipeline, once
@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, default_target_path) -> Path:
    """A random Qwen3 (hidden 64, 8 layers, 4 heads / 2 kv heads of 16) with the SmolLM2 tokenizer
    carrying Qwen3's chat template, and <|im_end|> as the generation end token. 8 layers: EAGLE-3's default
    layers (1, L//2 - 1, L - 4) are distinct from 7 layers on (on 4 they are (1, 1, 0), which export refuses)."""
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(default_target_path)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=im_end, pad_token_id=im_end,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=im_end,
                                               pad_token_id=im_end)
    path = tmp_path_factory.mktemp("qwen3_target")
    model.save_pretrained(path)
    tok.chat_template = QWEN3_TEMPLATE.read_text(encoding="utf-8")
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def regen(qwen3_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("regen")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out = root / "regen.jsonl"
    assert main(["regenerate", str(prompts), "--out", str(out), "--target", str(qwen3_dir), *TEMPLATE_FLAGS,
                 "--max-new-tokens", str(NEW_TOKENS), "--batch-size", "8", "--device", "cpu"]) == 0
    return out


@pytest.fixture(scope="module")
def cache(qwen3_dir, regen, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cache") / "features"
    assert main(["cache-features", str(regen), "--out", str(out), "--target", str(qwen3_dir), *TEMPLATE_FLAGS,
                 "--drafter", "eagle3", "--drafter", "dflash", "--feature-dtype", "float32", "--max-length",
                 str(MAX_LEN), "--batch-size", "8", "--device", "cpu", "--no-progress"]) == 0
    return out


# EAGLE-3 trains until it fits the (repetitive) answers of the random target: `vatspec check` then
# compares its served acceptance with a held-out tau_sim of 4 (every draft accepted)
STEPS = {"eagle3": 30, "dflash": 4}
LR = {"eagle3": "3e-3", "dflash": "1e-3"}


def train_args(qwen3_dir, cache, out: Path, kind: str, *extra: str) -> list[str]:
    return ["train", f"target.path={qwen3_dir}", f"data.features={cache}", f"train.out_dir={out}",
            "target.device=cpu", f"drafter.kind={kind}", "loss.kind=vat", "data.batch_size=2",
            f"data.max_length={MAX_LEN}", "data.heldout_max=2", "drafter.draft_vocab_size=64",
            f"drafter.ttt_steps={TTT}", f"drafter.block_size={BLOCK}", "drafter.num_anchors=4",
            f"train.steps={STEPS[kind]}", "train.eval_every=2", f"optim.lr={LR[kind]}", *extra, "--no-progress"]


@pytest.fixture(scope="module")
def runs(qwen3_dir, cache, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    out = {}
    # EAGLE-3: the template as a file (data.chat_template); DFlash: the tokenizer's own (the same text)
    for kind, template in (("eagle3", [f"data.chat_template={QWEN3_TEMPLATE}"]), ("dflash", [])):
        out[kind] = root / kind
        assert main(train_args(qwen3_dir, cache, out[kind], kind, *template,
                               f"data.chat_template_kwargs={KWARGS}")) == 0
    return out


FORMATS = {"eagle3-hf": "eagle3", "speculators": "eagle3", "dflash": "dflash"}


@pytest.fixture(scope="module")
def exports(runs, tmp_path_factory) -> dict[str, Path]:
    from vatspec.export.formats import FORMATS as SUPPORTED

    assert SUPPORTED == FORMATS  # every format this project writes is exported below
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for fmt, kind in FORMATS.items():
        out[fmt] = root / fmt
        assert main(["export", str(runs[kind]), "--format", fmt, "--out", str(out[fmt])]) == 0
    return out


@pytest.fixture(scope="module")
def target(qwen3_dir):
    from vatspec.target import Target

    return Target.from_pretrained(qwen3_dir)


# ----------------------------------------------------------------------------- the target
def test_the_target_is_a_qwen3_with_qk_norms(qwen3_dir, target):
    from transformers import Qwen3ForCausalLM

    cfg = json.loads((qwen3_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert isinstance(target.model, Qwen3ForCausalLM)
    for layer in target.model.model.layers:
        assert tuple(layer.self_attn.q_norm.weight.shape) == tuple(layer.self_attn.k_norm.weight.shape) == (16,)
    assert target.num_layers == 8 and target.hidden_size == 64 and target.vocab_size == 49152
    assert target.tokenizer.chat_template == QWEN3_TEMPLATE.read_text(encoding="utf-8")
    assert target.eos_token_ids == [target.tokenizer.convert_tokens_to_ids("<|im_end|>")]


# ----------------------------------------------------------------------------- regenerate
def test_regenerate_records_the_template_and_trains_on_the_generated_ids(regen, target):
    from vatspec.data import load_conversations, load_template, split_turns, tokenize_conversation

    tok = target.tokenizer
    text = QWEN3_TEMPLATE.read_text(encoding="utf-8")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    records = [json.loads(line) for line in regen.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == sorted(p["id"] for p in PROMPTS)
    for r in records:
        assert r["meta"]["chat_template"] == {"chat_template_sha256": template_sha256(text),
                                              "chat_template_kwargs": {"enable_thinking": False}}
        answers = [m for m in r["messages"] if m["role"] == "assistant"]
        assert len(answers) == (2 if r["id"].startswith("m") else 1)
        assert all(isinstance(m["token_ids"], list) and 1 <= len(m["token_ids"]) <= NEW_TOKENS for m in answers)

    convs = {c.id: c for c in load_conversations(regen)}
    template = load_template(tok, str(QWEN3_TEMPLATE), KWARGS)
    assert template.kwargs == {"enable_thinking": False}
    conv = convs["s0"]
    ex = tokenize_conversation(conv, tok, template=template)
    prompt = tok.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in conv.messages[:1]],
                                     add_generation_prompt=True, enable_thinking=False, chat_template=text,
                                     tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n" + THINK_OFF)
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    answer = conv.messages[1]["token_ids"]
    # the stop id that ended the answer; an answer cut at --max-new-tokens has none, and none is trained after it
    stop = [] if conv.messages[1]["stop_token_id"] is None else [conv.messages[1]["stop_token_id"]]
    assert stop in ([], [im_end]) and (stop == []) == (json.loads(regen.read_text().splitlines()[
        [r["id"] for r in records].index("s0")])["meta"]["finish"] == ["length"])
    assert ex.input_ids == p + answer + stop
    assert ex.loss_mask == [False] * len(p) + [True] * (len(answer) + len(stop))

    # Qwen3 renders an earlier answer without the think block its prompt held: a two-turn
    # conversation is split, each turn trained in the context the target answered in
    parts = split_turns(list(convs.values()), tok, template)
    assert sorted(c.id for c in parts) == sorted([*convs, "m0@1", "m1@1"])
    for part in parts:
        ex = tokenize_conversation(part, tok, template=template)
        last = [m for m in part.messages if m["role"] == "assistant"][-1]
        answer = last["token_ids"] + ([] if last["stop_token_id"] is None else [last["stop_token_id"]])
        assert ex.input_ids[-len(answer):] == answer and sum(ex.loss_mask) == len(answer)


# ----------------------------------------------------------------------------- cache + train
def test_the_cache_records_the_template(cache):
    man = json.loads((cache / "manifest.json").read_text())
    assert man["chat_template_kwargs"] == {"enable_thinking": False}
    assert man["chat_template_sha256"] == template_sha256(QWEN3_TEMPLATE.read_text(encoding="utf-8"))
    assert man["target"]["config"]["model_type"] == "qwen3"
    assert man["conversations"] == len(PROMPTS) + 2  # each two-turn conversation split in two
    assert man["layer_ids"] == [1, 3, 4]  # EAGLE-3's (1, L//2 - 1, L - 4) and DFlash's [4], on 8 layers


def test_train_from_the_cache_with_other_template_kwargs_is_refused(qwen3_dir, cache, runs, tmp_path, capsys):
    for kind, run in runs.items():
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert records[-1]["step"] == STEPS[kind] and "eval/tau_sim" in records[-1], kind
    capsys.readouterr()
    out = tmp_path / "other"
    assert main(train_args(qwen3_dir, cache, out, "eagle3", "data.chat_template_kwargs=")) == 2
    err = capsys.readouterr().err
    assert "chat_template_kwargs" in err and "enable_thinking=false" in err and not out.exists()


# ----------------------------------------------------------------------------- export + check
def test_every_export_records_the_template_kwargs(exports):
    from vatspec.export import validate_export

    text = QWEN3_TEMPLATE.read_text(encoding="utf-8")
    for fmt, folder in exports.items():
        kind = FORMATS[fmt]
        assert validate_export(folder) == fmt
        rec = json.loads((folder / "vatspec.json").read_text())
        assert rec["target"]["chat_template_kwargs"] == {"enable_thinking": False}, fmt
        assert rec["target"]["chat_template_sha256"] == template_sha256(text), fmt
        assert rec["training"]["step"] == STEPS[kind] and rec["training"]["heldout"] is not None, fmt


def test_check_passes_with_the_trained_kwargs_and_fails_without(exports, qwen3_dir, regen, capsys):
    # the prompts the drafts were trained and held out on (single-turn: check renders a prompt-only record's
    # user turns back to back): the random target answers each with one repeated token, and a draft trained
    # on a few of them accepts only those, so the bundled benchmarks' prompts would fail the acceptance
    # comparison with the held-out tau_sim (rightly: a served draft far below its training)
    prompts = regen.parent / "check_prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS if len(p["messages"]) == 1))
    base = ["--prompts", str(prompts), "--num-prompts", "4", "--max-new-tokens", "8", "--device", "cpu"]
    for i, (fmt, folder) in enumerate(exports.items()):
        flags = TEMPLATE_FLAGS if i == 0 else ["--chat-template-kwargs", KWARGS]  # file or the tokenizer's own
        code = main(["check", str(folder), "--target", str(qwen3_dir), *flags, *base])
        out = capsys.readouterr().out
        assert code == 0, out
        assert "verdict: OK" in out and "FAIL" not in out
        assert "ok    template args          enable_thinking=false, as trained" in out
        if FORMATS[fmt] == "eagle3":  # served acceptance really compared with training's
            assert "of the accepted drafts" in out, out
    code = main(["check", str(exports["dflash"]), "--target", str(qwen3_dir), *base])
    out = capsys.readouterr().out
    assert code == 1, out
    assert any(line.split()[:3] == ["FAIL", "template", "args"] for line in out.splitlines()), out
    assert "verdict: FAIL (template args)" in out


# ----------------------------------------------------------------------------- third-party loaders
def test_speculators_loads_the_eagle3_export_as_trained(exports, runs, target):
    from vatspec.drafts import open_draft

    d, _ = open_draft(runs["eagle3"], target, device="cpu")
    assert d.kind == "eagle3" and d.k == TTT
    ids = torch.randint(3, target.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tout = target(ids, None, d.target_layer_ids)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool),
                 "loss_mask": torch.ones_like(ids, dtype=torch.bool)}
        ours = d.training_forward(batch, tout).logits  # [1, T-2, k, Vd]
    theirs = speculators_logits(exports["speculators"], tout.features, ids, TTT)
    assert len(theirs) == TTT
    Tc = SEQ - 2
    for i, lg in enumerate(theirs):
        a, b = ours[0, : Tc - i, i], lg[0, : Tc - i]
        assert (a - b).abs().max() <= ATOL, f"TTT step {i}"
        assert torch.equal(a.argmax(-1), b.argmax(-1)), f"TTT step {i}: proposals differ"


def test_zlab_dflash_loads_the_dflash_export_as_trained(exports, runs, target, monkeypatch):
    import dflash.model as zlab
    from transformers import DynamicCache

    from vatspec.drafts import open_draft
    from vatspec.eval.decode import generate

    d, _ = open_draft(runs["dflash"], target, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no config-type warning: a qwen3 layer config
        ref = zlab.DFlashDraftModel.from_pretrained(str(exports["dflash"])).eval()
    assert ref.target_layer_ids == list(d.target_layer_ids) and ref.block_size == BLOCK
    assert ref.mask_token_id == d.mask_token_id

    # one block drafted after a prompt: the same logits
    prompt = torch.randint(3, target.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hs = target.model(prompt, output_hidden_states=True).hidden_states
    ctx = zlab.extract_context_feature(hs, ref.target_layer_ids)
    P, pending = prompt.shape[1], 7
    block = torch.full((1, BLOCK), ref.mask_token_id)
    block[0, 0] = pending
    with torch.no_grad():
        hidden = ref(target_hidden=ctx, noise_embedding=target.model.get_input_embeddings()(block),
                     position_ids=torch.arange(P + BLOCK)[None], past_key_values=DynamicCache(), use_cache=True)
        theirs = ref.compute_logits(hidden[:, 1:], target.model.lm_head)[0]
        session = d.new_session()
        session.extend(ctx[0], torch.cat([prompt[0, 1:], torch.tensor([pending])]))
        ours, _ = session.draft_block()
    assert (ours - theirs).abs().max() <= ATOL
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))

    # the reference decode loop and this project's: the same tokens, the same accepted lengths
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # its timer synchronises CUDA
    prompt = prompt[:, :16]
    n = 24
    stats = zlab.dflash_generate(ref, target.model, prompt, n, stop_token_ids=None, return_stats=True)
    with torch.no_grad():
        mine = generate(target, prompt[0], d, max_new_tokens=n)
    assert stats.output_ids[0, prompt.shape[1]:].tolist() == mine.tokens
    assert stats.acceptance_lengths == [r.accepted + 1 for r in mine.rounds][: len(stats.acceptance_lengths)]
    assert sum(stats.acceptance_lengths) == n - 1  # its first token comes from the prefill
