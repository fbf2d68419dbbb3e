"""Exports loaded by the third-party code users serve them with, not by this project's importer.

* vllm-project ``speculators`` 0.9.0: ``SpeculatorModel.from_pretrained`` on a ``--format
  speculators`` folder, the class vLLM's speculators support is built around;
* z-lab ``dflash`` 0.1.0: ``DFlashDraftModel.from_pretrained`` and ``dflash_generate`` on a
  ``--format dflash`` folder.

Both are installed by ``tools/setup.sh`` with ``--no-deps`` (only the imports they need). Each
test feeds the same target features to the loaded model and to this project's drafter and
compares the logits (``ATOL``) and the proposals; a negative control shows the comparison would
catch a draft served wrong.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import StubTokenizer, tiny_llama
from tests.test_export import BLOCK, H, L, V, k, make_drafter
from vatspec.eval.decode import generate
from vatspec.export import export_draft
from vatspec.target import Target

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-5  # float32, same weights, same inputs: only the order of float sums differs
SEQ = 129  # the speculators forward's default (flex) attention builds its block mask in 128-token blocks


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Target:
    """A tiny target saved as a folder: the speculators loader reads the verifier's config and
    weights from ``speculators_config.verifier.name_or_path``."""
    folder = tmp_path_factory.mktemp("target")
    model = tiny_llama(vocab_size=V, hidden_size=H, layers=L, seed=0)
    model.save_pretrained(folder)
    return Target(model, StubTokenizer(), folder)


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, V, (1, n), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- speculators
def speculators_logits(folder, features: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The library's draft logits at each TTT step: [1, T-1, Vd] per step, over chains t = 0..T-2
    (step i at chain t reads x_{t+1+i}, teacher-forced, as in training)."""
    from speculators.model import SpeculatorModel

    model = SpeculatorModel.from_pretrained(str(folder)).eval()
    logits: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: logits.append(out.detach()))
    T = ids.shape[1]
    with torch.no_grad():
        model(hidden_states=features[:, : T - 1], input_ids=ids[:, 1:], ttt_steps=steps,
              document_ids=torch.zeros(1, T - 1, dtype=torch.long), position_ids=torch.arange(T - 1)[None])
    hook.remove()
    return logits


def test_speculators_library_computes_what_vatspec_trained(target, tmp_path):
    d = make_drafter("eagle3", target)
    out = export_draft(d, target, tmp_path / "spec", fmt="speculators")
    ids = tokens(SEQ)
    tout = target(ids, None, d.target_layer_ids)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool),
             "loss_mask": torch.ones_like(ids, dtype=torch.bool)}
    ours = d.training_forward(batch, tout).logits  # [1, T-2, k, Vd]
    theirs = speculators_logits(out, tout.features, ids, k)
    assert len(theirs) == k
    Tc = SEQ - 2
    for i, lg in enumerate(theirs):  # chains whose step-i input is a real token
        a, b = ours[0, : Tc - i, i], lg[0, : Tc - i]
        assert (a - b).abs().max() <= ATOL, f"TTT step {i}"
        assert torch.equal(a.argmax(-1), b.argmax(-1)), f"TTT step {i}: proposals differ"

    # negative controls: TTT step 1 on drafts from the exported embedding (another one in the file
    # drafts something else), and a folder without it (what this project exported before) loads
    # without an error. The values of that load are not asserted: the library leaves the missing
    # weight uninitialised, so it holds whatever memory it got, at times a freed copy of the real one.
    w = load_file(out / "model.safetensors")
    emb = w["embed_tokens.weight"]
    save_file({**w, "embed_tokens.weight": emb.roll(1, dims=0)}, out / "model.safetensors", metadata={"format": "pt"})
    other = speculators_logits(out, tout.features, ids, k)
    assert (ours[0, : Tc - 1, 1] - other[1][0, : Tc - 1]).abs().max() > 100 * ATOL
    del w["embed_tokens.weight"]
    save_file(w, out / "model.safetensors", metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert len(speculators_logits(out, tout.features, ids, k)) == k


def test_speculators_library_reads_our_layer_ids_and_token_count(target, tmp_path):
    from speculators.model import SpeculatorModel

    d = make_drafter("eagle3", target)
    out = export_draft(d, target, tmp_path / "spec", fmt="speculators", k=5)
    model = SpeculatorModel.from_pretrained(str(out))
    # vLLM's convention (input of layer j = output of layer j - 1): ours + 1
    assert model.config.eagle_aux_hidden_state_layer_ids == [i + 1 for i in d.target_layer_ids]
    assert model.config.speculators_config.proposal_methods[0].speculative_tokens == 5
    assert model.config.speculators_config.verifier.name_or_path == target.path
    assert model.config.norm_before_residual is False


# ----------------------------------------------------------------------------- z-lab dflash
def test_dflash_reference_model_computes_what_vatspec_trained(target, tmp_path):
    from dflash.model import DFlashDraftModel, extract_context_feature
    from transformers import DynamicCache

    d = make_drafter("dflash", target)
    out = export_draft(d, target, tmp_path / "df")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no config-type warning: a qwen3 layer config
        ref = DFlashDraftModel.from_pretrained(str(out)).eval()
    assert ref.target_layer_ids == list(d.target_layer_ids) and ref.block_size == BLOCK
    assert ref.mask_token_id == d.mask_token_id

    prompt = tokens(24, seed=1)
    with torch.no_grad():
        hs = target.model(prompt, output_hidden_states=True).hidden_states
    ctx = extract_context_feature(hs, ref.target_layer_ids)  # [1, P, n*H]: the reference's features
    P = prompt.shape[1]
    pending = 7  # the token that follows the prompt: the block's anchor
    block = torch.full((1, BLOCK), ref.mask_token_id)
    block[0, 0] = pending
    with torch.no_grad():
        hidden = ref(target_hidden=ctx, noise_embedding=target.model.get_input_embeddings()(block),
                     position_ids=torch.arange(P + BLOCK)[None], past_key_values=DynamicCache(), use_cache=True)
        theirs = ref.compute_logits(hidden[:, 1:], target.model.lm_head)[0]  # [BLOCK-1, V]
    session = d.new_session()
    session.extend(ctx[0], torch.cat([prompt[0, 1:], torch.tensor([pending])]))  # tokens[j] follows position j
    ours, _ = session.draft_block()
    assert (ours - theirs).abs().max() <= ATOL
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_dflash_generate_matches_vatspec_decoding(target, tmp_path, monkeypatch):
    """The reference decode loop and this project's, on the same exported draft: the same tokens
    and the same accepted length in every round."""
    import time

    import dflash.model as zlab

    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # its timer synchronises CUDA
    d = make_drafter("dflash", target)
    out = export_draft(d, target, tmp_path / "df")
    ref = zlab.DFlashDraftModel.from_pretrained(str(out)).eval()
    prompt = tokens(16, seed=2)
    n = 24
    stats = zlab.dflash_generate(ref, target.model, prompt, n, stop_token_ids=None, return_stats=True)
    ours = generate(target, prompt[0], d, max_new_tokens=n)
    assert stats.output_ids[0, prompt.shape[1]:].tolist() == ours.tokens
    # the reference counts each round's committed tokens (accepted + the target's own)
    assert stats.acceptance_lengths == [r.accepted + 1 for r in ours.rounds][: len(stats.acceptance_lengths)]
    assert sum(stats.acceptance_lengths) == n - 1  # its first token comes from the prefill


def test_dflash_export_config_is_what_the_reference_reads(target, tmp_path):
    d = make_drafter("dflash", target)
    cfg = json.loads((export_draft(d, target, tmp_path / "df") / "config.json").read_text())
    from dflash.model import DFlashDraftModel

    assert DFlashDraftModel.config_class.model_type == cfg["model_type"] == "qwen3"


def test_check_catches_the_speculators_converters_missing_embedding(target, tmp_path):
    """speculators' own converter (``speculators convert``, eagle3-hf -> speculators) writes no
    embed_tokens.weight, so its folder loads with an uninitialised embedding under transformers 5;
    `vatspec check` names it, and this project's speculators export does not have the problem."""
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    from vatspec.eval.check import convention_findings

    d = make_drafter("eagle3", target)
    hf = export_draft(d, target, tmp_path / "hf")
    Eagle3Converter().convert(hf, tmp_path / "converted", base_model=target.path, validate=False)
    fmt, found = convention_findings(tmp_path / "converted", target)
    bad = {f.what: f.detail for f in found if not f.ok}
    assert fmt == "speculators" and list(bad) == ["embedding"] and "embed_tokens.weight is missing" in bad["embedding"]
    ours = export_draft(d, target, tmp_path / "ours", fmt="speculators")
    assert all(f.ok for f in convention_findings(ours, target)[1])
