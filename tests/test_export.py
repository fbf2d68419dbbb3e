"""Served formats: round trips, the exact key sets, the layer ids each engine reads,
validation, atomic writes, target checks, the CLI, third-party drafts.

The expected key sets and fields below are written from the engines' own loaders (SGLang
``models/llama_eagle3.py`` / ``models/dflash.py`` / ``speculative/dflash_utils.py``; vLLM
``models/llama_eagle3.py`` / ``configs/speculators/{base,algos}.py`` / ``models/qwen3_dflash.py``;
vllm-project/speculators ``Eagle3SpeculatorConfig``; z-lab/dflash ``DFlashDraftModel``), not
from ``vatspec.export``'s own tables.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.conftest import StubTokenizer, tiny_llama
from vatspec.checkpoint import CheckpointError
from vatspec.drafters.base import AcceptHead
from vatspec.drafters.dflash import DFlashConfig, DFlashDrafter
from vatspec.drafters.eagle3 import Eagle3Drafter
from vatspec.drafters.vocab import build_draft_vocab
from vatspec.drafts import open_draft
from vatspec.eval.decode import generate
from vatspec.export import (
    ExportError,
    export_draft,
    import_draft,
    load_accept_head,
    validate_export,
)
from vatspec.target import Target, TargetError, open_target

V, H, L, T = 96, 32, 8, 20  # tiny target: vocab, hidden, layers; batch length
VD, k, BLOCK = 40, 3, 4  # EAGLE-3 draft vocab, its k (TTT steps); DFlash block
FORMATS = ["eagle3-hf", "speculators", "dflash"]

# ----------------------------------------------------------------------------- the formats, as documented
LLAMA_LAYER = {  # the decoder-layer fields SGLang / vLLM build their Llama layer from
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_theta",
    "rope_scaling", "attention_bias", "mlp_bias", "tie_word_embeddings",
}
EAGLE3_HF_CONFIG = LLAMA_LAYER | {
    "architectures", "torch_dtype", "draft_vocab_size", "target_hidden_size", "norm_before_residual",
    "eagle_config",  # SGLang: {use_aux_hidden_state, eagle_aux_hidden_state_layer_ids}
    "eagle_aux_hidden_state_layer_ids",  # vLLM
}
SPECULATORS_CONFIG = {
    "speculators_model_type", "architectures", "torch_dtype", "transformer_layer_config", "draft_vocab_size",
    "norm_before_residual", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "speculators_config",
}
DFLASH_CONFIG = (LLAMA_LAYER - {"mlp_bias"}) | {
    "architectures", "torch_dtype", "is_causal", "block_size", "num_target_layers", "dflash_config",
    "eagle_aux_hidden_state_layer_ids",
}


def eagle3_weights(prefix: str, H: int, I: int, nh: int, nkv: int, hd: int, V: int, Vd: int) -> dict:
    p = prefix
    return {
        "fc.weight": (H, 3 * H),
        f"{p}self_attn.q_proj.weight": (nh * hd, 2 * H), f"{p}self_attn.k_proj.weight": (nkv * hd, 2 * H),
        f"{p}self_attn.v_proj.weight": (nkv * hd, 2 * H), f"{p}self_attn.o_proj.weight": (H, nh * hd),
        f"{p}mlp.gate_proj.weight": (I, H), f"{p}mlp.up_proj.weight": (I, H), f"{p}mlp.down_proj.weight": (H, I),
        f"{p}hidden_norm.weight": (H,), f"{p}input_layernorm.weight": (H,), f"{p}post_attention_layernorm.weight": (H,),
        "norm.weight": (H,), "lm_head.weight": (Vd, H), "d2t": (Vd,), "t2d": (V,),
    }


def dflash_weights(layers: int, n_ids: int, H: int, I: int, nh: int, nkv: int, hd: int) -> dict:
    w = {"fc.weight": (H, n_ids * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(layers):
        p = f"layers.{i}."
        w |= {
            f"{p}self_attn.q_proj.weight": (nh * hd, H), f"{p}self_attn.k_proj.weight": (nkv * hd, H),
            f"{p}self_attn.v_proj.weight": (nkv * hd, H), f"{p}self_attn.o_proj.weight": (H, nh * hd),
            f"{p}self_attn.q_norm.weight": (hd,), f"{p}self_attn.k_norm.weight": (hd,),
            f"{p}mlp.gate_proj.weight": (I, H), f"{p}mlp.up_proj.weight": (I, H), f"{p}mlp.down_proj.weight": (H, I),
            f"{p}input_layernorm.weight": (H,), f"{p}post_attention_layernorm.weight": (H,),
        }
    return w


def read_export(out: Path) -> tuple[dict, dict]:
    cfg = json.loads((out / "config.json").read_text())
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    return cfg, shapes


# ----------------------------------------------------------------------------- fixtures
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> Target:
    return Target(tiny_llama(vocab_size=V, hidden_size=H, layers=L, seed=0), StubTokenizer())


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every weight random (norms too), so a swapped or dropped tensor changes the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def make_drafter(kind: str, target: Target, seed: int = 0):
    if kind == "eagle3":
        d = Eagle3Drafter.from_target(target, draft_vocab_size=VD, ttt_steps=k)
        counts = torch.randint(0, 50, (target.vocab_size,), generator=torch.Generator().manual_seed(seed))
        d.set_vocab(*build_draft_vocab(counts, VD))  # a non-identity d2t
    else:
        d = DFlashDrafter(DFlashConfig.from_target(target, num_layers=2, block_size=BLOCK, mask_token_id=5))
        d.attach_target(target)
    randomize(d, seed)
    return d.eval()


def make_head(seed: int = 1) -> AcceptHead:
    head = AcceptHead(H)
    randomize(head, seed)
    return head.eval()


def make_batch(B: int = 2, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(3, V, (B, T), generator=g), "attention_mask": torch.ones(B, T, dtype=torch.bool),
            "loss_mask": torch.ones(B, T, dtype=torch.bool)}


def kind_of(fmt: str) -> str:
    return "dflash" if fmt == "dflash" else "eagle3"


# ----------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_gives_identical_logits_proposals_and_tokens(target, tmp_path, fmt):
    d, head = make_drafter(kind_of(fmt), target), make_head()
    out = export_draft(d, target, tmp_path / "served", fmt=fmt, head=head, exit_threshold=0.25)
    assert validate_export(out, target) == fmt
    # the HF EAGLE-3 format does not record the TTT length (a training setting): pass it back
    back, head2 = open_draft(out, target, k=k if fmt == "eagle3-hf" else None)
    assert type(back) is type(d) and back.config == d.config
    sd, sd2 = d.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[name], sd2[name]) for name in sd)
    assert torch.equal(head2.proj.weight, head.proj.weight) and load_accept_head(out)[1] == 0.25

    # 1. training forward: the same logits and accept-head inputs
    batch = make_batch()
    tout = target(batch["input_ids"], batch["attention_mask"], d.target_layer_ids)
    kw = {"anchors": d.sample_anchors(batch, 4, torch.Generator().manual_seed(0))} if fmt == "dflash" else {}
    a, b = d.training_forward(batch, tout, **kw), back.training_forward(batch, tout, **kw)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)

    # 2. inference sessions: the same proposals, draft distributions and head probabilities
    ids = batch["input_ids"][0]
    feats = target(ids[None], layer_ids=d.target_layer_ids, logits=False).features[0]
    props = []
    for drafter, h in ((d, head), (back, head2)):
        s = drafter.new_session(head=h)
        s.extend(feats[:9], ids[1:10])
        greedy = s.propose(3)
        sampled = s.propose(3, temperature=1.0, generator=torch.Generator().manual_seed(0))
        props.append((greedy, sampled))
    (g1, s1), (g2, s2) = props
    assert torch.equal(g1.tokens, g2.tokens) and torch.equal(g1.head_probs, g2.head_probs)
    assert torch.equal(s1.tokens, s2.tokens) and torch.equal(s1.q, s2.q)

    # 3. decoding: the same tokens and the same accept pattern, greedy and sampled
    prompt = ids[:6]
    for temp in (0.0, 1.0):
        r1, r2 = (generate(target, prompt, x, max_new_tokens=12, temperature=temp, head=h, exit_threshold=0.25,
                           generator=torch.Generator().manual_seed(0)) for x, h in ((d, head), (back, head2)))
        assert r1.tokens == r2.tokens and r1.num_accepted == r2.num_accepted


@pytest.mark.parametrize("label", ["alive", "alpha"])
def test_accept_head_label_round_trips(target, tmp_path, label):
    """What the head predicts (VAT's alive bit, or DSpark's per-position acceptance) goes with it, so
    decoding applies its rule; an export without the field is read as VAT's head."""
    import json

    head = AcceptHead(H, label=label)
    out = export_draft(make_drafter("eagle3", target), target, tmp_path / "served", fmt="eagle3-hf", head=head)
    back, _ = load_accept_head(out)
    assert back.label == label
    meta_file = out / "accept_head" / "config.json"
    meta = json.loads(meta_file.read_text())
    assert meta["label"] == label
    del meta["label"]
    meta_file.write_text(json.dumps(meta))
    assert load_accept_head(out)[0].label == "alive"


# ----------------------------------------------------------------------------- the documented formats, exactly
def test_exported_key_sets_and_fields_are_the_formats(smol_tokenizer_target, tmp_path):
    t = smol_tokenizer_target
    Vt, I, nh, nkv, hd = t.vocab_size, 2 * H, 4, 2, H // 4
    e3 = make_drafter("eagle3", t)
    head = make_head()

    cfg, w = read_export(export_draft(e3, t, tmp_path / "hf", fmt="eagle3-hf", head=head))
    assert set(cfg) == EAGLE3_HF_CONFIG
    assert w == eagle3_weights("midlayer.", H, I, nh, nkv, hd, Vt, VD)  # no embed_tokens, no accept head
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["vocab_size"], cfg["draft_vocab_size"], cfg["target_hidden_size"]) == \
        (1, Vt, VD, H)
    assert (cfg["tie_word_embeddings"], cfg["norm_before_residual"], cfg["torch_dtype"]) == (False, False, "float32")
    assert cfg["eagle_config"] == {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # L=8: outputs of 1, 3, 4 = inputs of 2, 4, 5
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == \
        ["README.md", "accept_head", "config.json", "model.safetensors", "vatspec.json"]
    assert sorted(p.name for p in (tmp_path / "hf" / "accept_head").iterdir()) == ["config.json", "head.safetensors"]
    meta = json.loads((tmp_path / "hf" / "accept_head" / "config.json").read_text())
    assert (meta["input"], meta["hidden_size"], meta["threshold"]) == ("draft_hidden_post_norm", H, None)

    cfg, w = read_export(export_draft(e3, t, tmp_path / "spec", fmt="speculators", dtype="bfloat16"))
    assert set(cfg) == SPECULATORS_CONFIG and set(cfg["transformer_layer_config"]) == LLAMA_LAYER
    # the embedding too: the speculators library leaves a missing one uninitialised (it copies the
    # verifier's only over a NaN placeholder), and vLLM shares the target's when they are equal
    assert w == eagle3_weights("layers.0.", H, I, nh, nkv, hd, Vt, VD) | {"embed_tokens.weight": (Vt, H)}
    assert torch.equal(load_file(tmp_path / "spec" / "model.safetensors")["embed_tokens.weight"],
                       t.embed_tokens.weight.bfloat16())
    assert (cfg["speculators_model_type"], cfg["architectures"]) == ("eagle3", ["Eagle3Speculator"])
    assert (cfg["norm_before_residual"], cfg["draft_vocab_size"], cfg["target_hidden_size"]) == (False, VD, H)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and cfg["torch_dtype"] == "bfloat16"
    tl = cfg["transformer_layer_config"]
    assert (tl["model_type"], tl["num_hidden_layers"], tl["vocab_size"], tl["tie_word_embeddings"]) == \
        ("llama", 1, Vt, False)
    sc = cfg["speculators_config"]
    assert sc == {"algorithm": "eagle3", "default_proposal_method": "greedy",
                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                                        "accept_tolerance": 0.0}],
                  "verifier": {"name_or_path": t.path, "architectures": ["LlamaForCausalLM"]}}
    with safe_open(str(tmp_path / "spec" / "model.safetensors"), framework="pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118
    assert dtypes.pop("d2t") == "I64" and dtypes.pop("t2d") == "BOOL" and set(dtypes.values()) == {"BF16"}
    # k drafted tokens per round other than the draft's own: written as speculative_tokens, read back as k
    cfg, _ = read_export(export_draft(e3, t, tmp_path / "spec5", fmt="speculators", k=5))
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert e3.k == k and open_draft(tmp_path / "spec5", t)[0].k == 5

    df = DFlashDrafter(DFlashConfig.from_target(t, num_layers=2, block_size=BLOCK))
    df.attach_target(t)
    cfg, w = read_export(export_draft(df, t, tmp_path / "df"))  # the default format of a DFlash drafter
    assert set(cfg) == DFLASH_CONFIG
    assert w == dflash_weights(2, 2, H, I, nh, nkv, hd)  # no embed_tokens, no lm_head
    # a Qwen3 layer (q/k norms) whatever the target: the reference DFlashDraftModel's config class is Qwen3Config
    assert (cfg["architectures"], cfg["model_type"], cfg["is_causal"]) == (["DFlashDraftModel"], "qwen3", False)
    assert (cfg["block_size"], cfg["num_target_layers"], cfg["num_hidden_layers"], cfg["vocab_size"]) == \
        (BLOCK, L, 2, Vt)
    # SmolLM2's tokenizer has no mask token and no spare row: an unused special token is the MASK
    mask_id = t.tokenizer.convert_tokens_to_ids("<empty_output>")
    assert cfg["dflash_config"] == {"mask_token_id": mask_id, "mask_token": "<empty_output>",
                                    "target_layer_ids": [1, 5]}  # L=8, n=2: round(1 + i * 4 / 1)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 6]


def test_default_target_layer_ids_written_for_each_engine(default_target_path, tmp_path):
    """SmolLM2-135M (30 layers), as `vatspec export` sees it: its config and tokenizer, no weights."""
    t = open_target("default", device="meta")
    assert t.num_layers == 30 and Path(t.path) == Path(default_target_path)
    e3 = Eagle3Drafter.from_target(t, draft_vocab_size=256)  # default ids: outputs of 1, L//2 - 1, L - 4
    assert e3.target_layer_ids == (1, 14, 26)
    hf, _ = read_export(export_draft(e3, t, tmp_path / "hf"))
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]  # SGLang (+1 inside)
    assert hf["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # vLLM: its default (2, L//2, L-3)
    spec, _ = read_export(export_draft(e3, t, tmp_path / "spec", fmt="speculators"))
    assert spec["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    df = DFlashDrafter(DFlashConfig.from_target(t, num_layers=1))
    df.attach_target(t)
    dfc, _ = read_export(export_draft(df, t, tmp_path / "df"))
    assert dfc["dflash_config"]["target_layer_ids"] == [15] and dfc["num_target_layers"] == 30  # L // 2
    assert dfc["eagle_aux_hidden_state_layer_ids"] == [16]
    for name, ids in (("hf", (1, 14, 26)), ("spec", (1, 14, 26)), ("df", (15,))):  # read back as ours
        assert tuple(import_draft(tmp_path / name, t, device="cpu").target_layer_ids) == ids


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_unsorted_layer_ids_are_served_in_layer_order(target, tmp_path, kind):
    """Both engines capture the target's layers in the order they run: a drafter trained on ids
    listed out of order is exported with sorted ids and fc's input blocks permuted to match, so the
    served draft computes what the trained one did."""
    if kind == "eagle3":
        d = Eagle3Drafter.from_target(target, draft_vocab_size=VD, ttt_steps=k, target_layer_ids=(6, 1, 3))
        d.set_vocab(*build_draft_vocab(torch.arange(V), VD))
        fmts = ("eagle3-hf", "speculators")
    else:
        d = DFlashDrafter(DFlashConfig.from_target(target, num_layers=2, block_size=BLOCK, mask_token_id=5,
                                                   target_layer_ids=(5, 2)))
        d.attach_target(target)
        fmts = ("dflash",)
    randomize(d, 0)
    d.eval()
    batch = make_batch()
    for fmt in fmts:
        out = export_draft(d, target, tmp_path / fmt, fmt=fmt)
        cfg = json.loads((out / "config.json").read_text())
        ids = cfg["dflash_config"]["target_layer_ids"] if fmt == "dflash" else cfg["eagle_aux_hidden_state_layer_ids"]
        assert ids == ([2, 5] if fmt == "dflash" else [2, 4, 7])  # sorted (vLLM's: ours + 1)
        back = import_draft(out, target, k=k)
        assert tuple(back.target_layer_ids) == tuple(sorted(d.target_layer_ids))
        # the same features, each in its drafter's own order, give the same logits
        if kind == "eagle3":
            a = d.training_forward(batch, target(batch["input_ids"], None, d.target_layer_ids)).logits
            b = back.training_forward(batch, target(batch["input_ids"], None, back.target_layer_ids)).logits
        else:
            feats = target(batch["input_ids"][:1], None, d.target_layer_ids).features
            feats_back = target(batch["input_ids"][:1], None, back.target_layer_ids).features
            a, b = d.new_session(), back.new_session()
            a.extend(feats[0, :-1], batch["input_ids"][0, 1:])  # tokens[j] follows position j
            b.extend(feats_back[0, :-1], batch["input_ids"][0, 1:])
            a, b = a.draft_block()[0], b.draft_block()[0]  # the block's draft logits
        assert torch.allclose(a, b, atol=1e-5)
    # a third-party folder listing ids out of order is read as the engines run it, with a warning
    out = tmp_path / fmts[0]
    cfg = json.loads((out / "config.json").read_text())
    if kind == "eagle3":
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [6, 1, 3]
        cfg["eagle_aux_hidden_state_layer_ids"] = [7, 2, 4]
    else:
        cfg["dflash_config"]["target_layer_ids"], cfg["eagle_aux_hidden_state_layer_ids"] = [5, 2], [6, 3]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match="not in increasing order"):
        assert tuple(import_draft(out, target, k=k).target_layer_ids) == tuple(sorted(d.target_layer_ids))
    with pytest.raises(ExportError, match="must be distinct and increasing"):
        validate_export(out)
    with pytest.raises(ExportError, match="with a repeat"):
        twice = Eagle3Drafter.from_target(target, draft_vocab_size=VD, target_layer_ids=(1, 3, 3))
        export_draft(twice, target, tmp_path / "twice")


def test_speculators_export_carries_the_targets_embedding(target, tmp_path):
    """Also from a target opened without weights (what `vatspec export` does): the one tensor is
    read from the target folder; validation names an embedding that is not the target's."""
    folder = tmp_path / "target"
    target.model.save_pretrained(folder)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shell = Target(AutoModelForCausalLM.from_config(target.model.config), None, folder)
    d = make_drafter("eagle3", target)
    out = export_draft(d, shell, tmp_path / "spec", fmt="speculators")
    emb = load_file(out / "model.safetensors")["embed_tokens.weight"]
    assert torch.equal(emb, target.embed_tokens.weight)
    validate_export(out, target)
    bad = tamper(out, tmp_path / "bad", weights=lambda w: w["embed_tokens.weight"].mul_(0))
    with pytest.raises(ExportError, match="embed_tokens.weight is not the target's input embedding"):
        validate_export(bad, target)
    with pytest.raises(TargetError, match="no safetensors file holds the input embedding"):
        Target(shell.model, None, tmp_path / "nowhere").input_embedding()


# ----------------------------------------------------------------------------- validation and writing
def tamper(src: Path, dst: Path, *, weights=None, config=None) -> Path:
    shutil.copytree(src, dst)
    if weights is not None:
        w = load_file(dst / "model.safetensors")
        weights(w)
        save_file(w, dst / "model.safetensors")
    if config is not None:
        c = json.loads((dst / "config.json").read_text())
        config(c)
        (dst / "config.json").write_text(json.dumps(c))
    return dst


def test_validation_rejects_tampered_exports(target, tmp_path):
    good = export_draft(make_drafter("eagle3", target), target, tmp_path / "good")
    cases = {
        "extra_key": (dict(weights=lambda w: w.update({"proj.weight": torch.zeros(1, H)})), "unexpected \\['proj"),
        "missing_key": (dict(weights=lambda w: w.pop("lm_head.weight")), "missing \\['lm_head.weight'\\]"),
        "shape": (dict(weights=lambda w: w.update({"fc.weight": torch.zeros(H, 2 * H)})),
                  "fc.weight is F32\\[32, 64\\], expected F32\\[32, 96\\]"),
        "dtype": (dict(weights=lambda w: w.update({"d2t": w["d2t"].int()})), "d2t is I32"),
        "vocab_map": (dict(weights=lambda w: w["t2d"].fill_(False)), "t2d does not mark"),
        "extra_field": (dict(config=lambda c: c.update({"accept_head": True})), "unexpected \\['accept_head'\\]"),
        "ids": (dict(config=lambda c: c["eagle_config"].update({"eagle_aux_hidden_state_layer_ids": [2, 4, 5]})),
                "must be eagle_aux_hidden_state_layer_ids"),
        "tied": (dict(config=lambda c: c.update({"tie_word_embeddings": True})), "tie_word_embeddings"),
    }
    for name, (kw, msg) in cases.items():
        bad = tamper(good, tmp_path / name, **kw)
        with pytest.raises(ExportError, match=msg):
            validate_export(bad)
    (tmp_path / "stray").mkdir()
    shutil.copytree(good, tmp_path / "stray" / "x")
    (tmp_path / "stray" / "x" / "notes.txt").write_text("hi")
    with pytest.raises(ExportError, match="unexpected files \\['notes.txt'\\]"):
        validate_export(tmp_path / "stray" / "x")
    # import is strict about tensors too: the served model would be a different model
    with pytest.raises(ExportError, match="proj.weight"):
        import_draft(tmp_path / "extra_key", target)
    dfl = export_draft(make_drafter("dflash", target), target, tmp_path / "dgood")
    bad = tamper(dfl, tmp_path / "dbad", config=lambda c: c.update({"eagle_aux_hidden_state_layer_ids": [1, 5]}))
    with pytest.raises(ExportError, match="dflash_config.target_layer_ids \\+ 1"):
        validate_export(bad)


def test_writes_atomically_and_refuses_to_overwrite(target, tmp_path, monkeypatch):
    d = make_drafter("eagle3", target)
    out = export_draft(d, target, tmp_path / "out")
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(ExportError, match="not empty; pass --force"):
        export_draft(d, target, out)
    import vatspec.export.write as ex

    def broken(folder, target=None):
        raise ExportError("simulated validation failure")

    monkeypatch.setattr(ex, "validate_export", broken)
    with pytest.raises(ExportError, match="simulated"):
        export_draft(make_drafter("eagle3", target, seed=3), target, out, force=True)
    monkeypatch.undo()
    assert (out / "model.safetensors").read_bytes() == before  # the old export is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no .tmp-* / .old-* left behind
    export_draft(make_drafter("eagle3", target, seed=3), target, out, force=True)
    assert (out / "model.safetensors").read_bytes() != before
    (tmp_path / "empty").mkdir()
    export_draft(d, target, tmp_path / "empty")  # an empty folder is fine
    with pytest.raises(ExportError, match="dflash drafts, not a eagle3"):
        export_draft(d, target, tmp_path / "x", fmt="dflash")
    with pytest.raises(ExportError, match="needs an accept head"):
        export_draft(d, target, tmp_path / "y", exit_threshold=0.5)
    bare = Target(target.model, tokenizer=None)  # no tokenizer: no unused id known -> a learned MASK row
    learned = DFlashDrafter(DFlashConfig.from_target(bare, block_size=BLOCK))
    learned.attach_target(bare)
    with pytest.raises(ExportError, match="learned its own MASK row .* pass --mask-token-id"):
        export_draft(learned, target, tmp_path / "z")
    with pytest.raises(ExportError, match="only a learned MASK row can be served under another id"):
        export_draft(make_drafter("dflash", target), target, tmp_path / "z", mask_token_id=7)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists() and not (tmp_path / "z").exists()


def test_a_learned_mask_row_is_served_as_the_engines_read_it(target, tmp_path):
    """mask_embedding.pt: {"mask_token_id": id, "embedding": [H]} beside the weights (vLLM and SGLang read
    this form with torch.load(weights_only=True); vLLM ignores a row inside model.safetensors)."""
    bare = Target(target.model, tokenizer=None)
    d = DFlashDrafter(DFlashConfig.from_target(bare, num_layers=2, block_size=BLOCK))  # learned row, id V
    d.attach_target(bare)
    randomize(d, 0)
    assert d.config.mask_source == "learned" and d.mask_token_id == V
    out = export_draft(d, target, tmp_path / "df", mask_token_id=11)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] == 11
    row = torch.load(out / "mask_embedding.pt", weights_only=True)
    assert row["mask_token_id"] == 11 and torch.equal(row["embedding"], d.mask_embedding.detach())
    assert "mask_embedding" not in load_file(out / "model.safetensors")
    back = import_draft(out, target)
    assert back.config.mask_source == "learned" and back.mask_token_id == 11
    # the served draft drafts what the trained one did: its MASK slots get the learned row either way
    feats = target(make_batch()["input_ids"][:1], None, d.target_layer_ids).features
    ids = make_batch()["input_ids"][0, 1:]
    a, b = d.new_session(), back.new_session()
    a.extend(feats[0, :-1], ids)
    b.extend(feats[0, :-1], ids)
    assert torch.equal(a.draft_block()[0], b.draft_block()[0])
    # re-exported from the import, the id stays; a row of the wrong size or id is refused
    assert json.loads((export_draft(back, target, tmp_path / "again") / "config.json").read_text())[
        "dflash_config"]["mask_token_id"] == 11
    torch.save({"mask_token_id": 12, "embedding": row["embedding"]}, out / "mask_embedding.pt")
    with pytest.raises(ExportError, match="mask_token_id 12 must be dflash_config.mask_token_id 11"):
        validate_export(out)
    torch.save({"mask_token_id": 11, "embedding": row["embedding"][:-1]}, out / "mask_embedding.pt")
    with pytest.raises(ExportError, match="a row of 31, expected hidden_size=32"):
        validate_export(out)


@pytest.mark.parametrize("fmt", FORMATS)
def test_import_and_validate_name_the_mismatch_with_the_target(target, tmp_path, fmt):
    out = export_draft(make_drafter(kind_of(fmt), target), target, tmp_path / "x", fmt=fmt)
    layers = "num_target_layers=8 does not match the target \\(4\\)" if fmt == "dflash" else None
    cases = [  # (other target, import error, validate error)
        (tiny_llama(vocab_size=64, hidden_size=H, layers=L), *["vocab_size=96 does not match the target \\(64\\)"] * 2),
        (
            tiny_llama(vocab_size=V, hidden_size=48, layers=L),
            *["hidden_size=32 does not match the target \\(48\\)"] * 2,
        ),
        (tiny_llama(vocab_size=V, hidden_size=H, layers=4), layers or "\\[1, 3, 4\\] .* do not fit a 4-layer target",
         layers or "\\[1, 3, 4\\] \\(output of layer i\\) out of range for a 4-layer target"),
    ]
    for model, import_msg, validate_msg in cases:
        other = Target(model, tokenizer=None)
        with pytest.raises(ExportError, match=import_msg):
            import_draft(out, other)
        with pytest.raises(ExportError, match=validate_msg):
            validate_export(out, other)


# ----------------------------------------------------------------------------- open_draft
def test_open_draft_takes_any_draft_and_raises_only_checkpoint_errors(target, tmp_path):
    """A checkpoint, a run folder and an export open to the same drafter; every bad path is a
    CheckpointError (ExportError is one) naming the file or field at fault."""
    from vatspec.checkpoint import save_checkpoint

    d, head = make_drafter("eagle3", target), make_head()
    ckpt = save_checkpoint(tmp_path / "run", 3, drafter=d, head=head, config_yaml="{}\n")
    served = export_draft(d, target, tmp_path / "served", head=head)
    for path in (tmp_path / "run", ckpt, served):
        back, h = open_draft(path, target, k=k)
        assert torch.equal(back.lm_head.weight, d.lm_head.weight) and torch.equal(h.proj.weight, head.proj.weight)
        assert back.k == back.config.ttt_steps == k and not back.training
    assert open_draft(ckpt, target, k=5)[0].k == 5  # the run's own unroll length

    other = Target(tiny_llama(vocab_size=64, hidden_size=H, layers=L), tokenizer=None)
    (tmp_path / "empty").mkdir()
    broken_run = tmp_path / "broken_run"
    broken_run.mkdir()
    (broken_run / "latest").write_text("step-000009\n")
    bad_json = tmp_path / "bad_json"
    shutil.copytree(ckpt, bad_json)
    (bad_json / "drafter.json").write_text("{not json")
    bad_weights = tmp_path / "bad_weights"
    shutil.copytree(ckpt, bad_weights)
    (bad_weights / "drafter.safetensors").write_bytes(b"not safetensors")
    bad_served = tmp_path / "bad_served"
    shutil.copytree(served, bad_served)
    (bad_served / "model.safetensors").write_bytes(b"not safetensors")
    cases = [
        (tmp_path / "nope", target, "nope does not exist"),
        (tmp_path / "empty", target, "neither a training checkpoint"),
        (broken_run, target, "names .*step-000009, which is missing"),
        (bad_json, target, "drafter.json: unreadable"),
        (bad_weights, target, "drafter.safetensors is unreadable"),
        (bad_served, target, "bad_served: unreadable weights"),
        (ckpt, other, "vocab_size=96 does not match the target \\(64\\)"),  # a checkpoint, another target
        (served, other, "vocab_size=96 does not match the target \\(64\\)"),  # an export, another target
    ]
    for path, t, msg in cases:
        with pytest.raises(CheckpointError, match=msg):
            open_draft(path, t)


# ----------------------------------------------------------------------------- third-party drafts
def test_imports_third_party_variants(target, tmp_path):
    """An SGLang-style HF draft (bf16 pytorch_model.bin, ids only in eagle_config) and a speculators
    draft carrying the verifier's embedding load into the same drafter."""
    d = make_drafter("eagle3", target)
    ours = export_draft(d, target, tmp_path / "ours")
    lmsys = tmp_path / "lmsys"
    lmsys.mkdir()
    cfg = json.loads((ours / "config.json").read_text())
    for name in ("eagle_aux_hidden_state_layer_ids", "norm_before_residual", "torch_dtype", "head_dim", "mlp_bias"):
        del cfg[name]
    (lmsys / "config.json").write_text(json.dumps(cfg))
    bf16 = {n: v.bfloat16() if v.is_floating_point() else v for n, v in load_file(ours / "model.safetensors").items()}
    torch.save(bf16, lmsys / "pytorch_model.bin")
    back = import_draft(lmsys, target, k=k)
    assert back.target_layer_ids == d.target_layer_ids and torch.equal(back.d2t, d.d2t)
    batch = make_batch()
    tout = target(batch["input_ids"], batch["attention_mask"], d.target_layer_ids)
    # bf16 weights: within bf16 rounding of the float32 draft, argmax mostly the same
    a, b = d.training_forward(batch, tout).logits, back.training_forward(batch, tout).logits
    assert torch.allclose(a, b, atol=0.15, rtol=0.05)
    # a transformers 5 config (rope_parameters) reads as its transformers 4 form does (layers.rope_parameters)
    v5 = {n: v for n, v in cfg.items() if n not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    (lmsys / "config.json").write_text(json.dumps(v5))
    c = import_draft(lmsys, target).config
    assert (c.rope_theta, c.rope_scaling) == (5e5, {"rope_type": "linear", "factor": 2.0})

    spec = export_draft(d, target, tmp_path / "spec", fmt="speculators")  # carries the target's embedding
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the target's own embedding: silently accepted
        assert torch.equal(import_draft(spec, target).lm_head.weight, d.lm_head.weight)

    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]  # disagrees with eagle_config's [1, 3, 4]
    (lmsys / "config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match="disagree; using SGLang's"):
        assert import_draft(lmsys, target).target_layer_ids == (1, 3, 4)
    cfg["norm_before_residual"] = True
    (lmsys / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="norm_before_residual=True is an EAGLE-3 variant"):
        import_draft(lmsys, target)
    with pytest.raises(CheckpointError, match="neither a training checkpoint"):
        open_draft(tmp_path, target)


# ----------------------------------------------------------------------------- the CLI, from a training run
def test_cli_exports_a_trained_run_and_train_can_start_from_it(smol_tokenizer_target, tmp_path, monkeypatch):
    from vatspec.cli import main
    from vatspec.config import load_config
    from vatspec.train import TrainError, train

    t = smol_tokenizer_target
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Count from {i} to {i + 5}."},
        {"from": "gpt", "value": " ".join(str(j) for j in range(i, i + 6)) + ". Done."}]}) + "\n" for i in range(8)))
    runs = {}
    for kind in ("eagle3", "dflash"):
        runs[kind] = tmp_path / kind
        train(load_config(None, [
            f"target.path={t.path}", f"data.train={data}", f"train.out_dir={runs[kind]}", f"drafter.kind={kind}",
            "loss.kind=vat", "data.batch_size=2", "data.max_length=48", "data.heldout_max=2", "train.steps=2",
            "drafter.draft_vocab_size=128", "drafter.ttt_steps=2", "drafter.block_size=4", "drafter.num_anchors=4",
        ]), progress=False)

    # the target comes from the checkpoint's config.yaml; the format from the drafter kind
    assert main(["export", str(runs["eagle3"]), "--out", str(tmp_path / "e3"), "--exit-threshold", "0.3"]) == 0
    assert main(["export", str(runs["eagle3"]), "--format", "speculators", "--out", str(tmp_path / "sp"),
                 "--verifier", "HuggingFaceTB/SmolLM2-135M-Instruct", "--weights-dtype", "bf16",
                 "--speculative-tokens", "3"]) == 0  # the speculators name of --k
    assert main(["export", str(runs["dflash"]), "--out", str(tmp_path / "df"), "--target", str(t.path)]) == 0
    assert main(["export", str(runs["eagle3"]), "--out", str(tmp_path / "e3")]) == 2  # exists, no --force
    assert main(["export", str(runs["eagle3"]), "--format", "dflash", "--out", str(tmp_path / "no")]) == 2
    assert [validate_export(tmp_path / n, t) for n in ("e3", "sp", "df")] == ["eagle3-hf", "speculators", "dflash"]
    assert load_accept_head(tmp_path / "e3")[1] == 0.3
    sp = json.loads((tmp_path / "sp" / "config.json").read_text())
    assert sp["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert sp["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3

    for run_dir, served in ((runs["eagle3"], "e3"), (runs["eagle3"], "sp"), (runs["dflash"], "df")):
        d, h = open_draft(run_dir, t)
        d2, h2 = open_draft(tmp_path / served, t, k=2)
        sd, sd2 = d.state_dict(), d2.state_dict()
        if served == "sp":  # that export was bfloat16: compare with the rounded float32 weights
            sd = {name: v.bfloat16().float() if v.is_floating_point() else v for name, v in sd.items()}
        assert sd.keys() == sd2.keys() and all(torch.equal(sd[name], sd2[name]) for name in sd)
        assert torch.equal(h.proj.weight, h2.proj.weight)  # the head is always saved in float32

    # what `vatspec train --init-from EXPORT loss.kind=vat` runs: fine-tune the imported draft
    runs["ft"] = tmp_path / "ft"
    ft = [f"target.path={t.path}", f"data.train={data}", f"train.out_dir={runs['ft']}", "loss.kind=vat",
          "data.batch_size=2", "data.max_length=48", "data.heldout_max=2", "train.steps=1", "drafter.ttt_steps=2"]
    with pytest.raises(TrainError, match="drafts over 128 tokens, but drafter.draft_vocab_size=32000; pass "
                                         "drafter.draft_vocab_size=128"):  # never silently its own
        train(load_config(None, ft), init_from=str(tmp_path / "sp"), progress=False)
    cfg = load_config(None, [*ft, "drafter.draft_vocab_size=128"])
    train(cfg, init_from=str(tmp_path / "sp"), progress=False)
    d, _ = open_draft(runs["ft"], t)
    assert d.kind == "eagle3" and d.config.draft_vocab_size == 128
    # the loss was resolved for drafter.kind: a draft of the other kind is refused before training
    other = load_config(None, [f"target.path={t.path}", f"data.train={data}", f"train.out_dir={tmp_path / 'x'}",
                               "drafter=dflash", "loss=vat"])
    with pytest.raises(TrainError, match="is a eagle3 draft, but drafter.kind=dflash; pass drafter.kind=eagle3"):
        train(other, init_from=str(tmp_path / "sp"), progress=False)


def test_served_files_take_the_users_file_mode(target, tmp_path):
    """safetensors creates 0600 files; an engine in a container runs as another user and must read the weights
    as it reads config.json: every file of an export and of a checkpoint takes the umask's mode."""
    import os
    import stat

    from vatspec.checkpoint import save_checkpoint

    old = os.umask(0o022)
    try:
        d = make_drafter("eagle3", target)
        out = export_draft(d, target, tmp_path / "served", fmt="eagle3-hf", head=make_head(), exit_threshold=0.5)
        ck = save_checkpoint(tmp_path / "run", 1, drafter=d, head=make_head(), config_yaml="{}\n",
                             trainer_state={"x": torch.zeros(2)})
    finally:
        os.umask(old)
    files = [p for p in list(out.rglob("*")) + list(ck.rglob("*")) if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == {p.name: 0o644 for p in files}


def test_a_gemma3_draft_is_built_with_silu_and_exports(tmp_path):
    """Gemma 3's MLP runs gelu_pytorch_tanh; the engines' draft layers run SiLU only. Both drafts are built with
    SiLU (said once, naming the target's activation), so a Gemma-3 draft trains and exports; a checkpoint saved
    with GELU (before) still loads for inference, and its export is refused in one line."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from vatspec.drafters import drafter_from_dict

    torch.manual_seed(0)
    gemma = Target(Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=L, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=8)).eval(), StubTokenizer())
    assert gemma.config.hidden_activation == "gelu_pytorch_tanh"
    with pytest.warns(UserWarning, match="'gelu_pytorch_tanh'; the EAGLE-3 draft is built with 'silu'"):
        d = Eagle3Drafter.from_target(gemma, draft_vocab_size=VD, ttt_steps=k)
    with pytest.warns(UserWarning, match="'gelu_pytorch_tanh'; the DFlash draft is built with 'silu'"):
        dc = DFlashConfig.from_target(gemma, num_layers=1, block_size=BLOCK, mask_token_id=5)
    x = torch.randn(5)
    assert d.config.hidden_act == "silu" and torch.equal(d.midlayer.mlp.act(x), torch.nn.functional.silu(x))
    assert torch.equal(DFlashDrafter(dc).layers[0].mlp.act(x), torch.nn.functional.silu(x))
    cfg, _ = read_export(export_draft(d, gemma, tmp_path / "served", fmt="eagle3-hf"))
    assert cfg["hidden_act"] == "silu"

    old = drafter_from_dict("eagle3", {**d.config.to_dict(), "hidden_act": "gelu_pytorch_tanh"}, gemma)
    old.load_state_dict(d.state_dict())
    s = old.new_session()  # an older GELU draft still drafts
    ids = torch.randint(3, V, (10,))
    s.extend(gemma(ids[None], layer_ids=old.target_layer_ids, logits=False).features[0][:9], ids[1:10])
    assert s.propose(3).tokens.shape == (3,)
    with pytest.raises(ExportError, match=r"SiLU only; this draft was trained with hidden_act='gelu_pytorch_tanh'"):
        export_draft(old, gemma, tmp_path / "old", fmt="eagle3-hf")


def test_an_interrupted_exports_leftovers_are_removed_by_the_next(target, tmp_path):
    """A killed export leaves ``.OUT.tmp-PID`` (a full copy of the weights) beside ``--out``; the next export to that
    folder removes the leftovers of processes that are gone, and keeps a running one's."""
    import os

    dead, live = tmp_path / ".served.tmp-4999999", tmp_path / f".served.tmp-{os.getppid()}"
    old = tmp_path / ".served.old-4999998"
    for folder in (dead, live, old):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x" * 16)
    other = tmp_path / ".other.tmp-4999999"  # another export's
    other.mkdir()
    export_draft(make_drafter("eagle3", target), target, tmp_path / "served", fmt="eagle3-hf")
    assert not dead.exists() and not old.exists()
    assert live.exists() and other.exists()
