"""One drafter interface: no module outside ``drafters/`` asks which kind it holds, and a third kind, registered in
``DRAFTERS`` and nowhere else, trains, checkpoints, reloads and decodes losslessly through the same stages as
EAGLE-3 and DFlash."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from tests.conftest import tiny_llama
from vatspec.drafters import DRAFTERS, SERVED_FORMATS, build_drafter, plan_batch
from vatspec.drafters.base import Drafter, DraftOutput, SavedConfig, batch_field
from vatspec.drafters.sampling import Proposal, sample, warp_logits
from vatspec.drafters.served import ServedFormat
from vatspec.target import Target

SRC = Path(__file__).resolve().parents[1] / "src" / "vatspec"
V, L = 64, 6  # the tiny target's vocabulary and layers
pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- no kind switches
def _names(node: ast.AST) -> set[str]:
    """The identifiers and attribute names an expression reads (``drafter.kind`` -> {"drafter", "kind"})."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)} | \
        {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _strings(node: ast.AST) -> set[str]:
    """The string constants of an expression, or of a tuple / list / set of them."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)}


def test_no_module_outside_drafters_asks_which_kind_it_holds():
    """Outside ``drafters/``: no import of a kind's folder (everything goes through the registry), and no comparison
    of a kind or a served format with one's name (``drafter.kind == "dflash"``, ``fmt != "speculators"``). The
    loss curves named after the reference trainers ("eagle3", "dflash" in ``objective/``) are loss names, not kinds:
    a comparison counts only where its other side reads a ``kind`` or a ``fmt`` / ``format``."""
    packages = {cls.__module__.rsplit(".", 1)[0] for cls in DRAFTERS.values()}  # vatspec.drafters.eagle3, ...
    names = set(DRAFTERS) | set(SERVED_FORMATS)
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("drafters/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and any((node.module or "").startswith(p) for p in packages):
                offenders.append(f"{rel}:{node.lineno} imports {node.module}")
            elif isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                for i, side in enumerate(sides):
                    others = set().union(*(_names(s) for j, s in enumerate(sides) if j != i))
                    if _strings(side) & names and others & {"kind", "fmt", "format"}:
                        offenders.append(f"{rel}:{node.lineno} compares a drafter kind or format by name")
    assert not offenders, offenders


def test_the_registry_lists_each_kind_with_its_formats():
    """Every kind answers what the stages ask before there is a drafter, and serves its own formats."""
    for kind, cls in DRAFTERS.items():
        assert cls.kind == kind and cls.title and cls.formats and cls.config_class
        assert set(cls.reference_optim) == {"lr", "warmup_ratio", "grad_clip"}
        assert all(SERVED_FORMATS[f.name] is f and f.kind == kind for f in cls.formats)
        assert cls.default_layer_ids(28) == sorted(set(cls.default_layer_ids(28)))  # distinct, increasing


# ----------------------------------------------------------------------------- a third kind
@dataclass(frozen=True)
class ToyConfig(SavedConfig):
    vocab_size: int
    hidden_size: int
    target_hidden_size: int
    target_layer_ids: tuple[int, ...]
    k: int = 2


class ToySession:
    """Drafts from the last committed position's features alone (the pending token is not read)."""

    def __init__(self, drafter: ToyDrafter):
        self.drafter, self.features = drafter, None

    def extend(self, features: Tensor, tokens: Tensor) -> None:
        self.features = features[-1]  # [n*H_t]

    @torch.no_grad()
    def propose(self, k: int, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> Proposal:
        logits = self.drafter.heads(self.features)[1][:k]  # [k, V]
        if temperature == 0:
            return Proposal(tokens=logits.argmax(-1))
        q = warp_logits(logits, temperature, top_k, top_p)
        return Proposal(tokens=sample(q, generator), q=q)


class ToyDrafter(Drafter):
    """k linear heads on the features at t: head j predicts x_{t+2+j}, as EAGLE-3's step j of chain t."""

    kind, title, config_class = "toy", "Toy", ToyConfig
    schedule = baseline_loss = "eagle3"
    reference_optim = {"lr": 1e-2, "warmup_ratio": 0.0, "grad_clip": 1.0}  # noqa: RUF012
    formats = ()

    def __init__(self, config: ToyConfig):
        super().__init__()
        c = self.config = config
        self.k, self.hidden_size, self.target_layer_ids = c.k, c.hidden_size, tuple(c.target_layer_ids)
        self.d2t = self.t2d = None  # drafts over the target's vocabulary
        self.fc = nn.Linear(len(c.target_layer_ids) * c.target_hidden_size, c.k * c.hidden_size)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    @classmethod
    def build(cls, cfg, target, token_counts=None) -> ToyDrafter:
        ids = tuple(cfg.target_layer_ids or cls.default_layer_ids(target.num_layers))
        return cls(ToyConfig(target.vocab_size, target.hidden_size, target.hidden_size, ids))

    @classmethod
    def default_layer_ids(cls, num_target_layers: int, num_layers: int = 1) -> list[int]:
        return [num_target_layers - 2]

    def attach_target(self, target) -> None:
        pass

    def heads(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """features [..., n*H_t] -> hidden [..., k, H], logits [..., k, V]."""
        hidden = torch.tanh(self.fc(features)).unflatten(-1, (self.k, self.hidden_size))
        return hidden, self.lm_head(hidden)

    def training_forward(self, batch, tout, **kwargs) -> DraftOutput:
        am, lm = batch_field(batch, "attention_mask").bool(), batch_field(batch, "loss_mask").bool()
        B, T = am.shape
        Tc, k = T - 2, self.k
        hidden, logits = self.heads(tout.features[:, :Tc])  # [B, T', k, H], [B, T', k, V]
        rows = torch.nn.functional.pad(tout.logits[:, 1:], (0, 0, 0, k))  # row t + j: the target's logits at t+1+j
        target_logits = torch.stack([rows[:, j : j + Tc] for j in range(k)], dim=2)  # [B, T', k, V]
        sup = torch.nn.functional.pad(am & lm, (0, k), value=False)
        label_ok = torch.stack([sup[:, 2 + j : 2 + j + Tc] for j in range(k)], dim=2)  # x_{t+2+j} supervised
        valid = ((am[:, :Tc] & am[:, 1 : Tc + 1])[..., None] & label_ok).long().cumprod(-1).bool()
        return DraftOutput(logits=logits, hidden=hidden, target_logits=target_logits, valid=valid)

    forward = training_forward

    def new_session(self, head=None, exit_threshold=None) -> ToySession:
        return ToySession(self)


def test_a_third_kind_trains_checkpoints_reloads_and_decodes_losslessly(monkeypatch, tmp_path):
    """Registered in ``DRAFTERS`` only: the config, the loss resolved from its schedule, its reference optimiser, a
    training step, the feature cache's layer ids, a checkpoint and its reload, and greedy decoding that commits
    exactly the target's own tokens."""
    from vatspec.checkpoint import load_checkpoint_draft, save_checkpoint
    from vatspec.config import load_config
    from vatspec.data import Batch
    from vatspec.eval.decode import generate
    from vatspec.features import drafter_layer_ids
    from vatspec.train import arms_micro_step, build_arm, step_generator

    monkeypatch.setitem(DRAFTERS, "toy", ToyDrafter)
    target = Target(tiny_llama(vocab_size=V, hidden_size=32, layers=L), tokenizer=None)
    cfg = load_config(None, ["drafter.kind=toy", "loss.kind=vat", "loss.chunk_size=0",
                             f"train.out_dir={tmp_path / 'run'}"])
    assert cfg.loss.curve == "eagle3"  # the kind's schedule
    assert drafter_layer_ids("toy", L) == [L - 2]

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, V, (2, 12), generator=g)
    lm = torch.ones_like(ids, dtype=torch.bool)
    lm[:, :3] = False
    batch = Batch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=lm)
    arm = build_arm(cfg, target, None, total=4, device="cpu")
    assert arm.optim_cfg.lr == ToyDrafter.reference_optim["lr"]
    before = {n: p.detach().clone() for n, p in arm.drafter.named_parameters()}
    for res in arms_micro_step([arm], target, batch, [step_generator(0, 0, 0, 0)]):
        res.loss.backward()
    arm.opt.step()
    assert any(not torch.equal(p, before[n]) for n, p in arm.drafter.named_parameters())  # it trained

    ckpt = save_checkpoint(tmp_path / "run", 1, drafter=arm.drafter, head=arm.module.head, config_yaml=arm.config_yaml)
    drafter, head = load_checkpoint_draft(ckpt, target, "cpu")
    assert isinstance(drafter, ToyDrafter) and drafter.config == ToyConfig.from_dict(arm.drafter.config.to_dict())
    for name, p in arm.drafter.state_dict().items():
        assert torch.equal(drafter.state_dict()[name], p)

    prompt = torch.randint(3, V, (6,), generator=g)
    served = generate(target, prompt, drafter, max_new_tokens=10)
    alone = generate(target, prompt, None, max_new_tokens=10)
    assert served.tokens == alone.tokens and len(served.rounds) >= 1


def test_a_third_kind_plans_and_builds_through_the_registry(monkeypatch):
    monkeypatch.setitem(DRAFTERS, "toy", ToyDrafter)
    from vatspec.config import DrafterConfig

    target = Target(tiny_llama(vocab_size=V, hidden_size=32, layers=L), tokenizer=None)
    drafter = build_drafter(DrafterConfig(kind="toy"), target)
    batch = {"input_ids": torch.zeros(1, 5, dtype=torch.long)}
    plan = plan_batch(drafter, batch, DrafterConfig(kind="toy"), None)
    assert (plan.logits_at, plan.kwargs, plan.target_logits) == (None, {}, True)  # logits everywhere: the default


def test_a_third_kind_is_asked_for_its_formats(monkeypatch, tmp_path):
    """The formats are read from ``DRAFTERS`` when asked: a kind registered after import serves the formats its class
    lists, and the export of a kind that lists none says so before it writes anything."""
    from vatspec.config import DrafterConfig
    from vatspec.export import CONFIG_KEYS, FORMATS, ExportError, default_format, export_draft, served_format

    monkeypatch.setitem(DRAFTERS, "toy", ToyDrafter)
    target = Target(tiny_llama(vocab_size=V, hidden_size=32, layers=L), tokenizer=None)
    drafter = build_drafter(DrafterConfig(kind="toy"), target)
    with pytest.raises(ExportError, match="no served format"):
        export_draft(drafter, target, tmp_path / "out")
    assert not (tmp_path / "out").exists()

    class ToyServed(ServedFormat):
        name, kind, config_keys = "toy-served", "toy", frozenset({"architectures"})

    served = ToyServed()
    monkeypatch.setattr(ToyDrafter, "formats", (served,))
    assert SERVED_FORMATS["toy-served"] is served and served_format("toy-served") is served
    assert FORMATS["toy-served"] == "toy" and CONFIG_KEYS["toy-served"] == {"architectures"}
    assert default_format(drafter) == "toy-served"
    assert list(FORMATS)[:3] == ["eagle3-hf", "speculators", "dflash"]  # the kinds' own formats first, in order
