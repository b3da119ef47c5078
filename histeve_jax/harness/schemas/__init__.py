"""Parameterised atomic subtask schemas: one YAML file each in this directory, validated with pydantic.

A schema says what the planner may ask for and how the harness checks it::

    name: mine_log                     # the subtask's name (must match the file name)
    task: mine_log                     # the atomic task whose ``text`` is the instruction the policy learned
    description: chop trees until the inventory holds `count` logs
    parameters:                        # semantic parameters: bounded integers or string enums
      count: {type: integer, minimum: 1, maximum: 8, default: 1}
    applicable: {nearby: [default:tree]}            # applicability conditions
    progress: {key: inventory, item: default:tree}  # the observable quantity that grows while it works
    completion: {inventory: {default:tree: ">={count}"}}
    failure:                           # recognizable failure conditions
      - {name: no_trees, when: {absent: [default:tree]}, recoverable: false}
    budget: {steps: 300, per_unit: 250}             # steps = steps + per_unit * count

Conditions are ``envs.tasks`` checks (``inventory``, event counters, ``near``, ``any``) whose strings may name
parameters (``">={count}"``), plus two keys of the harness: ``nearby: [names]`` (a watched node of one of
these kinds is in ``info["nearby"]``) and ``absent: [names]`` (none is). A schema instantiates into a
``Subtask``: the atomic task's text as the instruction, its conditions with the parameters filled in, its
step budget. Every error names the file and the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from histeve_jax.envs.tasks import TaskError, evaluate_check, load_task, render_instruction, validate_check

SCHEMA_DIR = Path(__file__).resolve().parent
MAX_INT_VALUES = 64  # integer parameters are enumerated by the constrained decoder: keep them bounded
HARNESS_KEYS = ("nearby", "absent")


class SchemaError(ValueError):
    """A schema file that does not follow the schema; the message names the file and the field."""


class ParameterError(ValueError):
    """Parameters that a schema does not admit; the message names the subtask and the parameter."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Parameter(_Strict):
    """One semantic parameter: a bounded integer or a string from an enum."""

    type: Literal["integer", "string"]
    minimum: int | None = None
    maximum: int | None = None
    enum: tuple[str, ...] | None = None
    default: int | str | None = None
    description: str = ""

    @model_validator(mode="after")
    def _bounded(self) -> Parameter:
        if self.type == "integer":
            if self.minimum is None or self.maximum is None or self.enum is not None:
                raise ValueError("an integer parameter needs minimum and maximum (and no enum)")
            if not 0 <= self.maximum - self.minimum < MAX_INT_VALUES:
                raise ValueError(f"minimum..maximum must span 1..{MAX_INT_VALUES} values")
        elif not self.enum or self.minimum is not None or self.maximum is not None:
            raise ValueError("a string parameter needs a non-empty enum (and no minimum/maximum)")
        if self.default is not None and not self.admits(self.default):
            raise ValueError(f"default {self.default!r} is not an admitted value")
        return self

    def admits(self, v: Any) -> bool:
        """Whether ``v`` is a value of this parameter."""
        if self.type == "integer":
            return isinstance(v, int) and not isinstance(v, bool) and self.minimum <= v <= self.maximum
        return isinstance(v, str) and v in self.enum

    def values(self) -> list[int | str]:
        """Every admitted value, in order."""
        return list(range(self.minimum, self.maximum + 1)) if self.type == "integer" else list(self.enum)

    def json_schema(self) -> dict[str, Any]:
        """This parameter as a JSON Schema."""
        if self.type == "integer":
            return {"type": "integer", "minimum": self.minimum, "maximum": self.maximum}
        return {"type": "string", "enum": list(self.enum)}


class Progress(_Strict):
    """The observable quantity that grows while the subtask works: ``info[key][item]``."""

    key: Literal["inventory", "mine_block", "craft_item", "pickup", "place_block", "use_item"]
    item: str


class FailureCondition(_Strict):
    """A recognizable failure: when ``when`` holds (and completion does not), the subtask failed."""

    name: str
    when: dict[str, Any]
    recoverable: bool = False
    description: str = ""


class Budget(_Strict):
    """Steps of one invocation: ``steps + per_unit * count`` (``count`` if the schema has it)."""

    steps: int = Field(gt=0)
    per_unit: int = Field(default=0, ge=0)


class SubtaskSchema(_Strict):
    """One parameterised atomic subtask (see the module docstring)."""

    name: str
    task: str
    description: str
    parameters: dict[str, Parameter] = Field(default_factory=dict)
    applicable: dict[str, Any] = Field(default_factory=dict)
    progress: Progress
    completion: dict[str, Any]
    failure: tuple[FailureCondition, ...] = ()
    budget: Budget

    def defaults(self) -> dict[str, Any]:
        """Each parameter's default (its first value when none is given)."""
        return {k: p.default if p.default is not None else p.values()[0] for k, p in self.parameters.items()}

    def check_params(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """``params`` with defaults filled in; ParameterError naming an unknown, missing or bad one."""
        params = dict(params or {})
        unknown = sorted(set(params) - set(self.parameters))
        if unknown:
            raise ParameterError(f"{self.name}: unknown parameter(s) {unknown}; it takes "
                                 f"{sorted(self.parameters) or 'none'}")
        out = self.defaults()
        for k, v in params.items():
            p = self.parameters[k]
            if not p.admits(v):
                want = (f"an integer in [{p.minimum}, {p.maximum}]" if p.type == "integer"
                        else f"one of {list(p.enum)}")
                raise ParameterError(f"{self.name}.{k}: must be {want}, got {v!r}")
            out[k] = v
        return out

    def instantiate(self, params: Mapping[str, Any] | None = None) -> Subtask:
        """The subtask with these parameters: instruction, filled-in conditions, step budget."""
        params = self.check_params(params)
        budget = self.budget.steps + self.budget.per_unit * int(params.get("count", 1) or 1)
        return Subtask(
            name=self.name, params=params, instruction=load_task(self.task).text, task=self.task,
            completion=fill(self.completion, params), applicable=fill(self.applicable, params),
            failure=tuple((f.name, fill(f.when, params), f.recoverable) for f in self.failure),
            progress=(self.progress.key, self.progress.item), budget=budget)

    def json_schema(self) -> dict[str, Any]:
        """The JSON Schema of one choice of this subtask: ``{"name": name, "parameters": {...}}``."""
        props = {k: p.json_schema() for k, p in self.parameters.items()}
        return {"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                "properties": {"name": {"type": "string", "enum": [self.name]},
                               "parameters": {"type": "object", "additionalProperties": False,
                                              "required": list(props), "properties": props}}}


@dataclasses.dataclass(frozen=True)
class Subtask:
    """A schema instantiated with parameters: what the executor is told and how the harness verifies it."""

    name: str
    params: dict[str, Any]
    instruction: str
    task: str
    completion: dict[str, Any]
    applicable: dict[str, Any]
    failure: tuple[tuple[str, dict[str, Any], bool], ...]
    progress: tuple[str, str]
    budget: int

    @property
    def label(self) -> str:
        """``name(k=v, ...)`` for logs and reports."""
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in sorted(self.params.items()))})"

    def instruction_at(self, info: Mapping[str, Any]) -> str:
        """The instruction as the executor is told it where the invocation starts (``instruction`` is the
        atomic task's text; a slot it names is read from ``info``, ``tasks.render_instruction``)."""
        return render_instruction(self.instruction, info, f"subtask {self.label}")

    def is_complete(self, info: Mapping[str, Any]) -> bool:
        return evaluate_condition(self.completion, info)

    def is_applicable(self, info: Mapping[str, Any]) -> bool:
        return evaluate_condition(self.applicable, info)

    def failures(self, info: Mapping[str, Any]) -> list[tuple[str, bool]]:
        """(name, recoverable) of the failure conditions that hold on ``info``."""
        return [(n, r) for n, when, r in self.failure if evaluate_condition(when, info)]

    def progress_value(self, info: Mapping[str, Any]) -> int:
        key, item = self.progress
        return int((info.get(key) or {}).get(item, 0))


# ---------------------------------------------------------------------------------------------- conditions


def fill(obj: Any, params: Mapping[str, Any]) -> Any:
    """``obj`` with every string formatted with ``params`` (``">={count}"`` -> ``">=3"``)."""
    if isinstance(obj, str):
        return obj.format(**params)
    if isinstance(obj, Mapping):
        return {k: fill(v, params) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [fill(v, params) for v in obj]
    return obj


def validate_condition(cond: Any, where: str, *, allow_empty: bool = False) -> None:
    """Raise ValueError naming ``where`` unless ``cond`` is a harness condition (see the module docstring)."""
    if not isinstance(cond, Mapping):
        raise ValueError(f"{where}: a condition must be a mapping, got {cond!r}")
    for key in HARNESS_KEYS:
        names = cond.get(key)
        if names is not None and (not isinstance(names, list) or not names
                                  or not all(isinstance(n, str) and n for n in names)):
            raise ValueError(f"{where}.{key}: must be a non-empty list of node names, got {names!r}")
    rest = {k: v for k, v in cond.items() if k not in HARNESS_KEYS}
    if rest:
        validate_check(rest, where)
    elif not cond and not allow_empty:
        raise ValueError(f"{where}: an empty condition")


def evaluate_condition(cond: Mapping[str, Any], info: Mapping[str, Any]) -> bool:
    """Whether every clause of a (filled-in) condition holds on an env info dict; {} always holds."""
    seen = {name for name, _ in info.get("nearby") or []}
    if "nearby" in cond and not seen & set(cond["nearby"]):
        return False
    if "absent" in cond and seen & set(cond["absent"]):
        return False
    rest = {k: v for k, v in cond.items() if k not in HARNESS_KEYS}
    return evaluate_check(rest, info) if rest else True


# ---------------------------------------------------------------------------------------------- loading


def _check_conditions(schema: SubtaskSchema, source: str) -> None:
    """Fill every condition with the defaults and validate it, naming the field on error."""
    params = schema.defaults()
    fields = [("completion", schema.completion, False), ("applicable", schema.applicable, True)]
    fields += [(f"failure[{i}].when", f.when, False) for i, f in enumerate(schema.failure)]
    for field, cond, empty_ok in fields:
        try:
            validate_condition(fill(cond, params), f"{source}: {field}", allow_empty=empty_ok)
        except KeyError as e:
            raise SchemaError(f"{source}: {field}: names parameter {e}, which the schema does not "
                              "declare") from None
        except (TaskError, ValueError) as e:
            raise SchemaError(str(e)) from None


def schema_from_dict(d: Any, source: str = "<dict>") -> SubtaskSchema:
    """Validate a parsed schema mapping; SchemaError naming ``source`` and the field."""
    try:
        schema = SubtaskSchema.model_validate(d)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            field = ".".join(str(p) for p in err["loc"]) or "(top level)"
            msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
            problems.append(f"{field}: {msg}")
        raise SchemaError(f"{source}: " + "; ".join(problems)) from None
    try:
        load_task(schema.task)
    except TaskError as e:
        raise SchemaError(f"{source}: task: {e}") from None
    _check_conditions(schema, source)
    return schema


def load_schema(path: str | Path) -> SubtaskSchema:
    """One schema file (YAML or JSON); its ``name`` must match the file name."""
    p = Path(path)
    try:
        d = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SchemaError(f"{p}: cannot read a schema: {e}") from None
    schema = schema_from_dict(d, str(p))
    if schema.name != p.stem:
        raise SchemaError(f"{p}: name: {schema.name!r} does not match the file name {p.stem!r}")
    return schema


def load_schemas(directory: str | Path = SCHEMA_DIR) -> dict[str, SubtaskSchema]:
    """Every ``*.yaml``/``*.json`` schema in ``directory`` (the shipped ones by default), by name."""
    d = Path(directory)
    paths = sorted([*d.glob("*.yaml"), *d.glob("*.json")])
    if not paths:
        raise SchemaError(f"{d}: no subtask schema files (*.yaml, *.json)")
    return {s.name: s for s in (load_schema(p) for p in paths)}


def reply_schema(schemas: Mapping[str, SubtaskSchema] | list[SubtaskSchema]) -> dict[str, Any]:
    """The JSON Schema of a planner reply, ``{"subtask": {"name": ..., "parameters": {...}}}`` with the
    choice ``anyOf`` the given schemas (a root object: OpenAI's strict mode admits no root ``anyOf``)."""
    items = list(schemas.values()) if isinstance(schemas, Mapping) else list(schemas)
    if not items:
        raise ValueError("reply_schema: no admissible subtask schemas")
    return {"type": "object", "additionalProperties": False, "required": ["subtask"],
            "properties": {"subtask": {"anyOf": [s.json_schema() for s in items]}}}
