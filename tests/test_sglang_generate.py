"""tools/sglang_generate.py: SGLang's per-request counters read as vllm_generate.py reports them."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def gen():
    return load_script("sglang_generate")  # imported by name: no SGLang needed, nothing patched


def test_importing_changes_nothing(gen):
    assert "sglang" not in sys.modules and "vllm._custom_ops" not in sys.modules
    assert gen.RUN is False


def test_counters_k1(gen):
    # meta_info of a 32-token EAGLE-3 request in SGLang 0.5.23 at num_steps 1 (18 rounds, 14 accepted)
    meta = {"spec_verify_ct": 18, "spec_num_correct_drafts": 14, "spec_num_proposed_drafts": 18,
            "spec_correct_drafts_histogram": [4, 14], "spec_accept_length": 1.78}
    assert gen.counters(meta, 1) == {"drafts": 18, "draft_tokens": 18, "accepted": 14, "accepted_per_pos": [14]}


def test_counters_k3_per_position(gen):
    # histogram[i]: rounds with i drafts accepted; a round with i accepted passes slots 0..i-1
    meta = {"spec_verify_ct": 10, "spec_num_correct_drafts": 2 * 1 + 2 * 2 + 1 * 3,
            "spec_correct_drafts_histogram": [5, 2, 2, 1]}
    c = gen.counters(meta, 3)
    assert c["accepted_per_pos"] == [5, 3, 1]
    assert sum(c["accepted_per_pos"]) == c["accepted"] == 9
    assert c["draft_tokens"] == 30  # no proposed count in meta: k a round


def test_counters_without_speculation(gen):
    # the target alone: no spec fields at all, and a histogram shorter than k + 1
    assert gen.counters({}, 3) == {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": [0, 0, 0]}
    short = gen.counters({"spec_verify_ct": 4, "spec_correct_drafts_histogram": [3, 1]}, 3)
    assert short["accepted_per_pos"] == [1, 0, 0]


def test_architecture_reads_the_export_config(gen, tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["DFlashDraftModel"]}')
    assert gen.architecture(tmp_path) == "DFlashDraftModel"
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert gen.architecture(tmp_path) == ""


def test_dflash_on_cpu_platform_allows_dflash_with_triton_only(gen):
    class Platform:  # what SGLang's platform answers for a plain CPU
        name = "cpu"

        def is_out_of_tree(self):
            return False

    p = gen._DFlashOnCpu(Platform())
    assert p.is_out_of_tree() and p.supports_speculative_algorithm("DFLASH")
    assert p.supports_speculative_draft_attention_backend("DFLASH", "triton")
    assert not p.supports_speculative_draft_attention_backend("DFLASH", "flashinfer")
    assert p.get_default_speculative_draft_attention_backend("DFLASH") == "triton"
    assert p.name == "cpu"  # everything else is the platform's own
