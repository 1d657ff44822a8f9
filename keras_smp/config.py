"""Configuration for keras-smp: the validated `SMPConfig` and how it is built.

This module is pure Python (standard library only) and never imports
TensorFlow, so configurations can be validated before any device is touched.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from collections.abc import Mapping
from typing import Any

__all__ = [
    "ALLOWED_KEYS",
    "CONFIG_KEYS",
    "KEY_ALIASES",
    "ENV_VAR",
    "LEGACY_ENV_VAR",
    "PER_PROCESS_KEYS",
    "SMPConfig",
    "agreement_record",
    "disagreements",
]

#: Environment variable holding a JSON object that overrides every other source.
ENV_VAR = "SMP_CONFIG"
#: SageMaker's environment variable for model-parallel parameters (same JSON form).
LEGACY_ENV_VAR = "SM_HP_MP_PARAMETERS"

#: Canonical option names, in the order of the `SMPConfig` fields.
CONFIG_KEYS: tuple[str, ...] = (
    "partitions",
    "microbatches",
    "pipeline",
    "optimize",
    "auto_partition",
    "default_partition",
    "contiguous",
    "horovod",
    "placement_strategy",
    "allreduce",
    "fusion_threshold_mb",
    "allreduce_pieces",
    "allreduce_compression",
    "collective_timeout_seconds",
    "local_devices",
    "activation_checkpointing",
    "virtual_stages",
    "tensor_parallel_degree",
)

#: Alternative spellings accepted on input, mapped to their canonical key.
KEY_ALIASES: dict[str, str] = {"pipeline_parallel_degree": "partitions",
                               "tp": "tensor_parallel_degree"}

#: Every key accepted by `SMPConfig.build` (canonical keys plus aliases).
ALLOWED_KEYS: tuple[str, ...] = CONFIG_KEYS + tuple(KEY_ALIASES)

_PIPELINES = {
    "gpipe": "gpipe",
    "1f1b": "1f1b",
    "1f1b_split": "1f1b_split",
    "zb_h1": "zb_h1",
    "interleaved_1f1b": "interleaved_1f1b",  # Megatron's, virtual stages
    "zb_v": "zb_v",
    "simple": "gpipe",  # SMP's name
    "interleaved": "1f1b",  # SMP's name
}
_OPTIMIZE = ("memory", "speed")
_PLACEMENTS = ("cluster", "spread")
_ALLREDUCE = ("auto", "ring", "hierarchical", "horovod")
#: `allreduce_compression`'s values besides None: the dtype gradients
#: travel as (SMP/SageMaker's "fp16"/"bf16" spellings are accepted).
_COMPRESSIONS = {"bfloat16": "bfloat16", "float16": "float16",
                 "bf16": "bfloat16", "fp16": "float16"}


# --------------------------------------------------------------------------
# Value checkers. Each returns the normalised value or raises ValueError.
# --------------------------------------------------------------------------


def _where(key: str, origins: Mapping[str, str] | None) -> str:
    origin = (origins or {}).get(key)
    return f" (from {origin})" if origin else ""


def _bad(key, value, expected, origins, fix=None) -> ValueError:
    msg = (
        f"Invalid keras-smp config value for '{key}'{_where(key, origins)}: "
        f"received {value!r}, expected {expected}."
    )
    if fix:
        msg += f" {fix}"
    return ValueError(msg)


def _check_int(key, value, minimum, origins) -> int:
    expected = f"an integer >= {minimum}"
    if isinstance(value, bool):
        raise _bad(key, value, expected, origins, "Booleans are not accepted here.")
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise _bad(key, value, expected, origins)
        value = int(value)
    if not isinstance(value, int):
        raise _bad(key, value, expected, origins, "Pass a number, not a string.")
    if value < minimum:
        raise _bad(key, value, expected, origins)
    return value


def _check_float(key, value, origins, *, strictly_positive: bool) -> float:
    expected = "a finite number > 0" if strictly_positive else "a finite number >= 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(key, value, expected, origins)
    value = float(value)
    if not math.isfinite(value) or value < 0 or (strictly_positive and value == 0):
        raise _bad(key, value, expected, origins)
    return value


def _check_bool(key, value, origins) -> bool:
    if not isinstance(value, bool):
        raise _bad(
            key, value, "True or False", origins,
            "Strings such as 'true' and numbers are not accepted; use a JSON "
            "boolean (true/false) or a Python bool.",
        )
    return value


def _check_checkpointing(value, partitions, origins):
    """`activation_checkpointing`: a bool, or the stages (distinct ints in
    0..partitions-1) and layer names (non-empty strings) that recompute,
    as a tuple: stages sorted, then names sorted."""
    if isinstance(value, bool):
        return value
    expected = (f"True, False, or a list of stage indices in "
                f"0..{partitions - 1} and/or layer names")
    if not isinstance(value, (list, tuple)) or not all(
            (isinstance(s, int) and not isinstance(s, bool))
            or (isinstance(s, str) and s) for s in value):
        raise _bad("activation_checkpointing", value, expected, origins)
    stages = sorted({s for s in value if isinstance(s, int)})
    names = sorted({s for s in value if isinstance(s, str)})
    if len(stages) + len(names) != len(value) or any(
            not 0 <= s < partitions for s in stages):
        raise _bad("activation_checkpointing", value, expected, origins,
                   "Each stage or layer at most once, and stages below "
                   "'partitions' (times 'virtual_stages').")
    return tuple(stages) + tuple(names)


def _check_choice(key, value, choices, origins) -> str:
    shown = " | ".join(repr(c) for c in choices)
    if not isinstance(value, str) or value.strip().lower() not in choices:
        raise _bad(key, value, f"one of {shown}", origins)
    return value.strip().lower()


def _normalise(values: Mapping[str, Any], origins: Mapping[str, str] | None = None) -> dict:
    """Validates a complete dict of canonical keys and returns normalised values."""
    out: dict[str, Any] = {}
    out["partitions"] = _check_int("partitions", values["partitions"], 1, origins)
    out["microbatches"] = _check_int("microbatches", values["microbatches"], 1, origins)
    pipeline = _check_choice("pipeline", values["pipeline"], tuple(_PIPELINES), origins)
    out["pipeline"] = _PIPELINES[pipeline]
    out["optimize"] = _check_choice("optimize", values["optimize"], _OPTIMIZE, origins)
    out["auto_partition"] = _check_bool("auto_partition", values["auto_partition"], origins)
    out["default_partition"] = _check_int(
        "default_partition", values["default_partition"], 0, origins
    )
    out["contiguous"] = _check_bool("contiguous", values["contiguous"], origins)
    out["horovod"] = _check_bool("horovod", values["horovod"], origins)
    out["placement_strategy"] = _check_choice(
        "placement_strategy", values["placement_strategy"], _PLACEMENTS, origins
    )
    out["allreduce"] = _check_choice("allreduce", values["allreduce"], _ALLREDUCE, origins)
    out["fusion_threshold_mb"] = _check_float(
        "fusion_threshold_mb", values["fusion_threshold_mb"], origins, strictly_positive=False
    )
    out["allreduce_pieces"] = _check_int(
        "allreduce_pieces", values["allreduce_pieces"], 1, origins)
    compression = values["allreduce_compression"]
    if compression is not None:
        if (not isinstance(compression, str)
                or compression.strip().lower() not in _COMPRESSIONS):
            raise _bad(
                "allreduce_compression", compression,
                "None, 'bfloat16' or 'float16' ('bf16', 'fp16')", origins,
                "None (the default) sums float32 gradients exactly; "
                "'bfloat16' sends them at half the bytes with float32's "
                "range (see docs/gradient-sync.md).")
        compression = _COMPRESSIONS[compression.strip().lower()]
    out["allreduce_compression"] = compression
    out["collective_timeout_seconds"] = _check_float(
        "collective_timeout_seconds", values["collective_timeout_seconds"], origins,
        strictly_positive=True,
    )
    local_devices = values["local_devices"]
    if local_devices is not None:
        try:
            local_devices = _check_int("local_devices", local_devices, 1, origins)
        except ValueError:
            raise _bad(
                "local_devices", values["local_devices"], "an integer >= 1 or None",
                origins, "Use None to drive all visible GPUs (or 1 CPU device).",
            ) from None
    out["local_devices"] = local_devices
    out["tensor_parallel_degree"] = _check_int(
        "tensor_parallel_degree", values["tensor_parallel_degree"], 1, origins)
    virtual = values["virtual_stages"]
    if virtual is not None:
        virtual = _check_int("virtual_stages", virtual, 1, origins)
    # The schedule layer (pure Python) knows each schedule's rules.
    from keras_smp.pipeline.schedule import get_schedule

    try:
        schedule = get_schedule(out["pipeline"], out["partitions"],
                                out["microbatches"], virtual)
    except ValueError as e:
        where = [f"{k} from {(origins or {})[k]}" for k in
                 ("pipeline", "partitions", "microbatches", "virtual_stages")
                 if (origins or {}).get(k)]
        where = f" ({'; '.join(where)})" if where else ""
        raise ValueError(f"Invalid keras-smp config{where}: {e}") from None
    out["virtual_stages"] = schedule.virtual_stages
    stages = out["partitions"] * out["virtual_stages"]
    out["activation_checkpointing"] = _check_checkpointing(
        values["activation_checkpointing"], stages, origins)

    # Cross-field checks.
    if out["default_partition"] >= stages:
        raise ValueError(
            f"Invalid keras-smp config value for 'default_partition'"
            f"{_where('default_partition', origins)}: received "
            f"{values['default_partition']!r}, but it must be < partitions="
            f"{out['partitions']}{_where('partitions', origins)}"
            + (f" x virtual_stages={out['virtual_stages']}"
               if out["virtual_stages"] > 1 else "")
            + f". Use a value in 0..{stages - 1}, or increase 'partitions'."
        )
    if out["horovod"]:
        if out["allreduce"] == "auto":
            out["allreduce"] = "horovod"
        elif out["allreduce"] != "horovod":
            raise ValueError(
                f"Conflicting keras-smp config: horovod=True{_where('horovod', origins)} "
                f"requires allreduce='horovod', but received allreduce="
                f"{values['allreduce']!r}{_where('allreduce', origins)}. Either drop "
                "'allreduce' (horovod=True implies allreduce='horovod') or set "
                "horovod=False to use the built-in all-reduce."
            )
    if out["allreduce"] == "horovod" and compression == "bfloat16":
        raise ValueError(
            "Conflicting keras-smp config: allreduce_compression='bfloat16'"
            f"{_where('allreduce_compression', origins)} with the Horovod "
            f"backend (allreduce='horovod'{_where('allreduce', origins)} or "
            "horovod=True): Horovod's allreduce carries no bfloat16. Use "
            "allreduce_compression='float16' (what hvd.Compression.fp16 "
            "sends), or allreduce='ring' / 'hierarchical'.")
    return out


# --------------------------------------------------------------------------
# Building from sources.
# --------------------------------------------------------------------------


def _canonical_source(source: Mapping, label: str) -> dict[str, Any]:
    """Checks keys of one source and resolves aliases; returns canonical keys."""
    out: dict[str, Any] = {}
    for key, value in source.items():
        if key in KEY_ALIASES:
            continue
        if key not in CONFIG_KEYS:
            msg = f"Unknown keras-smp config key {key!r} (from {label})."
            if isinstance(key, str):
                close = difflib.get_close_matches(key, ALLOWED_KEYS, n=1)
                if close:
                    msg += f" Did you mean {close[0]!r}?"
            msg += f" Allowed keys: {', '.join(ALLOWED_KEYS)}."
            raise ValueError(msg)
        out[key] = value
    for alias, target in KEY_ALIASES.items():
        if alias not in source:
            continue
        if target in source and source[target] != source[alias]:
            raise ValueError(
                f"Conflicting keras-smp config keys (from {label}): {target!r}="
                f"{source[target]!r} and its alias {alias!r}={source[alias]!r}. "
                f"Give only one of them, or give both the same value."
            )
        out[target] = source[alias]
    return out


def _read_env(environ: Mapping[str, str], name: str) -> dict | None:
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"Environment variable {name} is not valid JSON ({e}): received {raw!r}. "
            f"Expected a JSON object such as '{{\"partitions\": 2, \"microbatches\": 4}}'."
        ) from None
    if not isinstance(parsed, dict):
        raise ValueError(
            f"Environment variable {name} must hold a JSON object, but received "
            f"{type(parsed).__name__} {raw!r}. Expected e.g. "
            f"'{{\"partitions\": 2, \"microbatches\": 4}}'."
        )
    return parsed


@dataclasses.dataclass(frozen=True)
class SMPConfig:
    """Validated, immutable keras-smp configuration.

    Values are checked and normalised on construction (for instance SMP's
    pipeline name `"interleaved"` is stored as `"1f1b"`). Use
    `SMPConfig.build()` to merge a dict, keyword arguments and the
    `SMP_CONFIG` / `SM_HP_MP_PARAMETERS` environment variables.

    Args:
        partitions: Pipeline stages per model replica, an int >= 1.
            Alias: `pipeline_parallel_degree`.
        microbatches: Microbatches per step, an int >= 1 (1 = no pipelining).
        pipeline: `"1f1b"` (backward as early as possible), `"gpipe"`
            (all forwards, then all backwards), `"1f1b_split"` (1F1B
            with each backward split into input gradients, sent at once,
            and weight gradients), `"zb_h1"` (zero-bubble H1: weight
            gradients also deferred into the drain), `"interleaved_1f1b"`
            (Megatron's interleaved 1F1B: `virtual_stages` model stages
            per rank) or `"zb_v"` (zero-bubble V: two model stages per
            rank in a V); see docs/schedules.md. SMP's names
            `"interleaved"` and `"simple"` are accepted and mapped to the
            first two.
        optimize: Auto-partition balance, `"memory"` or `"speed"`.
        auto_partition: Whether layers are partitioned automatically.
        default_partition: Partition for layers outside any
            `smp.partition()` scope; must be < `partitions *
            virtual_stages`.
        contiguous: SMP's flag allowing non-contiguous partitions when
            False. Accepted for compatibility: keras-smp's automatic
            partitioning always cuts contiguous pieces (valid under either
            value).
        horovod: SMP's hybrid-parallelism flag; implies `allreduce="horovod"`.
        placement_strategy: `"cluster"` (a replica's stages on neighbouring
            ranks) or `"spread"`.
        allreduce: Gradient all-reduce implementation: `"auto"`, `"ring"`,
            `"hierarchical"` or `"horovod"`.
        fusion_threshold_mb: Tensor-fusion buffer size in MB, >= 0
            (0 disables fusion).
        allreduce_pieces: On CPU devices, the ring all-reduce sends each
            bucket as up to this many pieces of at least 1 MB, in flight
            together (an all-reduce alone is faster so over TensorFlow's
            gRPC collectives; measure your step with
            `benchmarks/pipeline_cpu.py --dp-only`); int >= 1, 1 (the
            default) keeps buckets whole. GPUs keep buckets whole (NCCL
            needs one launch order on every rank).
        allreduce_compression: `None` (the default: gradients are summed
            in their own dtype), `"bfloat16"` or `"float16"`: each
            replica's float32 dense gradient is rounded to that dtype for
            the data-parallel all-reduce, summed in it and cast back:
            half the bytes on the wire, at the cost of rounding each
            gradient to 8 (bfloat16) or 11 (float16) significant bits, so
            training no longer matches one device to float32 precision.
            `"bfloat16"` keeps float32's range; with `"float16"` a
            gradient or sum above 65504 becomes infinite (a
            `LossScaleOptimizer` checks each replica's gradients before
            they are summed: it does not skip that step) and small ones
            lose precision. Gradients kept sparse, other
            dtypes, the sums of a weight shared by pipeline stages,
            metrics and losses stay exact. `"bf16"` and `"fp16"` are
            accepted (see docs/gradient-sync.md).
        collective_timeout_seconds: Timeout for collectives, > 0.
        local_devices: Devices driven by each process (int >= 1), or None to
            use all visible GPUs, or on CPU 1 device (`partitions` logical
            devices for a pipeline held whole by one process). On CPU
            this many logical devices are created.
        activation_checkpointing: Recompute a stage's forward pass in its
            backward instead of keeping its activations between the two
            (less memory, one more forward per microbatch): `True` for every
            stage, or a list of stage indices and/or layer names (a named
            layer keeps only its inputs; its inner activations are
            recomputed, see `keras_smp.set_activation_checkpointing`).
            Random layers (`Dropout`) draw the same values and state
            updates (`BatchNormalization`'s moving statistics) apply once,
            so training is unchanged. Stage indices count model stages
            (`partitions * virtual_stages` of them).
        virtual_stages: Model stages per pipeline rank `v`: the model is
            cut into `partitions * v` stages and rank `r` runs stages `r,
            r + partitions, ...` (`"interleaved_1f1b"`, any `v >= 2`,
            default 2) or `r` and `2 partitions - 1 - r` (`"zb_v"`, 2).
            `None` (default) takes the schedule's own; stored as an int
            (1 for the other schedules, which accept only 1).
        tensor_parallel_degree: Ranks that split the layers marked
            tensor-parallel (`keras_smp.tensor_parallelism()`), an int
            >= 1; alias `tp`. Each rank is a worker process, and
            `partitions * tensor_parallel_degree` processes hold one model
            replica; or, in a job of one process with `local_devices`
            equal to it (and `partitions=1`), each rank is one of its
            local devices (see docs/tensor-parallelism.md).

    Example:

    ```python
    from keras_smp.config import SMPConfig

    config = SMPConfig(partitions=2, microbatches=4, pipeline="interleaved")
    assert config.pipeline == "1f1b"
    ```
    """

    partitions: int = 1
    microbatches: int = 1
    pipeline: str = "1f1b"
    optimize: str = "memory"
    auto_partition: bool = True
    default_partition: int = 0
    contiguous: bool = True
    horovod: bool = False
    placement_strategy: str = "cluster"
    allreduce: str = "auto"
    fusion_threshold_mb: float = 64.0
    allreduce_pieces: int = 1
    allreduce_compression: str | None = None
    collective_timeout_seconds: float = 300.0
    local_devices: int | None = None
    activation_checkpointing: bool | tuple = False
    virtual_stages: int | None = None
    tensor_parallel_degree: int = 1

    @property
    def num_model_stages(self) -> int:
        """Pieces the model is cut into: `partitions * virtual_stages`."""
        return self.partitions * self.virtual_stages

    def __post_init__(self):
        raw = {key: getattr(self, key) for key in CONFIG_KEYS}
        for key, value in _normalise(raw).items():
            object.__setattr__(self, key, value)

    @classmethod
    def build(
        cls,
        config: "SMPConfig | Mapping[str, Any] | None" = None,
        /,
        *,
        environ: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> "SMPConfig":
        """Builds a config from a dict/config, keyword overrides and env vars.

        Sources, from lowest to highest precedence: `config`, `kwargs`, the
        JSON object in `SM_HP_MP_PARAMETERS` (SageMaker's legacy variable),
        the JSON object in `SMP_CONFIG`. Keys missing everywhere take their
        defaults. `pipeline_parallel_degree` is accepted as an alias of
        `partitions`.

        Args:
            config: None, a dict of options, or an `SMPConfig`.
            environ: Mapping to read environment variables from. Defaults to
                `os.environ`.
            **kwargs: Options overriding the keys of `config`.

        Returns:
            A validated `SMPConfig`.

        Raises:
            ValueError: On an unknown key, an invalid value, conflicting keys,
                or malformed JSON in an environment variable.
            TypeError: If `config` is not None, a mapping or an `SMPConfig`.

        Example:

        ```python
        from keras_smp.config import SMPConfig

        config = SMPConfig.build(
            {"pipeline_parallel_degree": 2, "microbatches": 2},
            microbatches=8,
            environ={"SMP_CONFIG": '{"pipeline": "simple"}'},
        )
        assert (config.partitions, config.microbatches, config.pipeline) == (2, 8, "gpipe")
        ```
        """
        environ = os.environ if environ is None else environ
        if config is None:
            base: Mapping = {}
        elif isinstance(config, SMPConfig):
            # What it set (its defaults stay defaults, for `origin`).
            base = {key: value for key, value in config.to_dict().items()
                    if config.origin(key) != "default"}
            # Its virtual_stages is resolved (1, or 2 for interleaved_1f1b
            # and zb_v): when that is its schedule's own default, leave it
            # unset, so that another `pipeline` given here (or in the
            # environment) takes its own default instead of failing.
            from keras_smp.pipeline.schedule import get_schedule

            if config.virtual_stages == get_schedule(
                    config.pipeline, config.partitions,
                    config.microbatches).virtual_stages:
                base.pop("virtual_stages", None)
        elif isinstance(config, Mapping):
            base = config
        else:
            raise TypeError(
                f"keras-smp config must be None, a dict or an SMPConfig; received "
                f"{type(config).__name__} {config!r}. Pass e.g. "
                f"{{'partitions': 2, 'microbatches': 4}}."
            )

        sources: list[tuple[str, Mapping]] = [
            ("the config argument", base),
            ("keyword arguments", kwargs),
        ]
        for name in (LEGACY_ENV_VAR, ENV_VAR):  # later wins
            parsed = _read_env(environ, name)
            if parsed is not None:
                sources.append((f"environment variable {name}", parsed))

        merged: dict[str, Any] = {}
        origins: dict[str, str] = {}
        for label, source in sources:
            for key, value in _canonical_source(source, label).items():
                merged[key] = value
                origins[key] = label

        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        values = {key: merged.get(key, defaults[key]) for key in CONFIG_KEYS}
        built = cls(**_normalise(values, origins))
        # Not a field (equality and `to_dict` ignore it): where each key
        # came from, for messages (`origin`).
        object.__setattr__(built, "_origins", dict(origins))
        return built

    def origin(self, key: str) -> str:
        """Where option `key` came from: `"the config argument"`,
        `"keyword arguments"`, `"environment variable SMP_CONFIG"` (or
        `SM_HP_MP_PARAMETERS`) for a config made by `SMPConfig.build`,
        `"SMPConfig arguments"` for one made directly; `"default"` for a
        key no source set.

        Example:

        ```python
        from keras_smp.config import SMPConfig

        config = SMPConfig.build({"partitions": 2}, microbatches=4,
                                 environ={"SMP_CONFIG": '{"pipeline": "gpipe"}'})
        assert config.origin("partitions") == "the config argument"
        assert config.origin("microbatches") == "keyword arguments"
        assert config.origin("pipeline") == "environment variable SMP_CONFIG"
        assert config.origin("optimize") == "default"
        ```
        """
        if key not in CONFIG_KEYS:
            raise ValueError(f"Unknown keras-smp option {key!r}; the options "
                             f"are {', '.join(CONFIG_KEYS)}.")
        origins = getattr(self, "_origins", None)
        if origins is not None:  # made by `build`: the rest are defaults
            return origins.get(key, "default")
        if getattr(self, key) == getattr(type(self)(), key):
            return "default"
        return "SMPConfig arguments"

    def to_dict(self) -> dict[str, Any]:
        """Returns the normalised options as a plain dict of canonical keys.

        Returns:
            A new dict mapping every key of `CONFIG_KEYS` to its value.

        Example:

        ```python
        from keras_smp.config import SMPConfig

        d = SMPConfig(pipeline="simple").to_dict()
        assert d["pipeline"] == "gpipe" and SMPConfig(**d) == SMPConfig(pipeline="gpipe")
        ```
        """
        return {key: getattr(self, key) for key in CONFIG_KEYS}


# --------------------------------------------------------------------------
# One job, one configuration: what every process must agree on.
# --------------------------------------------------------------------------

#: Options that may differ between the processes of one job: how long each
#: rank itself waits (the rank with the shortest wait reports a lost peer
#: first), and `local_devices` (what it resolves to, the pipeline mode and
#: the replicas and devices per process, is compared instead: an 8-GPU
#: node may set 4 beside a 4-GPU node's None). Every other option must be
#: the same on every rank.
PER_PROCESS_KEYS = frozenset({"collective_timeout_seconds", "local_devices"})

#: The most ranks named per value in a disagreement message.
_RANKS_SHOWN = 4


def _jsonable(value):
    return list(value) if isinstance(value, tuple) else value


def agreement_record(config: SMPConfig, versions: Mapping[str, str],
                     resolved: Mapping[str, Any] | None = None) -> dict:
    """What one process must share with every other process of its job.

    Args:
        config: this process's `SMPConfig`.
        versions: package name -> version of what must match across the
            job, e.g. `{"keras-smp": "0.1.0", "TensorFlow": "2.21.0"}`.
        resolved: what the process made of its options and machine that
            must also match, e.g. `{"devices per process": 2}` (TensorFlow's
            collectives need as many local devices on every worker).

    Returns:
        A JSON-serialisable dict: `options` (every key but
        `PER_PROCESS_KEYS`), their `origins`, `resolved` and `versions`.

    Example:

    ```python
    from keras_smp.config import SMPConfig, agreement_record

    record = agreement_record(SMPConfig(partitions=2), {"keras-smp": "0.1.0"})
    assert record["options"]["partitions"] == 2
    assert "collective_timeout_seconds" not in record["options"]
    assert record["origins"]["partitions"] == "SMPConfig arguments"
    assert record["origins"]["microbatches"] == "default"
    ```
    """
    keys = [k for k in CONFIG_KEYS if k not in PER_PROCESS_KEYS]
    return {"options": {k: _jsonable(getattr(config, k)) for k in keys},
            "origins": {k: config.origin(k) for k in keys},
            "resolved": {k: _jsonable(v) for k, v in (resolved or {}).items()},
            "versions": dict(versions)}


def ranks_text(ranks):
    """`"rank 2"`, `"ranks 0, 1"`, or the first few and how many more.

    Example:

    ```python
    from keras_smp.config import ranks_text

    assert ranks_text([2]) == "rank 2"
    assert ranks_text([0, 1, 2, 3, 4, 5]) == "ranks 0, 1, 2, 3 and 2 more"
    ```
    """
    shown = ", ".join(str(r) for r in ranks[:_RANKS_SHOWN])
    more = len(ranks) - _RANKS_SHOWN
    return ("rank " if len(ranks) == 1 else "ranks ") + shown + (
        f" and {more} more" if more > 0 else "")


def disagreements(records: Mapping[int, Mapping]) -> str | None:
    """`None` when every rank's `agreement_record` has rank 0's options,
    resolved values and versions; else a message naming each difference,
    the ranks and where each option came from, and the fix.

    Args:
        records: world rank -> that rank's `agreement_record` (as JSON
            round-trips it), rank 0's included.

    Example:

    ```python
    from keras_smp.config import SMPConfig, agreement_record, disagreements

    versions = {"keras-smp": "0.1.0"}
    same = {r: agreement_record(SMPConfig.build(microbatches=4), versions)
            for r in range(3)}
    assert disagreements(same) is None
    other = dict(same)
    other[2] = agreement_record(SMPConfig.build(
        microbatches=4, environ={"SMP_CONFIG": '{"microbatches": 8}'}),
        versions)
    assert ("- microbatches: 4 on ranks 0, 1 (keyword arguments); 8 on "
            "rank 2 (environment variable SMP_CONFIG)") in disagreements(other)
    ```
    """
    ranks = sorted(records)
    lines = []
    for section, label in (("options", "{}"), ("resolved", "{}"),
                           ("versions", "{} version")):
        names = []
        for rank in ranks:
            for name in records[rank].get(section, {}):
                if name not in names:
                    names.append(name)
        for name in names:
            groups: dict[str, list] = {}
            for rank in ranks:
                value = records[rank].get(section, {}).get(name)
                groups.setdefault(json.dumps(value, sort_keys=True),
                                  []).append(rank)
            if len(groups) == 1:
                continue
            parts = []
            for value, members in groups.items():
                if section != "options":
                    parts.append(f"{value} on {ranks_text(members)}")
                    continue
                # The same value may come from different sources.
                by_origin: dict[str, list] = {}
                for rank in members:
                    origin = records[rank].get("origins", {}).get(name)
                    by_origin.setdefault(origin or "", []).append(rank)
                parts.append(f"{value} on " + " and ".join(
                    ranks_text(ranks) + (f" ({origin})" if origin else "")
                    for origin, ranks in by_origin.items()))
            lines.append(f"- {label.format(name)}: " + "; ".join(parts))
    if not lines:
        return None
    return (
        "keras-smp: the processes of this job do not run with the same "
        "settings; they would wait for each other until "
        "collective_timeout_seconds, or train wrongly:\n" + "\n".join(lines)
        + "\nStart every process with the same keras-smp options (the same "
        "SMPStrategy / smp.init arguments, and the same SMP_CONFIG and "
        "SM_HP_MP_PARAMETERS environment variables on every node) and the "
        "same keras-smp, TensorFlow and Keras versions, on machines with "
        "as many devices each. Only collective_timeout_seconds and "
        "local_devices may differ.")
