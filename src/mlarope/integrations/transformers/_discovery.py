"""Find the MLA model families of the installed transformers, and the rotary calls to patch.

Read from transformers' source files (``ast``, nothing imported or built here, besides the auto
mappings' name tables):

- **By code**: a modeling module ``transformers/models/<package>/modeling_*.py`` is MLA when
  one of its classes reads a latent rank, ``.kv_lora_rank`` or ``.q_lora_rank`` (the MLA
  attention: ``DeepseekV3Attention``, ``LongcatFlashMLA``, ...; DeepSeek-V4's attention has a
  latent query and one shared key-value head ``[nope | rope]``, MLA's absorbed form, and reads
  ``q_lora_rank`` only). The rotary calls of a family are the calls, inside that class and the
  classes it builds (a DSA indexer, a KV compressor; built by name or through a module-level
  table of classes), of a module-level function that is handed the rotary embedding: an
  argument computed from the ``position_embeddings`` parameter (the ``(cos, sin)`` or
  ``freqs_cis`` that transformers' decoder layer passes to every attention), or from a call of
  the module's own rotary embedding (the class whose output the model hands its layers as
  ``position_embeddings``; DeepSeek-V4's compressors and indexer own one and call it at their
  entries' positions). The function is then looked up in the module's globals when the
  attention runs, which is what the patch replaces. Which function a name is, and what it
  computes, is not decided here: the probe (``_probe``) runs it.
- **By config**: a configuration class with a ``kv_lora_rank`` or ``q_lora_rank`` field. Its
  model type (the auto mapping's) leads to the modeling module of its model class, so a
  config-only family (``sarvam_mla`` runs ``DeepseekV3Model``) is found with the code it runs
  on.
- **Through a sub-config**: a composite (multimodal) configuration class whose sub-config
  (``text_config``) is an MLA config by default, named by model type
  (``SubConfigSpec(config_class=AutoConfig, model_type="deepseek_v3")``, ``kimi_k25``) or by
  class; its model builds that sub-model (``AutoModel.from_config``), so the model type is
  served by the sub-config's family.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import pathlib
from dataclasses import dataclass

# The parameter through which transformers' decoder layers hand every attention its rotary
# embedding (``(cos, sin)``, or DeepSeek-V2's complex ``freqs_cis``).
ROTARY_INPUT = "position_embeddings"
# The latent ranks an MLA attention reads: the compressed key-value (DeepSeek-V2/V3 and their
# kin) or the compressed query (DeepSeek-V4, whose one shared key-value head is the latent).
MLA_FIELDS = ("kv_lora_rank", "q_lora_rank")
# A name no Python identifier can be: stands, among the names a value reads, for a call of the
# module's own rotary embedding (``self.rotary_emb(...)``).
_ROTARY_CALL = "<rotary embedding call>"


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
class Composite:
    """A model type whose configuration holds an MLA config as a sub-config."""

    model_type: str  # "kimi_k25"
    config_class: str  # "Kimi_K25Config"
    sub_config: str  # the field that holds it: "text_config"
    sub_model_type: str  # the sub-config's model type by default: "deepseek_v3"
    package: str  # the MLA modeling module that serves it: "deepseek_v3"


@dataclass(frozen=True)
class Discovery:
    """What the installed transformers has."""

    version: str
    modules: dict[str, ModelingModule]  # package -> its MLA modeling module
    model_types: dict[str, str]  # every model type that runs on an MLA module -> package
    config_only: dict[str, str]  # MLA model type without a modeling module -> package it runs on
    orphans: dict[str, str]  # MLA config whose model is in no MLA module -> the model class
    config_classes: dict[str, str]  # MLA model type -> its config class
    # composite model type -> the MLA sub-config that is its default and the module serving it
    composites: dict[str, Composite] = dataclasses.field(default_factory=dict)


def transformers_root() -> pathlib.Path:
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        raise ImportError("mlarope.integrations.transformers needs transformers installed")
    return pathlib.Path(spec.origin).parent


def _reads_attribute(node: ast.AST, attrs: tuple[str, ...]) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr in attrs for n in ast.walk(node))


def _self_attribute(node: ast.AST) -> str | None:
    """``attr`` for ``self.attr``, else None."""
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    ):
        return node.attr
    return None


def _names_in(node: ast.AST, rotary_attrs: frozenset[str] = frozenset()) -> set[str]:
    """The names ``node`` reads; :data:`_ROTARY_CALL` among them when it calls ``self.<attr>``
    for an attribute in ``rotary_attrs`` (the module's rotary embedding)."""
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    if rotary_attrs and any(
        isinstance(n, ast.Call) and _self_attribute(n.func) in rotary_attrs for n in ast.walk(node)
    ):
        names.add(_ROTARY_CALL)
    return names


def _assigned_names(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _tainted(method: ast.FunctionDef, rotary_attrs: frozenset[str] = frozenset()) -> set[str]:
    """Local names computed from the method's ``position_embeddings`` parameter, or from a call
    of one of ``rotary_attrs`` (``self.rotary_emb(...)``: the class's own rotary embedding), by
    a fixed point over its assignments (``cos, sin = position_embeddings`` taints ``cos`` and
    ``sin``). The result holds :data:`_ROTARY_CALL` when ``rotary_attrs`` is not empty, so that
    an argument that calls the rotary embedding directly counts too."""
    params = method.args.posonlyargs + method.args.args + method.args.kwonlyargs
    tainted = {a.arg for a in params if a.arg == ROTARY_INPUT}
    if rotary_attrs:
        tainted.add(_ROTARY_CALL)
    if not tainted:
        return tainted
    flows: list[tuple[set[str], set[str]]] = []  # (names read, names written)
    reads = lambda node: _names_in(node, rotary_attrs)
    for node in ast.walk(method):
        if isinstance(node, ast.Assign):
            written = set().union(*(_assigned_names(t) for t in node.targets))
            flows.append((reads(node.value), written))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            flows.append((reads(node.value), _assigned_names(node.target)))
        elif isinstance(node, ast.NamedExpr):
            flows.append((reads(node.value), {node.target.id}))
        elif isinstance(node, (ast.For, ast.comprehension)):
            flows.append((reads(node.iter), _assigned_names(node.target)))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            flows.append((reads(node.context_expr), _assigned_names(node.optional_vars)))
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


def _attribute_classes(cls: ast.ClassDef, classes: set[str]) -> dict[str, str]:
    """``self.attr = C(...)`` in ``cls``'s methods, for the module's classes ``C``: attr -> C."""
    return _class_facts(cls, classes)[0]


def _class_facts(cls: ast.ClassDef, classes: set[str]) -> tuple[dict[str, str], list[ast.AST]]:
    """In one walk of ``cls``: its attributes built from module classes (``self.attr =
    C(...)``: attr -> C) and the values it hands on as ``position_embeddings`` (assigned to that
    name, or passed as that keyword)."""
    attrs: dict[str, str] = {}
    handed: list[ast.AST] = []
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign):
            func = node.value.func if isinstance(node.value, ast.Call) else None
            if isinstance(func, ast.Name) and func.id in classes:
                for target in node.targets:
                    attr = _self_attribute(target)
                    if attr is not None:
                        attrs[attr] = func.id
            if any(isinstance(t, ast.Name) and t.id == ROTARY_INPUT for t in node.targets):
                handed.append(node.value)
        elif isinstance(node, ast.keyword) and node.arg == ROTARY_INPUT:
            handed.append(node.value)
    return attrs, handed


def _rotary_embedding_classes(classes: dict[str, ast.ClassDef]) -> set[str]:
    """The module's rotary embedding classes: those whose instance computes what a class hands
    on as ``position_embeddings`` (``position_embeddings = self.rotary_emb(x, position_ids)``,
    a dict of such calls, or ``position_embeddings=self.rotary_emb(...)`` in a call)."""
    found = set()
    for cls in classes.values():
        attrs, handed = _class_facts(cls, set(classes))
        for value in handed if attrs else ():
            for node in ast.walk(value):
                if isinstance(node, ast.Call) and _self_attribute(node.func) in attrs:
                    found.add(attrs[_self_attribute(node.func)])
    return found


def _rotary_calls(
    cls: ast.ClassDef, callables: set[str], rotary_classes: set[str], classes: set[str]
) -> list[RotaryCall]:
    rotary_attrs = frozenset(
        attr for attr, c in _attribute_classes(cls, classes).items() if c in rotary_classes
    )
    calls = []
    for method in cls.body:
        if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        tainted = _tainted(method, rotary_attrs)
        if not tainted:
            continue
        for node in ast.walk(method):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id not in callables:
                continue
            args = [*node.args, *(k.value for k in node.keywords)]
            if any(_names_in(a, rotary_attrs) & tainted for a in args):
                keywords = tuple((k.arg, _literal(k.value)) for k in node.keywords if k.arg)
                calls.append(RotaryCall(node.func.id, cls.name, keywords))
    return calls


def _class_tables(tree: ast.Module, classes: set[str]) -> dict[str, list[str]]:
    """Module-level names bound to a literal table of classes (``COMPRESSORS = {"csa":
    CSACompressor, ...}``): name -> the classes in it."""
    tables = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Dict, ast.List, ast.Tuple)):
            named = [n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)]
            in_table = [n for n in named if n in classes]
            for target in node.targets:
                if isinstance(target, ast.Name) and in_table:
                    tables[target.id] = in_table
    return tables


def _built_classes(cls: ast.ClassDef, classes: set[str], tables: dict[str, list[str]]) -> list[str]:
    """The module classes ``cls`` builds: called by name (``Indexer(config)``) or through a
    module-level table of classes (``COMPRESSORS[self.layer_type](config)``)."""
    built = []
    for node in ast.walk(cls):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in classes:
            built.append(func.id)
        elif (
            isinstance(func, ast.Subscript)
            and isinstance(func.value, ast.Name)
            and func.value.id in tables
        ):
            built.extend(tables[func.value.id])
    return list(dict.fromkeys(built))


def scan_modeling_source(source: str, package: str, module: str) -> ModelingModule | None:
    """The MLA attention of one modeling file and its rotary calls; None if it has none."""
    if not any(field in source for field in MLA_FIELDS):
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
    readers = [name for name, cls in classes.items() if _reads_attribute(cls, MLA_FIELDS)]
    tables = _class_tables(tree, set(classes))

    def builds(roots: list[str]) -> list[str]:
        """The classes ``roots`` build, transitively (an indexer, a compressor, norms, ...)."""
        built: list[str] = []
        frontier = list(roots)
        while frontier:
            for name in _built_classes(classes[frontier.pop()], set(classes), tables):
                if name not in roots and name not in built:
                    built.append(name)
                    frontier.append(name)
        return built

    # The attention: the classes that read a latent rank, less those another one builds
    # (DeepSeek-V4's indexer reads q_lora_rank, for the query latent its attention hands it).
    attention = [name for name in readers if name not in builds([r for r in readers if r != name])]
    if not attention:
        return None
    built = builds(attention)
    rotary_classes = _rotary_embedding_classes(classes)
    calls = []
    for name in [*attention, *built]:
        calls += _rotary_calls(classes[name], callables, rotary_classes, set(classes))
    return ModelingModule(
        package=package,
        module=module,
        attention=tuple(attention),
        builds=tuple(built),
        calls=tuple(dict.fromkeys(calls)),
        classes=frozenset(classes),
    )


def _config_classes(root: pathlib.Path) -> set[str]:
    """Configuration classes that declare a latent rank (:data:`MLA_FIELDS`: a field or
    ``self.kv_lora_rank =``)."""
    found = set()
    for path in sorted(root.glob("models/*/configuration_*.py")):
        source = path.read_text(encoding="utf-8")
        if not any(field in source for field in MLA_FIELDS):
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
                    if (isinstance(t, ast.Name) and t.id in MLA_FIELDS) or (
                        isinstance(t, ast.Attribute) and t.attr in MLA_FIELDS
                    ):
                        found.add(cls.name)
    return found


# The class attributes through which a composite configuration declares its sub-configs
# (transformers 5.24: ``sub_configs_defaults``; earlier releases: ``sub_configs``).
_SUB_CONFIG_TABLES = ("sub_configs_defaults", "sub_configs")


def _sub_configs(cls: ast.ClassDef, config_types: dict[str, str]) -> dict[str, str]:
    """A configuration class's sub-configs with a default model type: field -> that model type
    (``"text_config": SubConfigSpec(config_class=AutoConfig, model_type="deepseek_v3")``, or
    ``"text_config": SomeTextConfig``, a class of ``config_types``: class -> model type)."""
    found: dict[str, str] = {}
    for node in cls.body:
        if not (isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict)):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if not any(isinstance(t, ast.Name) and t.id in _SUB_CONFIG_TABLES for t in targets):
            continue
        for key, value in zip(node.value.keys, node.value.values, strict=True):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                continue
            model_type = None
            if isinstance(value, ast.Name):
                model_type = config_types.get(value.id)
            elif isinstance(value, ast.Call):
                for keyword in value.keywords:
                    if keyword.arg == "model_type" and isinstance(keyword.value, ast.Constant):
                        model_type = keyword.value.value
            if isinstance(model_type, str):
                found[key.value] = model_type
    return found


def _builds_from_sub_config(source: str, field: str) -> bool:
    """The modeling code builds a model from ``config.<field>`` through an auto class
    (``self.language_model = AutoModel.from_config(config.text_config)``)."""
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "from_config"
            and node.args
            and isinstance(node.args[0], ast.Attribute)
            and node.args[0].attr == field
        ):
            return True
    return False


def _composites(
    root: pathlib.Path,
    config_types: dict[str, str],
    served: dict[str, str],
    to_package,
) -> dict[str, Composite]:
    """Model types not served directly whose configuration holds, by default, a sub-config of a
    model type in ``served`` (model type -> the MLA package serving it) and whose modeling code
    builds that sub-model from it: model type -> :class:`Composite`."""
    model_type_of = {cls: t for t, cls in config_types.items()}
    needles = [f'"{t}"' for t in served] + [config_types[t] for t in served if t in config_types]
    found: dict[str, Composite] = {}
    for path in sorted(root.glob("models/*/configuration_*.py")):
        source = path.read_text(encoding="utf-8")
        if not any(table in source for table in _SUB_CONFIG_TABLES):
            continue
        if not any(needle in source for needle in needles):
            continue
        for cls in ast.parse(source).body:
            model_type = model_type_of.get(cls.name) if isinstance(cls, ast.ClassDef) else None
            if model_type is None or model_type in served:
                continue
            for field, sub_type in _sub_configs(cls, model_type_of).items():
                package = served.get(sub_type)
                if package is None:
                    continue
                modeling = sorted((root / "models" / to_package(model_type)).glob("modeling_*.py"))
                if any(
                    _builds_from_sub_config(m.read_text(encoding="utf-8"), field) for m in modeling
                ):
                    found.setdefault(
                        model_type, Composite(model_type, cls.name, field, sub_type, package)
                    )
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
    # The MLA model types (an MLA config, served by an MLA module) a composite may hold.
    served = {t: p for t, p in model_types.items() if t in config_classes}
    composites = {
        t: c
        for t, c in _composites(
            root, configuration_auto.CONFIG_MAPPING_NAMES, served, to_package
        ).items()
        if t not in model_types  # its model is in an MLA module itself (mistral_large4)
    }
    for model_type, composite in composites.items():
        model_types[model_type] = composite.package
    return Discovery(
        version=transformers.__version__,
        modules=modules,
        model_types=model_types,
        config_only=config_only,
        orphans=orphans,
        config_classes=config_classes,
        composites=composites,
    )
