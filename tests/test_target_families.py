"""Targets of the families teams train drafts for, built by transformers from its own config classes (tiny random
weights, nothing downloaded): ``Target.logits`` is the model's own.
"""

from __future__ import annotations

import pytest
import torch

from vatspec.target import Target

pytestmark = pytest.mark.usefixtures("one_thread")

V = 64  # tiny vocabulary (the SmolLM2 tokenizer saved beside a folder is only read, never applied)
LAYER = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
# float32 rounding: Target.logits multiplies by 1 / logits_scaling where Granite divides
LOGITS_ATOL = 1e-6


# ----------------------------------------------------------------------------- logits
def family_config(name: str):
    import transformers as T

    mamba = dict(mamba_d_state=8, mamba_chunk_size=8)
    return {
        "llama": lambda: T.LlamaConfig(**LAYER),
        "falcon_h1": lambda: T.FalconH1Config(**LAYER, lm_head_multiplier=0.37, mamba_d_ssm=32, mamba_n_heads=4,
                                              mamba_d_head=8, mamba_n_groups=1, **mamba),
        "granite": lambda: T.GraniteConfig(**LAYER, logits_scaling=3.0),
        "granitemoehybrid": lambda: T.GraniteMoeHybridConfig(**LAYER, logits_scaling=3.0, mamba_n_heads=4,
                                                             layer_types=["mamba", "attention"], num_local_experts=2,
                                                             **mamba),
        "hyperclovax": lambda: T.HyperCLOVAXConfig(**LAYER, logits_scaling=3.0),  # multiplies by the same field
        "cohere": lambda: T.CohereConfig(**LAYER, logit_scale=0.25),
        "gemma3": lambda: T.Gemma3TextConfig(**LAYER, head_dim=8, final_logit_softcapping=0.5),
    }[name]()


@pytest.mark.parametrize("family", ["llama", "falcon_h1", "granite", "granitemoehybrid", "hyperclovax", "cohere",
                                    "gemma3"])
def test_logits_are_the_models_own(family):
    """What each family's forward does after its lm_head (a multiplier, a divisor, a soft cap) is in
    ``Target.logits``, so the teacher a draft learns and the verification it is judged by are the model's."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(family)).eval()
    t = Target(model, tokenizer=None)
    assert (t.logit_scale, t.logit_softcap) != (1.0, None) or family == "llama"  # each case has its transform
    ids = torch.randint(0, V, (2, 7))
    out = t(ids)
    torch.testing.assert_close(t.logits(out.hidden), model(input_ids=ids).logits.float(), atol=LOGITS_ATOL, rtol=0)
