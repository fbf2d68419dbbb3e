"""Shared fixtures. Tiny models are built in code; nothing is downloaded."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TOOLS, PERF = ROOT / "tools", ROOT / "perf"  # what users run beside the CLI; benches


def load_script(name: str):
    """<name>.py of tools/ or perf/ as a module, imported as when run from its folder (so it finds the files
    beside it: a bench its ``timer``)."""
    folder = next((d for d in (TOOLS, PERF) if (d / f"{name}.py").is_file()), None)
    if folder is None:
        raise FileNotFoundError(f"{name}.py: in neither tools/ nor perf/")
    sys.path.insert(0, str(folder))
    try:
        spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(folder))
    return mod


def tiny_llama(vocab_size: int = 96, hidden_size: int = 32, layers: int = 6, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=2,
    )
    return LlamaForCausalLM(cfg).eval()


# 24 short chat conversations for training runs on tiny targets (the answer is a count, so it is learnable)
COUNT_CONVS = [
    {"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Count from {i} to {i + 5}, please."},
        {"from": "gpt", "value": " ".join(str(j) for j in range(i, i + 6)) + ". Done counting."},
    ]}
    for i in range(24)
]


class StubTokenizer:
    """What decoding and the drafters read from a tokenizer; tiny test models need no text."""

    eos_token_id = None

    def convert_ids_to_tokens(self, i: int) -> str:
        return f"<{i}>"


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared machine they lose a lot.
    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def tiny_target():
    from vatspec.target import Target

    return Target(tiny_llama(), tokenizer=None)


@pytest.fixture(scope="session")
def default_target_path():
    from vatspec.target import prepare_default_target

    return prepare_default_target()


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory, default_target_path):
    """A tiny random Llama (6 layers) saved with the SmolLM2 tokenizer (chat template), as a local HF folder."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_target_path)
    path = tmp_path_factory.mktemp("tiny_target")
    tiny_llama(vocab_size=len(tok), hidden_size=32, layers=6).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smol_tokenizer_target(tmp_path_factory, default_target_path):
    """A tiny random Llama (hidden 32, 8 layers: test_export's H and L) with the SmolLM2 tokenizer (so
    DFlash names its MASK token and chat templates apply), as a folder."""
    from transformers import AutoTokenizer

    from vatspec.target import Target

    tok = AutoTokenizer.from_pretrained(default_target_path)
    path = tmp_path_factory.mktemp("tiny_smol")
    tiny_llama(vocab_size=len(tok), hidden_size=32, layers=8).save_pretrained(path)
    tok.save_pretrained(path)
    return Target.from_pretrained(path)
