"""Find the MLA model families of the installed transformers, and the rotary calls to patch.

Read from transformers' source files (``ast``, nothing imported or built here, besides the auto
mappings' name tables):

- **By code**: a modeling module ``transformers/models/<package>/modeling_*.py`` is MLA when
  one of its classes reads ``.kv_lora_rank`` (the MLA attention: ``DeepseekV3Attention``,
  ``LongcatFlashMLA``, ...). The rotary calls of a family are the calls, inside that class and
  the classes it builds (a DSA indexer), of a module-level function that is handed the rotary
  embedding: an argument computed from the ``position_embeddings`` parameter, the ``(cos, sin)``
  or ``freqs_cis`` that transformers' decoder layer passes to every attention. The function is
  then looked up in the module's globals when the attention runs, which is what the patch
  replaces. Which function a name is, and what it computes, is not decided here: the probe in
  ``_mapping`` runs it.
- **By config**: a configuration class with a ``kv_lora_rank`` field. Its model type (the auto
  mapping's) leads to the modeling module of its model class, so a config-only family
  (``sarvam_mla`` runs ``DeepseekV3Model``) is found with the code it runs on.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
from dataclasses import dataclass

# The parameter through which transformers' decoder layers hand every attention its rotary
# embedding (``(cos, sin)``, or DeepSeek-V2's complex ``freqs_cis``).
ROTARY_INPUT = "position_embeddings"
MLA_FIELD = "kv_lora_rank"


@dataclass(frozen=True)
class RotaryCall:
    """One call site of a module-level function that receives the rotary embedding."""

    function: str  # the module-level name the call looks up
    caller: str  # the class whose method makes the call
    keywords: tuple[tuple[str, object], ...] = ()  # literal keyword arguments (unsqueeze_dim=2)


@dataclass(frozen=True)
class ModelingModule:
    """A modeling module with an MLA attention."""

    package: str  # "deepseek_v3"
    module: str  # "transformers.models.deepseek_v3.modeling_deepseek_v3"
    attention: tuple[str, ...]  # the classes that read .kv_lora_rank
    builds: tuple[str, ...]  # module classes those build (DSA indexers, norms, ...)
    calls: tuple[RotaryCall, ...]
    classes: frozenset[str]  # every class the module defines

    @property
    def functions(self) -> tuple[str, ...]:
        """The module-level rotary functions called, in order of first call."""
        return tuple(dict.fromkeys(c.function for c in self.calls))


@dataclass(frozen=True)
class Discovery:
    """What the installed transformers has."""

    version: str
    modules: dict[str, ModelingModule]  # package -> its MLA modeling module
    model_types: dict[str, str]  # every model type that runs on an MLA module -> package
    config_only: dict[str, str]  # MLA model type without a modeling module -> package it runs on
    orphans: dict[str, str]  # MLA config whose model is in no MLA module -> the model class
    config_classes: dict[str, str]  # MLA model type -> its config class


def transformers_root() -> pathlib.Path:
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        raise ImportError("mlarope.integrations.transformers needs transformers installed")
    return pathlib.Path(spec.origin).parent


def _reads_attribute(node: ast.AST, attr: str) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == attr for n in ast.walk(node))


def _names_in(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _assigned_names(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _tainted(method: ast.FunctionDef) -> set[str]:
    """Local names computed from the method's ``position_embeddings`` parameter (a fixed point
    over its assignments; ``cos, sin = position_embeddings`` taints ``cos`` and ``sin``)."""
    params = method.args.posonlyargs + method.args.args + method.args.kwonlyargs
    tainted = {a.arg for a in params if a.arg == ROTARY_INPUT}
    if not tainted:
        return tainted
    flows: list[tuple[set[str], set[str]]] = []  # (names read, names written)
    for node in ast.walk(method):
        if isinstance(node, ast.Assign):
            written = set().union(*(_assigned_names(t) for t in node.targets))
            flows.append((_names_in(node.value), written))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            flows.append((_names_in(node.value), _assigned_names(node.target)))
        elif isinstance(node, ast.NamedExpr):
            flows.append((_names_in(node.value), {node.target.id}))
        elif isinstance(node, (ast.For, ast.comprehension)):
            flows.append((_names_in(node.iter), _assigned_names(node.target)))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            flows.append((_names_in(node.context_expr), _assigned_names(node.optional_vars)))
    changed = True
    while changed:
        changed = False
        for read, written in flows:
            if read & tainted and not written <= tainted:
                tainted |= written
                changed = True
    return tainted


def _literal(node: ast.AST) -> object:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def _rotary_calls(cls: ast.ClassDef, callables: set[str]) -> list[RotaryCall]:
    calls = []
    for method in cls.body:
        if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        tainted = _tainted(method)
        if not tainted:
            continue
        for node in ast.walk(method):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id not in callables:
                continue
            args = [*node.args, *(k.value for k in node.keywords)]
            if any(_names_in(a) & tainted for a in args):
                keywords = tuple((k.arg, _literal(k.value)) for k in node.keywords if k.arg)
                calls.append(RotaryCall(node.func.id, cls.name, keywords))
    return calls


def scan_modeling_source(source: str, package: str, module: str) -> ModelingModule | None:
    """The MLA attention of one modeling file and its rotary calls; None if it has none."""
    if MLA_FIELD not in source:
        return None
    tree = ast.parse(source)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    callables: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            callables.add(node.name)
        elif isinstance(node, ast.ImportFrom):
            callables.update(a.asname or a.name for a in node.names)
    callables -= set(classes)
    attention = [name for name, cls in classes.items() if _reads_attribute(cls, MLA_FIELD)]
    if not attention:
        return None
    # The classes the attention builds, transitively (an indexer, its norms, ...).
    built: list[str] = []
    frontier = list(attention)
    while frontier:
        cls = classes[frontier.pop()]
        for node in ast.walk(cls):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                name = node.func.id
                if name in classes and name not in attention and name not in built:
                    built.append(name)
                    frontier.append(name)
    calls = []
    for name in [*attention, *built]:
        calls += _rotary_calls(classes[name], callables)
    return ModelingModule(
        package=package,
        module=module,
        attention=tuple(attention),
        builds=tuple(built),
        calls=tuple(dict.fromkeys(calls)),
        classes=frozenset(classes),
    )


def _config_classes(root: pathlib.Path) -> set[str]:
    """Configuration classes that declare ``kv_lora_rank`` (a field or ``self.kv_lora_rank =``)."""
    found = set()
    for path in sorted(root.glob("models/*/configuration_*.py")):
        source = path.read_text(encoding="utf-8")
        if MLA_FIELD not in source:
            continue
        for cls in ast.parse(source).body:
            if not isinstance(cls, ast.ClassDef):
                continue
            for node in ast.walk(cls):
                targets: list[ast.AST] = []
                if isinstance(node, ast.AnnAssign):
                    targets = [node.target]
                elif isinstance(node, ast.Assign):
                    targets = node.targets
                for t in targets:
                    if (isinstance(t, ast.Name) and t.id == MLA_FIELD) or (
                        isinstance(t, ast.Attribute) and t.attr == MLA_FIELD
                    ):
                        found.add(cls.name)
    return found


def _class_names(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (tuple, list)):
        return tuple(v for v in value if isinstance(v, str))
    return ()


def discover() -> Discovery:
    """Scan the installed transformers (about half a second; the caller caches it)."""
    import transformers
    from transformers.models.auto import configuration_auto, modeling_auto

    root = transformers_root()
    modules: dict[str, ModelingModule] = {}
    for path in sorted(root.glob("models/*/modeling_*.py")):
        package = path.parent.name
        found = scan_modeling_source(
            path.read_text(encoding="utf-8"),
            package,
            f"transformers.models.{package}.{path.stem}",
        )
        if found is not None:
            modules[package] = found

    where = {cls: pkg for pkg, m in modules.items() for cls in m.classes}
    mappings = [
        getattr(modeling_auto, name, {})
        for name in ("MODEL_MAPPING_NAMES", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    ]
    model_types: dict[str, str] = {}
    for mapping in mappings:
        for model_type, value in mapping.items():
            for cls in _class_names(value):
                if cls in where:
                    model_types.setdefault(model_type, where[cls])

    mla_configs = _config_classes(root)
    config_classes = {
        model_type: cls
        for model_type, cls in configuration_auto.CONFIG_MAPPING_NAMES.items()
        if cls in mla_configs
    }
    config_only: dict[str, str] = {}
    orphans: dict[str, str] = {}
    to_package = getattr(configuration_auto, "model_type_to_module_name", lambda t: t)
    for model_type in config_classes:
        package = model_types.get(model_type)
        if package is None:
            names = [c for m in mappings for c in _class_names(m.get(model_type))]
            orphans[model_type] = names[0] if names else "(no model class in the auto mappings)"
        elif to_package(model_type) not in modules:
            config_only[model_type] = package
    return Discovery(
        version=transformers.__version__,
        modules=modules,
        model_types=model_types,
        config_only=config_only,
        orphans=orphans,
        config_classes=config_classes,
    )
