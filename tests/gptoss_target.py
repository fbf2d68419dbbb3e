"""A tiny gpt-oss target for tests: transformers' own ``GptOssConfig`` with the shape features of the published
``openai/gpt-oss-20b`` config.json (alternating ``sliding_attention`` / ``full_attention`` layers, a 128-token
sliding window, a top-k mixture of experts, attention sinks, YaRN RoPE with the published parameters, biased
attention, untied embeddings) at tiny sizes, with the SmolLM2 tokenizer carrying gpt-oss' harmony special
tokens and the published chat template, and the published generation-config stop ids.

    path = build_gptoss_target(out_dir, smollm2_tokenizer_dir)                   # random weights
    path = build_gptoss_target(out_dir, smollm2_tokenizer_dir, speak=answer)    # taught one harmony answer

``speak``: a few Adam steps teach the random model to answer every prompt with the same harmony text
(``HARMONY_ANSWER``: an analysis message, then a final one, then ``<|return|>``), as a real gpt-oss does after
its generation prompt ``<|start|>assistant``; a random model would never write a channel marker, so
regeneration could not meet what a real gpt-oss writes.
"""

from __future__ import annotations

from pathlib import Path

import torch

TEMPLATE = Path(__file__).resolve().parent / "fixtures" / "chat_templates" / "openai-gpt-oss-20b.jinja"
# the harmony special tokens of the published tokenizer (tests/fixtures/chat_templates/families.yaml)
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>",
                  "<|endoftext|>"]
STOP_TOKENS = ["<|return|>", "<|endoftext|>", "<|call|>"]  # the published generation_config.json eos_token_id
DATE = "2026-01-15"  # the day the teaching prompts are rendered with (the template stamps a date)

# openai/gpt-oss-20b config.json: what is kept at tiny sizes (sizes, layer and expert counts are shrunk)
PUBLISHED = dict(
    sliding_window=128,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                     "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False},
    max_position_embeddings=131072,
    attention_bias=True,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    swiglu_limit=7.0,
    hidden_act="silu",
    router_aux_loss_coef=0.9,
    experts_per_token=4,  # the published file's own key beside num_experts_per_tok
    initial_context_length=4096,
)

REASONING = "Think briefly."
CONTENT = "Short answer."
HARMONY_ANSWER = (f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>final<|message|>"
                  f"{CONTENT}<|return|>")

def harmony_tokenizer(smollm2_dir):
    """The SmolLM2 fast tokenizer with the harmony special tokens added, gpt-oss' eos (``<|return|>``) and pad
    (``<|endoftext|>``), and the published template as its chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tok.eos_token, tok.pad_token = "<|return|>", "<|endoftext|>"
    tok.chat_template = TEMPLATE.read_text(encoding="utf-8")
    return tok


def gptoss_config(vocab_size: int, *, layers: int = 4, hidden: int = 64, experts: int = 4, top_k: int = 2,
                  heads: int = 4, kv_heads: int = 2, head_dim: int = 16, pad_token_id=None, eos_token_id=None):
    from transformers import GptOssConfig

    cfg = GptOssConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        num_local_experts=experts, num_experts_per_tok=top_k,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        pad_token_id=pad_token_id, eos_token_id=eos_token_id,
        **{k: v for k, v in PUBLISHED.items() if k not in ("experts_per_token", "initial_context_length")},
    )
    cfg.experts_per_token, cfg.initial_context_length = top_k, PUBLISHED["initial_context_length"]
    return cfg


def build_gptoss_target(out_dir, smollm2_dir, *, speak: str | None = None, layers: int = 4, seed: int = 0,
                        steps: int = 300, prompts: list = ()) -> Path:
    """Save a tiny gpt-oss (``gptoss_config``) with the harmony tokenizer (``harmony_tokenizer``) and
    ``generation_config.json`` eos ids ``[<|return|>, <|endoftext|>, <|call|>]`` to ``out_dir``; returns it.
    ``speak``: the text (after ``<|start|>assistant``) the model is taught to answer every prompt with;
    ``prompts`` (message lists, or ``{"messages", "tools"}``) are in every teaching batch beside the random ones,
    so the answer wins by the margin after these too (a tiny model taught on random prompts alone can still end
    its analysis with ``<|return|>`` after one of them, and how often depends on the machine's float rounding)."""
    from transformers import GenerationConfig, GptOssForCausalLM

    tok = harmony_tokenizer(smollm2_dir)
    stops = tok.convert_tokens_to_ids(STOP_TOKENS)
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(seed)
    model = GptOssForCausalLM(gptoss_config(len(tok), layers=layers, pad_token_id=pad, eos_token_id=stops[0])).eval()
    if speak is not None:
        _teach(model, tok, speak, steps, seed=seed, fixed=prompts)
    model.generation_config = GenerationConfig(eos_token_id=stops, pad_token_id=pad, do_sample=False)
    out = Path(out_dir)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _teach(model, tok, answer: str, steps: int, *, lr: float = 1e-2, margin: float = 3.0, rows: int = 4,
           seed: int = 0, fixed: list = ()) -> int:
    """Adam steps on fresh random prompts each step (one and two turns, 1 to 48 words: some past the 128-token
    window), the answer supervised alone, until every answer token of ``PATIENCE`` batches in a row wins by
    ``margin`` logits before it trains on them (so greedy decoding writes ``answer`` after prompts it never saw; ~70
    steps, ~20 s on a busy 2-core CPU). Returns the steps taken; raises if ``steps`` do not get there."""
    from vatspec.data.chat import ChatTemplate

    template = ChatTemplate(date=DATE)
    want = tok(answer, add_special_tokens=False)["input_ids"]
    g = torch.Generator().manual_seed(seed)

    def question() -> str:
        n = int(torch.randint(1, 49, (1,), generator=g))
        return " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (n,), generator=g)).capitalize() + "?"

    def batch():
        seqs = []
        for r in range(rows):
            msgs = [{"role": "user", "content": question()}]
            if r % 3 == 2:  # a second turn after an earlier answer, as the template renders history (no analysis)
                msgs += [{"role": "assistant", "content": CONTENT}, {"role": "user", "content": question()}]
            seqs.append(tok(template.render(tok, msgs, generation_prompt=True), add_special_tokens=False)["input_ids"])
        for item in fixed:  # a message list, or {"messages": ..., "tools": ...} rendered with its tools
            msgs, tools = (item["messages"], item.get("tools")) if isinstance(item, dict) else (item, None)
            seqs.append(tok(template.render(tok, msgs, generation_prompt=True, tools=tools),
                            add_special_tokens=False)["input_ids"])
        T = max(len(p) for p in seqs) + len(want)
        n = len(seqs)
        ids = torch.full((n, T), tok.pad_token_id)
        attn = torch.zeros((n, T), dtype=torch.long)
        at = torch.zeros((n, T), dtype=torch.bool)  # positions whose next token is an answer token
        for r, p in enumerate(seqs):
            ids[r, : len(p) + len(want)] = torch.tensor(p + want)
            attn[r, : len(p) + len(want)] = 1
            at[r, len(p) - 1: len(p) + len(want) - 1] = True
        return ids, attn, at, torch.tensor(want * n)

    # the embedding and the lm_head stay random (and frozen: most of the parameters, and of a step's cost)
    head = model.get_output_embeddings()
    with torch.no_grad():
        head.weight[torch.tensor(sorted(set(want)))] *= BOOST
    for p in (model.get_input_embeddings().weight, head.weight):
        p.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    good = 0
    for step in range(steps):  # noqa: B007 - the steps taken are returned
        ids, attn, at, labels = batch()
        logits = head(model.model(input_ids=ids, attention_mask=attn).last_hidden_state[at])
        with torch.no_grad():  # every answer token wins by the margin, on prompts not trained on yet
            target = logits.gather(1, labels[:, None])[:, 0]
            rival = logits.scatter(1, labels[:, None], float("-inf")).max(-1).values
            good = good + 1 if bool((target - rival).min() >= margin) else 0
        if good == PATIENCE:
            break
        loss = torch.nn.functional.cross_entropy(logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    else:
        raise RuntimeError(f"the tiny gpt-oss did not learn its harmony answer in {steps} steps")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(True)
    return step + 1


PATIENCE = 3  # batches of fresh prompts in a row that every answer token must win by the margin
BOOST = 32.0  # the answer tokens' lm_head rows are scaled by this: the model picks among them, not among 49k
_WORDS = ("the a of to and in is it you that he was for on are with as his they be at one have this from or had by "
          "word but what some we can out other were all there when up use your how said an each she which do their "
          "time if will way about many then them write would like so these her long make thing see him two has look "
          "more day could go come did number sound no most people my over know water than call first who may down "
          "side been now find any new work part take get place made live where after back little only round man year "
          "came show every good me give our under name very through just form sentence great think say help low line "
          "differ turn cause much mean before move right boy old too same tell does set three want air well also play "
          "small end put home read hand port large spell add even land here must big high such follow act why ask men "
          "change went light kind off need house picture try us again animal point mother world near build self earth "
          "father head stand own page should country found answer school grow study still learn plant cover food sun "
          "four between state keep eye never last let thought city tree cross farm hard start might story saw far sea "
          "draw left late run while press close night real life few north")
WORDS = _WORDS.split()
