"""Typed configuration: dataclasses documented on the field, loaded from YAML, overridden by
`key=value`, checked in `__post_init__`, so a bad value is refused when the config
is loaded, naming its key, instead of failing deep inside a phase on some node.

This module is the generic machinery plus the coordination section. Each component declares its
own dataclass (rollout/config.py, train/config.py); the driver composes them. Resolution order:
dataclass defaults <- YAML files (in order) <- `key=value` overrides. An unknown key is refused
with the closest valid keys; a value of the wrong type is refused with the expected type.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, get_args, get_origin

import yaml


class ConfigError(ValueError):
    """A configuration value or key a user must fix; the message says how."""


def option(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = dataclasses.MISSING) -> Any:
    """A documented config field. `help` is the one-line documentation configs/default.yaml repeats."""
    if not help:
        raise TypeError("every config field needs help text")
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata={"help": help})
    if isinstance(default, (list, dict, set)):
        raise TypeError("use factory= for mutable defaults")
    return field(default=default, metadata={"help": help})


def section(cls: type, help: str) -> Any:
    """A nested config section (a dataclass field holding another config dataclass)."""
    return field(default_factory=cls, metadata={"help": help})


# -- type coercion ---------------------------------------------------------------------------

def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in get_args(tp))}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    try:
        return _coerce_value(value, tp, key)
    except ConfigError as exc:
        about_the_env_section = key == SECRET_ENV_SECTION and not str(exc).startswith(key + ".")
        if not (is_secret_key(key) or about_the_env_section):
            raise
        raise ConfigError(f"{key} must be {_type_name(tp)} (the value given is not shown: it is a secret)") from None


def _coerce_value(value: Any, tp: Any, key: str) -> Any:
    origin = get_origin(tp)
    if isinstance(value, float) and tp not in (str, Any):
        finite(value, key)  # before a union's alternatives, so `float | None` names the real fault
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} is a section; give a mapping of its keys, not {value!r}")
        return _build(tp, value, key + ".")
    if tp is Any:
        return value
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise ConfigError(f"{key} must be one of {_type_name(tp)} (got {value!r})")
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{key} must be {_type_name(tp)} (got {value!r})")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key} must be null (got {value!r})")
    if origin is list:
        (item,) = get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list like [a, b] (got {value!r})")
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        kt, vt = get_args(tp) or (str, Any)
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping like {{a: 1}} (got {value!r})")
        return {str(k): _coerce(v, vt, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false (got {value!r})")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be an integer (got {value!r}); write it in digits, e.g. {key}=1000 or "
                          f"{key}=1_000")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key} must be a number (got {value!r}); write it as e.g. {key}=0.0002, {key}=2e-4 "
                          f"or {key}=3E-4")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # `model.path=123` parses as an int in YAML; a path is still a string
        raise ConfigError(f"{key} must be a string (got {value!r})")
    raise TypeError(f"unsupported config type {tp!r} for {key}")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted leaf key of a config dataclass, in declaration order."""
    keys: list[str] = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            keys.extend(all_keys(tp, f"{prefix}{f.name}."))
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _unknown_key(key: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else "; see configs/default.yaml for every key"
    return ConfigError(f"unknown config key {key!r}{hint}")


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = _hints(cls)
    names = {f.name: f for f in dataclasses.fields(cls)}
    kwargs, problems = {}, []
    # Every key of every section is read before anything is refused, so one run shows all the
    # values to fix (each section's own cross-checks run once its values are good).
    for k, v in data.items():
        try:
            if k not in names:
                raise _unknown_key(prefix + str(k), [prefix + n for n in names] + all_keys(cls, prefix))
            kwargs[k] = _coerce(v, hints[k], prefix + k)
        except ConfigError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError("\n".join(problems))
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        # Name the section of a nested check so "must be positive" says which key.
        msg = str(exc)
        if prefix and not msg.startswith(prefix):
            msg = f"{prefix}{msg}"
        raise ConfigError(msg) from None


def from_dict(cls: type, data: dict[str, Any]) -> Any:
    return _build(cls, data or {})


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


# -- YAML and overrides ----------------------------------------------------------------------

def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


class _Loader(yaml.SafeLoader):
    """YAML with numbers as users write them. PyYAML follows YAML 1.1, where a float needs a dot:
    `1e-6` and `3E-4` load as strings, and `train.lr=1e-6` was refused as "not a number". This
    loader also reads a mantissa with an exponent and no dot as a float (YAML 1.2's rule); every
    other scalar resolves as before (`1_000` was already the integer 1000)."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                              list("-+0123456789"))


def parse_yaml(text: str) -> Any:
    """`text` as YAML, with the numbers of `_Loader`."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def parse_override(text: str) -> tuple[str, Any]:
    """`train.lr=2e-4` -> ("train.lr", 0.0002). The value is parsed as YAML."""
    if "=" not in text or text.startswith("="):
        raise ConfigError(f"override {text!r} is not key=value (example: train.lr=2e-4)")
    key, raw = text.split("=", 1)
    try:
        value = parse_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        shown = f"{key.strip()}=..." if is_secret_key(key.strip()) or key.strip() == SECRET_ENV_SECTION else text
        raise ConfigError(f"override {shown!r}: the value is not valid YAML ({exc.problem})") from None
    return key.strip(), value


def apply_overrides(cls: type, data: dict, overrides: list[str]) -> dict:
    return set_values(cls, data, ((*parse_override(text), text) for text in overrides))


def set_values(cls: type, data: dict, values: Iterable[tuple[str, Any, str]]) -> dict:
    """`data` with each (dotted key, value, how the user gave it) set; the value as it is, not parsed."""
    valid = all_keys(cls)
    sections = {k.rsplit(".", 1)[0] for k in valid if "." in k}
    out = json.loads(json.dumps(data))  # deep copy of plain data
    for key, value, given in values:
        if key not in valid and not (key in sections and isinstance(value, dict)):
            raise _unknown_key(key, valid)
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {given!r}: {p} is not a section")
        node[parts[-1]] = value
    return out


def load_yaml(path: Path) -> dict:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")  # not the locale's encoding: every node reads the same keys
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise ConfigError(f"config file {path}:{line}: not UTF-8 text (byte {exc.object[exc.start]:#04x}); "
                          f"save it as UTF-8") from None
    try:
        data = parse_yaml(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, not {type(data).__name__}")
    return data


def load(cls: type, yaml_files: list[Path] = (), overrides: list[str] = (),
         values: dict[str, Any] | None = None) -> Any:
    """defaults <- each YAML file <- `values` (typed, e.g. from command-line flags: never parsed as
    YAML, so a path stays the string it is) <- key=value `overrides`."""
    data: dict = {}
    for f in yaml_files:
        data = _merge(data, load_yaml(f))
    data = set_values(cls, data, [(k, v, f"{k}={v}") for k, v in (values or {}).items()])
    data = apply_overrides(cls, data, list(overrides))
    return from_dict(cls, data)


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}"""
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def dict_hash(data: dict, exclude: tuple[str, ...] = ()) -> str:
    """Stable hash of resolved config data. `exclude` names dotted keys or sections that do not
    change what a run computes (logging, node-local settings) and so may differ between nodes."""
    flat = {k: v for k, v in flatten(data).items()
            if not any(k == e or k.startswith(e + ".") for e in exclude)}
    canon = json.dumps(flat, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


def config_hash(cfg: Any, exclude: tuple[str, ...] = ()) -> str:
    return dict_hash(to_dict(cfg), exclude)


def differences(a: dict, b: dict, exclude: tuple[str, ...] = ()) -> list[str]:
    """Human-readable `key: a -> b` lines for two config dicts."""
    fa, fb = flatten(a), flatten(b)
    keys = sorted(set(fa) | set(fb))
    return [f"{k}: {fa.get(k, '<absent>')!r} -> {fb.get(k, '<absent>')!r}" for k in keys
            if fa.get(k) != fb.get(k) and not any(k == e or k.startswith(e + ".") for e in exclude)]


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(redact(to_dict(cfg)), sort_keys=False)


# -- secrets -----------------------------------------------------------------------------------
# Keys whose value is a secret, and entries of inference.vllm.env whose names look like one
# (HF_TOKEN, WANDB_API_KEY, ...). Their value is given as `env:NAME` or `file:PATH` (a reference,
# read when used) or literally; a literal value is shown as *** wherever baton writes or prints
# config: config.yaml, dry runs, claim records, messages (docs/design.md §5 rule 11).
SECRET_KEYS = ("inference.vllm.api_key",)
SECRET_ENV_SECTION = "inference.vllm.env"
MASK = "***"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A word of the name, so HF_TOKEN and WANDB_API_KEY are secrets and TOKENIZERS_PARALLELISM is not.
_SECRET_NAME = re.compile(r"(^|_)(TOKEN|KEY|SECRET|PASSWORD|PASSWD|APIKEY)S?(_|$)", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    """An environment variable whose name says it holds a secret."""
    return bool(_SECRET_NAME.search(name))


def is_secret_key(key: str) -> bool:
    """A dotted config key whose value must never be shown."""
    section, _, name = key.rpartition(".")
    return key in SECRET_KEYS or (section == SECRET_ENV_SECTION and is_secret_name(name))


def is_secret_reference(value: str) -> bool:
    return value.startswith(("env:", "file:"))


def check_secret_reference(value: str, key: str) -> None:
    """A malformed env:/file: reference is a config error at load time, not at first use. The
    value is not repeated: a mistyped reference may be the secret itself."""
    if value.startswith("env:") and not _ENV_NAME.match(value[4:]):
        raise ConfigError(f"{key}: env: must be followed by an environment variable name, e.g. "
                          f"env:BATON_VLLM_API_KEY (the value given is not shown)")
    if value.startswith("file:") and not value[5:].strip():
        raise ConfigError(f"{key}: file: needs a path, e.g. file:/home/me/.baton/vllm-key")
    if value == MASK:
        raise ConfigError(f"{key} is {MASK!r}, the mask baton prints instead of a secret; give the secret as "
                          f"env:NAME or file:PATH")


def resolve_secret(value: str, key: str) -> str:
    """The secret a config value stands for: the named environment variable, the file's content
    (stripped), or the value itself. ConfigError names the variable or file, never the secret."""
    if value.startswith("env:"):
        name = value[4:]
        if not os.environ.get(name):
            raise ConfigError(f"{key}=env:{name}: environment variable {name} is not set (or empty) on this node; "
                              f"export it before scripts/run.sh")
        return os.environ[name]
    if value.startswith("file:"):
        path = Path(value[5:]).expanduser()
        try:
            secret = path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"{key}=file:{path}: cannot read it ({exc.strerror}); give a readable file") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{key}=file:{path}: not UTF-8 text; save the secret as UTF-8") from None
        if not secret:
            raise ConfigError(f"{key}=file:{path}: the file is empty")
        return secret
    return value


def _mask(value: Any) -> Any:
    return MASK if value and not (isinstance(value, str) and is_secret_reference(value)) else value


def redact(data: dict) -> dict:
    """A copy of resolved config data with literal secrets replaced by ***."""
    out = json.loads(json.dumps(data))
    for key in SECRET_KEYS:
        node, parts = out, key.split(".")
        for p in parts[:-1]:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict) and parts[-1] in node:
            node[parts[-1]] = _mask(node[parts[-1]])
    env = out
    for p in SECRET_ENV_SECTION.split("."):
        env = env.get(p) if isinstance(env, dict) else None
    if isinstance(env, dict):
        for name in env:
            if is_secret_name(str(name)):
                env[name] = _mask(env[name])
    return out


def redact_argv(argv: list[str]) -> list[str]:
    """Command-line words with literal secrets of `key=value` overrides replaced by ***: the
    secret keys, secret-named entries of inference.vllm.env, and such entries inside a whole
    `inference.vllm.env={...}` mapping."""
    out = []
    for word in argv:
        key, sep, value = word.partition("=")
        key = key.strip()
        if sep and is_secret_key(key) and value and not is_secret_reference(value):
            word = f"{key}={MASK}"
        elif sep and key == SECRET_ENV_SECTION:
            try:
                mapping = yaml.safe_load(value)
            except yaml.YAMLError:
                mapping = None
            if not isinstance(mapping, dict):
                word = f"{key}={MASK}"  # not a mapping: the run refuses it; still nothing to show
            elif any(is_secret_name(str(k)) for k in mapping):
                masked = {k: _mask(v) if is_secret_name(str(k)) else v for k, v in mapping.items()}
                word = f"{key}={yaml.safe_dump(masked, default_flow_style=True, width=10**6).strip()}"
        out.append(word)
    return out


def field_help(cls: type) -> dict[str, str]:
    """Dotted key -> help text, for documentation checks and `--help` of config keys."""
    out: dict[str, str] = {}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        out[f.name] = f.metadata.get("help", "")
        if dataclasses.is_dataclass(tp):
            out.update({f"{f.name}.{k}": v for k, v in field_help(tp).items()})
    return out


def finite(value: float, key: str) -> None:
    """YAML reads `.inf` and `.nan` as floats, and both pass `> 0`: `train.lr=.inf` would publish a
    checkpoint before anything failed, and an infinite timeout disables the wait it bounds."""
    if not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number (got {value!r}); give a number such as 1.0 or 2.0e-4")


def positive(value: float, key: str) -> None:
    if not value > 0:
        raise ConfigError(f"{key} must be positive (got {value!r})")


def non_negative(value: float, key: str) -> None:
    if not value >= 0:
        raise ConfigError(f"{key} must be zero or positive (got {value!r})")


@dataclass
class CoordinationConfig:
    """How nodes find each other and how long they wait (docs/design.md §5)."""

    heartbeat_interval: float = option(5.0, "seconds between heartbeat rewrites of each rank")
    peer_timeout: float = option(
        120.0, "a peer whose heartbeat counter has not changed for this many seconds (on the reader's clock) is lost")
    rejoin_timeout: float = option(
        1800.0, "after a peer is lost, survivors wait this long for it to be restarted before they exit")
    join_timeout: float = option(
        600.0, "a worker waits this long for the master's run manifest before it gives up")
    broken_record_timeout: float = option(
        60.0, "a shared file that stays unreadable (half-written, corrupt) this long is reported as broken; also how "
              "long a node waits at join for a record another node just created to show on its mount: keep it above "
              "the mounts' attribute-cache timeout (NFS acregmax, sshfs attr_timeout)")
    poll_min: float = option(0.02, "first polling interval of a wait, in seconds")
    poll_max: float = option(1.0, "longest polling interval of a wait, in seconds")
    dir_refresh_interval: float = option(
        5.0, "seconds between directory listings that refresh negative-lookup caches (NFS) during a wait")
    child_start_timeout: float = option(
        120.0, "a child (torchrun, an inference server) that is not running its command this many seconds after "
               "its launch is stopped and its launch fails, naming the command")
    stuck_report_after: float = option(
        300.0, "a node whose main thread stays in one place this long (no poll, no progress) says so, naming where, "
               "in its heartbeat message (status) and its log")
    gc_keep_iterations: int = option(
        3, "barrier folders of iterations older than this many iterations back are removed by the master")
    master_addr: str = option(
        "", "address other nodes use to reach the master (torchrun rendezvous); empty = this host's primary address")
    socket_ifname: str = option(
        "", "network interface for the trainers' gloo/NCCL traffic (sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME), "
            "e.g. ib0; empty = let them choose")

    def __post_init__(self) -> None:
        for key in ("heartbeat_interval", "peer_timeout", "rejoin_timeout", "join_timeout",
                    "broken_record_timeout", "poll_min", "poll_max", "dir_refresh_interval",
                    "child_start_timeout", "stuck_report_after"):
            positive(getattr(self, key), key)
        if self.peer_timeout <= 2 * self.heartbeat_interval:
            raise ConfigError(
                f"peer_timeout ({self.peer_timeout}) must exceed two heartbeat intervals "
                f"({2 * self.heartbeat_interval}); raise peer_timeout or lower heartbeat_interval")
        if self.poll_min > self.poll_max:
            raise ConfigError(f"poll_min ({self.poll_min}) must not exceed poll_max ({self.poll_max})")
        non_negative(self.gc_keep_iterations, "gc_keep_iterations")
