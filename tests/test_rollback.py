"""Rolling the target's cache back after verification, for caches that forget (``vatspec.target.rollback``).

Tiny random targets of the three kinds of layer that forget past states — a gated delta-net hybrid (Qwen3-Next),
a short-convolution hybrid (LFM2) and chunked attention (Llama-4) — decode with drafts that are rejected at every
position 0..k (many rollbacks, past the window), and must say exactly what the target's own greedy ``generate``
says, by ``record`` (the default) and by ``replay``. The architecture matrix (``tests/test_architectures.py``)
runs the published families end to end; here the mechanism itself.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import StubTokenizer
from tests.test_decode import ScriptedDrafter, hf_greedy
from vatspec.eval.decode import generate
from vatspec.target import Target
from vatspec.target.rollback import Rollback, RollbackError, plan

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, NEW = 128, 24
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


def _model(kind: str):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "qwen3_next":
        cfg = tf.Qwen3NextConfig(**SIZES, num_hidden_layers=2, head_dim=16, linear_num_value_heads=4,
                                 linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"])
        model = tf.Qwen3NextForCausalLM(cfg)
    elif kind == "lfm2":
        model = tf.Lfm2ForCausalLM(tf.Lfm2Config(**SIZES, num_hidden_layers=2, layer_types=["conv", "full_attention"]))
    elif kind == "llama4":
        model = tf.Llama4ForCausalLM(tf.Llama4TextConfig(**SIZES, num_hidden_layers=4, head_dim=16,
                                                          intermediate_size_mlp=64, attention_chunk_size=8,
                                                          num_local_experts=2))
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**SIZES, num_hidden_layers=2))
    for p in model.parameters():  # peaked distributions: a varied greedy continuation, not one token repeated
        if p.dim() == 2:
            p.data.mul_(6.0)
    target = Target(model.eval(), StubTokenizer())
    target.model.generation_config.eos_token_id = None
    return target


@pytest.fixture(scope="module", params=["qwen3_next", "lfm2", "llama4"])
def forgetting(request):
    return _model(request.param)


def _decode(target, mode=None):
    prompt = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_greedy(target, prompt, NEW)
    assert len(set(ref)) > 3, ref  # varied tokens, so a wrong state would show
    drafter = ScriptedDrafter(target, prompt + ref, [0, 1, 2, 3, 0, 5], k=5)
    out = generate(target, prompt, drafter, max_new_tokens=NEW, rollback=mode)
    return out, ref


def test_a_plain_cache_is_cut_and_forgetting_layers_record():
    assert plan(_model("llama")).mode == "crop"
    kinds = {name: how for name, how in plan(_model("qwen3_next")).kinds.values()}
    assert kinds == {"LinearAttentionLayer": "record", "DynamicLayer": "crop"}
    kinds = {name: how for name, how in plan(_model("llama4")).kinds.values()}
    assert kinds == {"DynamicSlidingWindowLayer": "record", "DynamicLayer": "crop"}


@pytest.mark.parametrize("mode", [None, "replay"])
def test_decoding_rolls_back_every_kind_of_layer_exactly(forgetting, mode):
    out, ref = _decode(forgetting, mode)
    assert out.tokens == ref
    assert [r.accepted for r in out.rounds][:6] == [0, 1, 2, 3, 0, 5]  # every depth of rejection, and none
    assert len(out.rounds) > 6 and out.prompt_len + len(ref) > 8 * 2  # past the chunk of 8, twice


def test_a_layer_that_keeps_no_per_token_state_is_replayed(monkeypatch):
    """A model whose recurrent kernel returns only its last state cannot record: the probe finds it, decoding
    replays the accepted tokens instead, and forcing ``record`` is refused in one line."""
    from transformers import cache_utils

    monkeypatch.setattr(cache_utils.DynamicCache, "get_recurrent_states_to_keep", lambda self, *a, **k: 0)
    target = _model("qwen3_next")
    assert plan(target).mode == "replay"
    out, ref = _decode(target)
    assert out.tokens == ref
    with pytest.raises(RollbackError, match="cannot roll back by record: LinearAttentionLayer x1: replay"):
        Rollback(target, None, most_fed=4, mode="record")


def test_calibration_timings_leave_the_cache_as_it_was(forgetting):
    """``measure_round_timings`` verifies and drops whole passes again and again on one cache."""
    from vatspec.eval.calibrate import measure_round_timings

    class Fixed:  # drafts the same tokens, whatever it is told
        k, target_layer_ids = 2, (0,)

        def new_session(self, **_):
            return self

        def extend(self, *_):
            pass

        def propose(self, k, **_):
            from vatspec.drafters.sampling import Proposal

            return Proposal(torch.full((k,), 5, dtype=torch.long))

    timings = measure_round_timings(forgetting, Fixed(), list(range(1, 13)), 2, reps=2)
    assert len(timings.cost()[0]) == 3  # the AR step and k = 1, 2 costed
    out, ref = _decode(forgetting)  # and the target decodes exactly after it
    assert out.tokens == ref
