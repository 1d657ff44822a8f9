"""Tests for keras_smp.config (pure Python, no TensorFlow)."""

import ast
import inspect
import dataclasses
import json
import pathlib
import re

import pytest

from keras_smp import config as config_module
from keras_smp.config import ALLOWED_KEYS, CONFIG_KEYS, SMPConfig
from keras_smp.runtime import calls

NO_ENV: dict = {}


def build(*args, environ=None, **kwargs):
    return SMPConfig.build(*args, environ=NO_ENV if environ is None else environ, **kwargs)


# ---------------------------------------------------------------------------
# Defaults and normalisation
# ---------------------------------------------------------------------------


def test_defaults():
    expected = {
        "partitions": 1,
        "microbatches": 1,
        "pipeline": "1f1b",
        "optimize": "memory",
        "auto_partition": True,
        "default_partition": 0,
        "contiguous": True,
        "horovod": False,
        "placement_strategy": "cluster",
        "allreduce": "auto",
        "fusion_threshold_mb": 64.0,
        "allreduce_pieces": 1,
        "allreduce_compression": None,
        "collective_timeout_seconds": 300.0,
        "local_devices": None,
        "activation_checkpointing": False,
        "virtual_stages": 1,
        "tensor_parallel_degree": 1,
    }
    assert SMPConfig().to_dict() == expected
    assert build().to_dict() == expected
    assert build(None).to_dict() == expected
    assert list(SMPConfig().to_dict()) == list(CONFIG_KEYS)


def test_allowed_keys():
    assert set(ALLOWED_KEYS) == set(CONFIG_KEYS) | {"pipeline_parallel_degree", "tp"}
    assert [f.name for f in dataclasses.fields(SMPConfig)] == list(CONFIG_KEYS)


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SMPConfig().partitions = 3


@pytest.mark.parametrize(
    "given, stored",
    [("simple", "gpipe"), ("interleaved", "1f1b"), ("gpipe", "gpipe"), ("1f1b", "1f1b"),
     ("Simple", "gpipe"), ("1F1B", "1f1b")],
)
def test_pipeline_names_normalised(given, stored):
    assert build(pipeline=given).pipeline == stored
    assert SMPConfig(pipeline=given).pipeline == stored


def test_partitions_alias():
    assert build({"pipeline_parallel_degree": 4}).partitions == 4
    assert build(pipeline_parallel_degree=2).partitions == 2
    assert build({"pipeline_parallel_degree": 3, "partitions": 3}).partitions == 3
    cfg = build({"pipeline_parallel_degree": 2})
    assert "pipeline_parallel_degree" not in cfg.to_dict()


def test_alias_in_higher_source_overrides_canonical_key_in_lower():
    assert build({"partitions": 2}, pipeline_parallel_degree=4).partitions == 4
    env = {"SMP_CONFIG": '{"pipeline_parallel_degree": 8}'}
    assert build({"partitions": 2}, environ=env).partitions == 8


def test_integral_float_accepted_for_int():
    cfg = build(partitions=2.0, microbatches=4.0, default_partition=1.0, local_devices=2.0)
    assert (cfg.partitions, cfg.microbatches, cfg.default_partition, cfg.local_devices) == (
        2, 4, 1, 2)
    assert all(isinstance(v, int) for v in (cfg.partitions, cfg.microbatches))


def test_int_accepted_for_float():
    cfg = build(fusion_threshold_mb=0, collective_timeout_seconds=10)
    assert cfg.fusion_threshold_mb == 0.0 and isinstance(cfg.fusion_threshold_mb, float)
    assert cfg.collective_timeout_seconds == 10.0
    assert isinstance(cfg.collective_timeout_seconds, float)


def test_horovod_implies_allreduce():
    cfg = build(horovod=True)
    assert cfg.allreduce == "horovod"
    assert build(horovod=True, allreduce="horovod").allreduce == "horovod"
    assert SMPConfig(horovod=True).allreduce == "horovod"


def test_other_choices():
    cfg = build(optimize="speed", placement_strategy="spread", allreduce="hierarchical",
                auto_partition=False, contiguous=False, default_partition=1, partitions=2,
                local_devices=4)
    assert cfg.optimize == "speed"
    assert cfg.placement_strategy == "spread"
    assert cfg.allreduce == "hierarchical"
    assert cfg.auto_partition is False and cfg.contiguous is False
    assert cfg.default_partition == 1 and cfg.local_devices == 4
    assert build(allreduce="ring").allreduce == "ring"


def test_to_dict_roundtrip():
    cfg = build(partitions=2, microbatches=4, pipeline="simple", horovod=True)
    assert SMPConfig(**cfg.to_dict()) == cfg
    assert build(cfg.to_dict()) == cfg
    d = cfg.to_dict()
    d["partitions"] = 99  # a copy, not a view
    assert cfg.partitions == 2


# ---------------------------------------------------------------------------
# Sources and precedence
# ---------------------------------------------------------------------------


def test_kwargs_override_dict():
    cfg = build({"partitions": 2, "microbatches": 2}, microbatches=8)
    assert (cfg.partitions, cfg.microbatches) == (2, 8)


def test_config_instance_as_base():
    base = SMPConfig(partitions=2, microbatches=4)
    cfg = build(base, microbatches=8)
    assert (cfg.partitions, cfg.microbatches) == (2, 8)


def test_dict_not_mutated():
    d = {"pipeline_parallel_degree": 2}
    build(d)
    assert d == {"pipeline_parallel_degree": 2}


def test_smp_config_env_overrides_dict_and_kwargs():
    env = {"SMP_CONFIG": json.dumps({"microbatches": 16, "pipeline": "simple"})}
    cfg = build({"microbatches": 2, "partitions": 2}, microbatches=4, environ=env)
    assert (cfg.partitions, cfg.microbatches, cfg.pipeline) == (2, 16, "gpipe")


def test_legacy_env_overrides_dict_and_kwargs():
    env = {"SM_HP_MP_PARAMETERS": json.dumps({"partitions": 4, "microbatches": 2})}
    cfg = build({"partitions": 2}, microbatches=8, environ=env)
    assert (cfg.partitions, cfg.microbatches) == (4, 2)


def test_smp_config_beats_legacy_env():
    env = {
        "SM_HP_MP_PARAMETERS": json.dumps({"partitions": 4, "microbatches": 2}),
        "SMP_CONFIG": json.dumps({"partitions": 8}),
    }
    cfg = build(environ=env)
    assert (cfg.partitions, cfg.microbatches) == (8, 2)


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_env_ignored(value):
    env = {"SMP_CONFIG": value, "SM_HP_MP_PARAMETERS": value}
    assert build(environ=env) == SMPConfig()


def test_os_environ_default(monkeypatch):
    monkeypatch.setenv("SMP_CONFIG", '{"microbatches": 3}')
    monkeypatch.delenv("SM_HP_MP_PARAMETERS", raising=False)
    assert SMPConfig.build().microbatches == 3


def test_env_bool_json():
    env = {"SMP_CONFIG": '{"auto_partition": false, "horovod": true}'}
    cfg = build(environ=env)
    assert cfg.auto_partition is False and cfg.allreduce == "horovod"


# ---------------------------------------------------------------------------
# Bad values: one case per key/value, message names key and value
# ---------------------------------------------------------------------------

BAD_VALUES = [
    ("partitions", 0),
    ("partitions", -1),
    ("partitions", True),
    ("partitions", "2"),
    ("partitions", 2.5),
    ("partitions", None),
    ("microbatches", 0),
    ("microbatches", False),
    ("microbatches", "4"),
    ("microbatches", 1.5),
    ("pipeline", "pipedream"),
    ("pipeline", 1),
    ("pipeline", None),
    ("optimize", "balanced"),
    ("optimize", True),
    ("auto_partition", "true"),
    ("auto_partition", 1),
    ("auto_partition", None),
    ("default_partition", -1),
    ("default_partition", True),
    ("default_partition", "0"),
    ("contiguous", "yes"),
    ("contiguous", 0),
    ("horovod", "True"),
    ("horovod", 1),
    ("placement_strategy", "random"),
    ("placement_strategy", None),
    ("allreduce", "nccl"),
    ("allreduce", 3),
    ("fusion_threshold_mb", -1),
    ("fusion_threshold_mb", "64"),
    ("fusion_threshold_mb", True),
    ("fusion_threshold_mb", float("nan")),
    ("fusion_threshold_mb", float("inf")),
    ("allreduce_pieces", 0),
    ("allreduce_pieces", 2.5),
    ("allreduce_pieces", True),
    ("allreduce_pieces", "4"),
    ("allreduce_compression", "int8"),
    ("allreduce_compression", "float32"),
    ("allreduce_compression", True),
    ("allreduce_compression", 16),
    ("collective_timeout_seconds", 0),
    ("collective_timeout_seconds", -5.0),
    ("collective_timeout_seconds", "300"),
    ("collective_timeout_seconds", False),
    ("local_devices", 0),
    ("local_devices", True),
    ("local_devices", "2"),
    ("local_devices", 1.5),
    ("activation_checkpointing", "yes"),
    ("activation_checkpointing", 1),
    ("activation_checkpointing", [0, 0]),
    ("activation_checkpointing", [1]),  # partitions defaults to 1
    ("activation_checkpointing", [True]),
]


def test_activation_checkpointing_stages():
    config = build({"partitions": 4, "activation_checkpointing": [3, 1]})
    assert config.activation_checkpointing == (1, 3)
    assert SMPConfig(**config.to_dict()) == config
    env = {"SMP_CONFIG": '{"partitions": 2, "activation_checkpointing": true}'}
    assert SMPConfig.build(environ=env).activation_checkpointing is True


@pytest.mark.parametrize("key, value", BAD_VALUES, ids=[f"{k}={v!r}" for k, v in BAD_VALUES])
def test_bad_value(key, value):
    with pytest.raises(ValueError) as info:
        build({key: value})
    msg = str(info.value)
    assert f"'{key}'" in msg
    assert f"received {value!r}" in msg
    assert "expected" in msg


@pytest.mark.parametrize("key, value", BAD_VALUES[:6], ids=[f"{k}={v!r}" for k, v in BAD_VALUES[:6]])
def test_bad_value_direct_construction(key, value):
    with pytest.raises(ValueError, match=re.escape(repr(value))):
        SMPConfig(**{key: value})


def test_bad_value_names_env_source():
    env = {"SMP_CONFIG": '{"microbatches": 0}'}
    with pytest.raises(ValueError, match="environment variable SMP_CONFIG") as info:
        build(environ=env)
    assert "'microbatches'" in str(info.value) and "received 0" in str(info.value)


def test_bad_value_names_legacy_env_source():
    env = {"SM_HP_MP_PARAMETERS": '{"pipeline": "fast"}'}
    with pytest.raises(ValueError, match="SM_HP_MP_PARAMETERS") as info:
        build(environ=env)
    assert "'pipeline'" in str(info.value) and "'fast'" in str(info.value)


def test_default_partition_must_be_below_partitions():
    with pytest.raises(ValueError) as info:
        build(partitions=2, default_partition=2)
    msg = str(info.value)
    assert "'default_partition'" in msg and "received 2" in msg and "partitions=2" in msg


def test_default_partition_checked_against_default_partitions():
    with pytest.raises(ValueError, match="must be < partitions=1"):
        SMPConfig(default_partition=1)


@pytest.mark.parametrize("allreduce", ["ring", "hierarchical"])
def test_horovod_with_other_allreduce(allreduce):
    with pytest.raises(ValueError) as info:
        build(horovod=True, allreduce=allreduce)
    msg = str(info.value)
    assert "horovod=True" in msg and repr(allreduce) in msg and "allreduce" in msg


@pytest.mark.parametrize("given, stored", [
    (None, None), ("bfloat16", "bfloat16"), ("float16", "float16"),
    ("bf16", "bfloat16"), ("FP16", "float16"), (" bfloat16 ", "bfloat16")])
def test_allreduce_compression_values(given, stored):
    assert build(allreduce_compression=given).allreduce_compression == stored
    env = {"SMP_CONFIG": json.dumps({"allreduce_compression": given})}
    assert SMPConfig.build(environ=env).allreduce_compression == stored


def test_allreduce_compression_bfloat16_with_horovod_is_refused():
    for options in ({"horovod": True}, {"allreduce": "horovod"}):
        with pytest.raises(ValueError) as info:
            build(allreduce_compression="bfloat16", **options)
        msg = str(info.value)
        assert "carries no bfloat16" in msg
        assert "allreduce_compression='float16'" in msg
    # what hvd.Compression.fp16 sends is accepted
    config = build(horovod=True, allreduce_compression="fp16")
    assert config.allreduce == "horovod"
    assert config.allreduce_compression == "float16"


def test_alias_conflict():
    with pytest.raises(ValueError) as info:
        build({"partitions": 2, "pipeline_parallel_degree": 4})
    msg = str(info.value)
    assert "'partitions'=2" in msg and "'pipeline_parallel_degree'=4" in msg


def test_alias_conflict_in_kwargs():
    with pytest.raises(ValueError, match="keyword arguments"):
        build(partitions=2, pipeline_parallel_degree=3)


def test_alias_conflict_in_env():
    env = {"SMP_CONFIG": '{"partitions": 2, "pipeline_parallel_degree": 4}'}
    with pytest.raises(ValueError, match="environment variable SMP_CONFIG"):
        build(environ=env)


# ---------------------------------------------------------------------------
# Unknown keys
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, suggestion",
    [("partitons", "partitions"), ("microbatch", "microbatches"),
     ("pipline", "pipeline"), ("placement", "placement_strategy"),
     ("pipeline_parallel_degre", "pipeline_parallel_degree")],
)
def test_unknown_key_with_suggestion(key, suggestion):
    with pytest.raises(ValueError) as info:
        build({key: 1})
    msg = str(info.value)
    assert repr(key) in msg
    assert f"Did you mean {suggestion!r}?" in msg
    assert "Allowed keys:" in msg and "microbatches" in msg


def test_unknown_key_without_suggestion():
    with pytest.raises(ValueError) as info:
        build({"zzzzzz": 1})
    msg = str(info.value)
    assert "'zzzzzz'" in msg and "Did you mean" not in msg and "Allowed keys:" in msg


def test_unknown_kwarg():
    with pytest.raises(ValueError, match=r"'microbatchs'.*keyword arguments.*'microbatches'"):
        build(microbatchs=2)


def test_unknown_non_string_key():
    with pytest.raises(ValueError, match="Unknown keras-smp config key 1 "):
        build({1: 2})


@pytest.mark.parametrize("var", ["SMP_CONFIG", "SM_HP_MP_PARAMETERS"])
def test_unknown_key_from_env_names_variable(var):
    with pytest.raises(ValueError) as info:
        build(environ={var: '{"tensor_parallel_degre": 2}'})
    msg = str(info.value)
    assert "'tensor_parallel_degre'" in msg and "Did you mean 'tensor_parallel_degree'" in msg and f"environment variable {var}" in msg


# ---------------------------------------------------------------------------
# Malformed environment variables
# ---------------------------------------------------------------------------

MALFORMED_ENV = [
    ("SMP_CONFIG", "{partitions: 2}", "not valid JSON"),
    ("SMP_CONFIG", '{"partitions": 2', "not valid JSON"),
    ("SMP_CONFIG", "[1, 2]", "must hold a JSON object"),
    ("SMP_CONFIG", "2", "must hold a JSON object"),
    ("SMP_CONFIG", '"partitions"', "must hold a JSON object"),
    ("SMP_CONFIG", "null", "must hold a JSON object"),
    ("SM_HP_MP_PARAMETERS", "partitions=2", "not valid JSON"),
    ("SM_HP_MP_PARAMETERS", "[]", "must hold a JSON object"),
]


@pytest.mark.parametrize("var, raw, expected", MALFORMED_ENV)
def test_malformed_env(var, raw, expected):
    with pytest.raises(ValueError) as info:
        build(environ={var: raw})
    msg = str(info.value)
    assert var in msg and expected in msg and repr(raw) in msg


@pytest.mark.parametrize("config", [[("partitions", 2)], "partitions=2", 2])
def test_bad_config_argument_type(config):
    with pytest.raises(TypeError, match="must be None, a dict or an SMPConfig"):
        build(config)


def test_config_is_positional_only():
    # `config` is positional-only, so config=... is treated as an unknown option.
    with pytest.raises(ValueError, match="Unknown keras-smp config key 'config'"):
        SMPConfig.build(config={"partitions": 2}, environ={})




def _python_examples(obj):
    doc = inspect.getdoc(obj) or ""
    return re.findall(r"```python\n(.*?)```", doc, flags=re.S)


@pytest.mark.parametrize("obj", [
    SMPConfig, SMPConfig.build, SMPConfig.to_dict, SMPConfig.origin,
    config_module.agreement_record, config_module.disagreements,
    config_module.ranks_text, calls.call_record, calls.call_disagreements,
    calls.ended_message, calls.data_end_message],
    ids=["SMPConfig", "build", "to_dict", "origin", "agreement_record",
         "disagreements", "ranks_text", "call_record", "call_disagreements",
         "ended_message", "data_end_message"])
def test_docstring_examples_run(obj, monkeypatch):
    for var in ("SMP_CONFIG", "SM_HP_MP_PARAMETERS"):
        monkeypatch.delenv(var, raising=False)
    examples = _python_examples(obj)
    assert examples
    for code in examples:
        exec(compile(code, f"<{obj.__qualname__} example>", "exec"), {})


def test_data_end_agreement_names_the_ranks_whose_data_ended():
    # TensorFlow's failed assertion (runtime.data_end) prints each vector
    # as "[1 0 1 0]"; the step function re-raises it as this message.
    text = ("assertion failed: [" + calls.DATA_END_MARKER + " (batches per "
            "rank, then replicas per rank):] [1 0 1 0] [1 1 1 1]")
    counts, expected = calls.parse_data_end(text)
    assert (counts, expected) == ([1, 0, 1, 0], [1, 1, 1, 1])
    message = calls.data_end_message(counts, expected)
    assert message.startswith("keras-smp: the data ended on ranks 1, 3 "
                              "while ranks 0, 2 still had a batch")
    assert "steps_per_epoch" in message
    # A process of 2 local replicas with one batch left counts as ended.
    assert calls.data_end_message([1, 2], [2, 2]).startswith(
        "keras-smp: the data ended on rank 0 while rank 1 still had")
    assert calls.data_end_message([1, 1], [2, 2]).startswith(
        "keras-smp: the data ended on ranks 0, 1 while other replicas of "
        "ranks 0, 1 still had one")
    assert calls.parse_data_end("assertion failed: [x] [1 0] [1 1]") is None
    assert calls.parse_data_end(calls.DATA_END_MARKER + " [1 0] [1]") is None


def test_virtual_stages_follow_the_schedule():
    # interleaved_1f1b: 2 by default, any v >= 2; zb_v: 2; others: 1.
    assert SMPConfig(partitions=2, microbatches=4,
                     pipeline="interleaved_1f1b").virtual_stages == 2
    c = SMPConfig(partitions=2, microbatches=4, pipeline="interleaved_1f1b",
                  virtual_stages=3)
    assert (c.virtual_stages, c.num_model_stages) == (3, 6)
    assert SMPConfig(partitions=2, pipeline="zb_v").num_model_stages == 4
    assert SMPConfig(partitions=2).virtual_stages == 1
    # default_partition and checkpointed stages count model stages.
    assert SMPConfig(partitions=2, microbatches=2, pipeline="zb_v",
                     default_partition=3,
                     activation_checkpointing=[2]).default_partition == 3
    with pytest.raises(ValueError, match="'virtual_stages'.*received 0"):
        SMPConfig(partitions=2, microbatches=4, pipeline="interleaved_1f1b",
                  virtual_stages=0)
    with pytest.raises(ValueError, match="'1f1b'.*received 2.*interleaved_1f1b"):
        SMPConfig(partitions=2, virtual_stages=2)
    with pytest.raises(ValueError, match="'zb_v'.*received 3"):
        SMPConfig(partitions=2, pipeline="zb_v", virtual_stages=3)
    with pytest.raises(ValueError, match="multiple of num_stages=2.*"
                                         "microbatches=2 or microbatches=4"):
        SMPConfig(partitions=2, microbatches=3, pipeline="interleaved_1f1b")
    with pytest.raises(ValueError, match=r"microbatches from keyword "
                                         r"arguments\).*num_microbatches"):
        build(partitions=2, microbatches=3, pipeline="interleaved_1f1b")
    # A built config rebuilt with another pipeline takes that pipeline's
    # own virtual_stages (its resolved 1 or 2 is not a user's choice).
    base = SMPConfig(partitions=2, microbatches=4)
    assert build(base, pipeline="interleaved_1f1b").virtual_stages == 2
    zbv = SMPConfig(partitions=2, microbatches=4, pipeline="zb_v")
    assert build(zbv, pipeline="1f1b").virtual_stages == 1
    assert build(zbv, environ={"SMP_CONFIG": '{"pipeline": "gpipe"}'}
                 ).virtual_stages == 1
    # An explicit, non-default choice is kept, and checked.
    v3 = SMPConfig(partitions=2, microbatches=4, pipeline="interleaved_1f1b",
                   virtual_stages=3)
    assert build(v3, microbatches=8).virtual_stages == 3
    with pytest.raises(ValueError, match="'1f1b'.*received 3"):
        build(v3, pipeline="1f1b")
    with pytest.raises(ValueError, match="from environment variable SMP_CONFIG"):
        build(environ={"SMP_CONFIG": '{"pipeline": "zb_v", '
                                     '"virtual_stages": 4}'})
    with pytest.raises(ValueError, match="default_partition.*partitions=2 x "
                                         "virtual_stages=2"):
        SMPConfig(partitions=2, pipeline="zb_v", default_partition=4)


def test_tensor_parallel_degree_and_its_alias():
    assert SMPConfig().tensor_parallel_degree == 1
    assert build(tp=2).tensor_parallel_degree == 2
    assert build({"tensor_parallel_degree": 4}).tensor_parallel_degree == 4
    assert "tp" not in build(tp=2).to_dict()
    env = {"SMP_CONFIG": '{"tensor_parallel_degree": 2}'}
    assert build(environ=env).tensor_parallel_degree == 2
    with pytest.raises(ValueError, match="'tensor_parallel_degree'.*received 0"):
        SMPConfig(tensor_parallel_degree=0)
    with pytest.raises(ValueError, match="Conflicting.*'tensor_parallel_degree'"):
        build({"tp": 2, "tensor_parallel_degree": 4})


# -- one job, one configuration (checked across ranks at start-up) ---------

VERSIONS = {"keras-smp": "0.1.0", "TensorFlow": "2.21.0", "Keras": "3.15.0"}


def _record(versions=VERSIONS, **kwargs):
    # As the coordination service hands it over: a JSON round trip.
    return json.loads(json.dumps(config_module.agreement_record(
        SMPConfig.build(environ={}, **kwargs), versions)))


def test_origin_names_each_source():
    config = SMPConfig.build(
        {"partitions": 2}, microbatches=4,
        environ={"SM_HP_MP_PARAMETERS": '{"pipeline": "gpipe"}',
                 "SMP_CONFIG": '{"microbatches": 8}'})
    assert config.origin("partitions") == "the config argument"
    assert config.origin("microbatches") == "environment variable SMP_CONFIG"
    assert config.origin("pipeline") == (
        "environment variable SM_HP_MP_PARAMETERS")
    assert config.origin("optimize") == "default"
    direct = SMPConfig(partitions=2)
    assert direct.origin("partitions") == "SMPConfig arguments"
    assert direct.origin("microbatches") == "default"
    # Origins are not part of the value.
    assert config == SMPConfig(partitions=2, microbatches=8, pipeline="gpipe")
    with pytest.raises(ValueError, match="Unknown keras-smp option 'micro'"):
        config.origin("micro")


def test_same_settings_on_every_rank_agree():
    records = {r: _record(partitions=2, microbatches=4) for r in range(4)}
    assert config_module.disagreements(records) is None
    # Only the per-process timeout may differ.
    records[3] = _record(partitions=2, microbatches=4,
                         collective_timeout_seconds=30)
    # ... and local_devices (what it resolves to is compared instead).
    records[2] = _record(partitions=2, microbatches=4, local_devices=2)
    assert config_module.disagreements(records) is None
    assert config_module.PER_PROCESS_KEYS == {"collective_timeout_seconds",
                                              "local_devices"}


def test_every_option_but_the_timeout_must_agree():
    # Each option, changed on rank 1 alone, is named with both values.
    changed = {"partitions": 2, "microbatches": 4, "pipeline": "gpipe",
               "optimize": "speed", "auto_partition": False,
               "default_partition": 0, "contiguous": False, "horovod": True,
               "placement_strategy": "spread", "allreduce": "ring",
               "fusion_threshold_mb": 1.0, "allreduce_pieces": 4,
               "allreduce_compression": "bfloat16",
               "activation_checkpointing": True,
               "virtual_stages": 3, "tensor_parallel_degree": 2}
    base = {"partitions": 4}
    assert set(changed) | config_module.PER_PROCESS_KEYS == set(CONFIG_KEYS)
    for key, value in changed.items():
        kwargs = dict(base, **{key: value})
        if key == "virtual_stages":
            kwargs.update(pipeline="interleaved_1f1b", microbatches=4)
        if key == "default_partition":
            kwargs.update(default_partition=3)
        records = {0: _record(**base), 1: _record(**kwargs)}
        message = config_module.disagreements(records)
        assert message is not None and f"- {key}: " in message, key


def test_disagreement_names_values_ranks_origins_and_the_fix():
    records = {r: _record(microbatches=4) for r in range(8)}
    for r in (2, 3, 5, 6, 7):
        records[r] = json.loads(json.dumps(config_module.agreement_record(
            SMPConfig.build(microbatches=4, environ={
                "SMP_CONFIG": '{"microbatches": 8, "pipeline": "gpipe"}'}),
            VERSIONS)))
    records[1]["versions"]["TensorFlow"] = "2.20.0"
    message = config_module.disagreements(records)
    lines = message.splitlines()
    assert ("- microbatches: 4 on ranks 0, 1, 4 (keyword arguments); 8 on "
            "ranks 2, 3, 5, 6 and 1 more (environment variable SMP_CONFIG)"
            ) in lines
    assert ('- pipeline: "1f1b" on ranks 0, 1, 4 (default); "gpipe" on '
            'ranks 2, 3, 5, 6 and 1 more (environment variable SMP_CONFIG)'
            ) in lines
    assert ('- TensorFlow version: "2.21.0" on ranks 0, 2, 3, 4 and 3 more; '
            '"2.20.0" on rank 1') in lines
    assert "Only collective_timeout_seconds and local_devices" in lines[-1]
    assert "same SMP_CONFIG" in lines[-1]
    assert len(lines) == 5  # the header, three differences, the fix


def test_resolved_devices_must_agree():
    # Same options, but one node sees fewer GPUs (local_devices=None).
    records = {r: json.loads(json.dumps(config_module.agreement_record(
        SMPConfig.build(environ={}), VERSIONS,
        {"device type": "GPU", "model replicas per process": 4,
         "devices per process": 4 if r < 2 else 2})))
        for r in range(3)}
    lines = config_module.disagreements(records).splitlines()
    assert "- devices per process: 4 on ranks 0, 1; 2 on rank 2" in lines
    assert "as many devices each" in lines[-1]
    assert len(lines) == 3
    for r in records:
        records[r]["resolved"]["devices per process"] = 4
    assert config_module.disagreements(records) is None


def test_one_value_from_several_sources_names_each():
    records = {0: _record(microbatches=4), 2: _record(microbatches=8)}
    records[1] = json.loads(json.dumps(config_module.agreement_record(
        SMPConfig.build(environ={"SMP_CONFIG": '{"microbatches": 4}'}),
        VERSIONS)))
    lines = config_module.disagreements(records).splitlines()
    assert ("- microbatches: 4 on rank 0 (keyword arguments) and rank 1 "
            "(environment variable SMP_CONFIG); 8 on rank 2 (keyword "
            "arguments)") in lines
    # The same value from different sources agrees.
    records[2] = _record(microbatches=4)
    assert config_module.disagreements(records) is None


def test_a_record_of_another_format_is_compared_not_crashed_on():
    records = {0: _record(), 1: {"versions": dict(VERSIONS, **{
        "keras-smp": "0.0.9"})}}
    message = config_module.disagreements(records)
    assert '- keras-smp version: "0.1.0" on rank 0; "0.0.9" on rank 1' in (
        message.splitlines())


def test_a_config_passed_to_build_keeps_its_origins():
    built = SMPConfig.build(microbatches=4, environ={
        "SMP_CONFIG": '{"pipeline": "gpipe"}'})
    again = SMPConfig.build(built, environ={})
    assert again == built
    # What it set comes from it; its defaults stay defaults.
    assert again.origin("microbatches") == "the config argument"
    assert again.origin("pipeline") == "the config argument"
    assert again.origin("partitions") == "default"
    zb = SMPConfig(partitions=2, microbatches=4, pipeline="zb_v")
    assert SMPConfig.build(zb, environ={}) == zb
    assert SMPConfig.build(SMPConfig(horovod=True), environ={}).allreduce == (
        "horovod")


# --- every rank's fit / evaluate / predict calls (keras_smp.runtime.calls)


def test_call_records_compare_steps_arguments_and_batch_shapes():
    x = [("float32", [None, 8]), ("int64", [None])]
    fit = calls.call_record("fit", steps=4, arguments={
        "epochs": 3, "validation_split": 0.2, "validation data": False},
        inputs=x)
    same = {r: fit for r in range(6)}
    assert calls.call_disagreements(same, 0) is None
    # Each differing field is named with the ranks holding each value
    # (at most 4 ranks listed); equal fields are not named.
    other = dict(same)
    other[5] = calls.call_record("fit", steps=None, arguments={
        "epochs": 2, "validation_split": 0.2, "validation data": True},
        inputs=x)
    lines = calls.call_disagreements(other, 4).splitlines()
    assert lines[0].startswith("keras-smp: the processes of this job differ "
                               "in their 5th fit/evaluate/predict call")
    assert "- steps: 4 on ranks 0, 1, 2, 3 and 1 more; unknown on rank 5" \
        in lines
    assert "- epochs: 3 on ranks 0, 1, 2, 3 and 1 more; 2 on rank 5" in lines
    assert ("- validation data: False on ranks 0, 1, 2, 3 and 1 more; True "
            "on rank 5") in lines
    assert not any(line.startswith("- validation_split") for line in lines)
    # Another call: named alone (its steps and arguments are another
    # call's).
    evaluate = calls.call_record("evaluate", steps=2, inputs=x)
    message = calls.call_disagreements({0: fit, 1: evaluate}, 0)
    assert [line for line in message.splitlines() if line.startswith("- ")] \
        == ["- call: fit on rank 0; evaluate on rank 1"]
    assert calls.call_record("predict", steps=1)["steps"] == 1
    with pytest.raises(ValueError, match=r"call='train'.*expected one of"):
        calls.call_record("train", steps=1)


def test_call_orders_compare_only_the_ranks_giving_one():
    # Ranks 1 and 3 (tensor-parallel ranks 1) take their replica's batch
    # from rank 0 and 2: their orders are not given, and not compared.
    def record(order=None):
        return calls.call_record("fit", steps=3, orders=(
            {} if order is None else {"order of the shuffled arrays": order}))

    seeded = {0: record("seed 1"), 1: record(), 2: record("seed 1"),
              3: record()}
    assert calls.call_disagreements(seeded, 0) is None
    apart = {**seeded, 2: record("seed 2")}
    lines = calls.call_disagreements(apart, 0).splitlines()
    assert ("- order of the shuffled arrays: seed 1 on rank 0; seed 2 on "
            "rank 2") in lines, lines


def test_call_batch_shapes_unknown_dimensions_match_any():
    def record(*inputs):
        return calls.call_record("evaluate", steps=2, inputs=inputs)

    static = record(("float32", [16, 8]))
    assert calls.call_disagreements(
        {0: static, 1: record(("float32", [None, 8]))}, 0) is None
    assert calls.call_disagreements(
        {0: static, 1: calls.call_record("evaluate", steps=2)}, 0) is None
    for bad in (record(("float32", [32, 8])), record(("float64", [16, 8])),
                record(("float32", [16, 8, 1])),
                record(("float32", [16, 8]), ("float32", [16]))):
        message = calls.call_disagreements({0: static, 1: bad}, 0)
        assert "- batch inputs: [float32[16, 8]] on rank 0; " in message, bad
    assert calls.inputs_compatible(static["inputs"], None)
