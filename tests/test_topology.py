"""Tests for keras_smp.topology (pure Python, no TensorFlow)."""

import ast
import inspect
import json
import pathlib
import re

import pytest

from keras_smp import topology as topology_module
from keras_smp.topology import (
    ClusterInfo,
    Topology,
    expand_hostlist,
    parse_tasks_per_node,
    resolve_cluster,
)


def tf_env(cluster, task, **extra):
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": task}), **extra}


# ---------------------------------------------------------------------------
# Single process
# ---------------------------------------------------------------------------


def test_single_process():
    info = resolve_cluster(environ={})
    assert info == ClusterInfo(
        workers=("localhost:0",), rank=0, task_type="worker", task_index=0,
        source="single", hosts=("localhost",), cluster_spec={},
    )
    assert info.world_size == 1


@pytest.mark.parametrize("value", ["", "  "])
def test_empty_tf_config_is_single(value):
    assert resolve_cluster(environ={"TF_CONFIG": value}).source == "single"


def test_partial_slurm_env_is_single():
    assert resolve_cluster(environ={"SLURM_PROCID": "0"}).source == "single"
    assert resolve_cluster(environ={"SLURM_NTASKS": "2"}).source == "single"


def test_os_environ_default(monkeypatch):
    for var in ("TF_CONFIG", "SLURM_PROCID", "SLURM_NTASKS", "SMP_HOST_MAP"):
        monkeypatch.delenv(var, raising=False)
    assert resolve_cluster().source == "single"
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}}))
    assert resolve_cluster().rank == 1


# ---------------------------------------------------------------------------
# TF_CONFIG
# ---------------------------------------------------------------------------


def test_tf_config_with_chief():
    cluster = {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222", "w1:2223"]}
    ranks = {}
    for task_type, index, rank in [("chief", 0, 0), ("worker", 0, 1), ("worker", 1, 2),
                                   ("worker", 2, 3)]:
        info = resolve_cluster(environ=tf_env(cluster, {"type": task_type, "index": index}))
        assert info.source == "tf_config"
        assert info.workers == ("c:2222", "w0:2222", "w1:2222", "w1:2223")
        assert info.hosts == ("c", "w0", "w1", "w1")
        assert info.world_size == 4
        assert (info.task_type, info.task_index) == (task_type, index)
        assert info.cluster_spec == cluster
        ranks[(task_type, index)] = info.rank
        assert info.rank == rank
    assert sorted(ranks.values()) == [0, 1, 2, 3]


def test_tf_config_without_chief():
    cluster = {"worker": ["a:1000", "b:1000", "c:1000"]}
    for i in range(3):
        info = resolve_cluster(environ=tf_env(cluster, {"type": "worker", "index": i}))
        assert info.rank == i and info.task_index == i and info.task_type == "worker"
        assert info.hosts == ("a", "b", "c")
        assert info.cluster_spec == cluster


def test_tf_config_chief_only():
    info = resolve_cluster(environ=tf_env({"chief": ["c:1"]}, {"type": "chief", "index": 0}))
    assert (info.rank, info.world_size, info.cluster_spec) == (0, 1, {"chief": ["c:1"]})


def test_tf_config_empty_chief_list_ignored():
    info = resolve_cluster(environ=tf_env({"chief": [], "worker": ["a:1", "b:1"]},
                                          {"type": "worker", "index": 1}))
    assert info.rank == 1 and info.cluster_spec == {"worker": ["a:1", "b:1"]}


def test_tf_config_missing_index_with_single_task():
    info = resolve_cluster(environ=tf_env({"chief": ["c:1"], "worker": ["w:1"]},
                                          {"type": "chief"}))
    assert info.rank == 0 and info.task_index == 0


def test_tf_config_extra_top_level_keys_ignored():
    env = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1"]},
                                    "task": {"type": "worker", "index": 0},
                                    "environment": "cloud", "rpc_layer": "grpc"})}
    assert resolve_cluster(environ=env).world_size == 1


def test_tf_config_ipv6_host():
    info = resolve_cluster(environ=tf_env({"worker": ["[::1]:2222", "[::1]:2223"]},
                                          {"type": "worker", "index": 0}))
    assert info.hosts == ("::1", "::1")


def test_tf_config_beats_slurm():
    env = tf_env({"worker": ["a:1", "b:1"]}, {"type": "worker", "index": 1},
                 SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_JOB_NODELIST="n1")
    info = resolve_cluster(environ=env)
    assert info.source == "tf_config" and info.rank == 1


def test_cluster_info_hashable():
    info = resolve_cluster(environ=tf_env({"worker": ["a:1"]}, {"type": "worker", "index": 0}))
    assert hash(info) == hash(resolve_cluster(
        environ=tf_env({"worker": ["a:1"]}, {"type": "worker", "index": 0})))


GOOD_CLUSTER = {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"]}
GOOD_TASK = {"type": "worker", "index": 0}

MALFORMED_TF_CONFIG = [
    # id, raw TF_CONFIG, substrings the message must contain
    ("invalid_json", "{cluster: }", ["TF_CONFIG", "not valid JSON", "{cluster: }"]),
    ("truncated_json", '{"cluster": {', ["TF_CONFIG", "not valid JSON"]),
    ("not_object_list", "[1, 2]", ["TF_CONFIG", "must be a JSON object", "list"]),
    ("not_object_string", '"worker"', ["TF_CONFIG", "must be a JSON object", "str"]),
    ("missing_cluster", json.dumps({"task": GOOD_TASK}), ['missing "cluster"']),
    ("missing_task", json.dumps({"cluster": GOOD_CLUSTER}), ['missing "task"']),
    ("cluster_not_object", json.dumps({"cluster": ["a:1"], "task": GOOD_TASK}),
     ['"cluster" must be a JSON object']),
    ("task_not_object", json.dumps({"cluster": GOOD_CLUSTER, "task": "worker"}),
     ['"task" must be a JSON object']),
    ("ps_job", json.dumps({"cluster": {**GOOD_CLUSTER, "ps": ["p:1"]}, "task": GOOD_TASK}),
     ["'ps'", "not supported by keras-smp", "all-reduce"]),
    ("evaluator_job",
     json.dumps({"cluster": {**GOOD_CLUSTER, "evaluator": ["e:1"]}, "task": GOOD_TASK}),
     ["'evaluator'", "not supported by keras-smp", "all-reduce"]),
    ("unknown_job", json.dumps({"cluster": {"master": ["m:1"]}, "task": GOOD_TASK}),
     ["'master'", "not supported by keras-smp"]),
    ("two_chiefs",
     json.dumps({"cluster": {"chief": ["c:1", "d:1"], "worker": ["w:1"]}, "task": GOOD_TASK}),
     ['cluster["chief"] has 2 addresses', "at most one chief"]),
    ("empty_workers", json.dumps({"cluster": {"worker": []}, "task": GOOD_TASK}),
     ['cluster["worker"] is empty', 'no "chief"']),
    ("empty_cluster", json.dumps({"cluster": {}, "task": GOOD_TASK}),
     ['cluster["worker"] is empty']),
    ("workers_not_list", json.dumps({"cluster": {"worker": {"0": "a:1"}}, "task": GOOD_TASK}),
     ['cluster["worker"] must be a list']),
    ("address_no_port", json.dumps({"cluster": {"worker": ["hostonly"]}, "task": GOOD_TASK}),
     ['cluster["worker"][0]', "'hostonly'", "host:port"]),
    ("address_port_not_int",
     json.dumps({"cluster": {"worker": ["a:1", "b:http"]}, "task": GOOD_TASK}),
     ['cluster["worker"][1]', "'b:http'", "host:port"]),
    ("address_port_zero", json.dumps({"cluster": {"worker": ["a:0"]}, "task": GOOD_TASK}),
     ["'a:0'", "1..65535"]),
    ("address_port_too_big",
     json.dumps({"cluster": {"worker": ["a:65536"]}, "task": GOOD_TASK}),
     ["'a:65536'", "1..65535"]),
    ("address_no_host", json.dumps({"cluster": {"worker": [":2222"]}, "task": GOOD_TASK}),
     ["':2222'", "host:port"]),
    ("address_not_string", json.dumps({"cluster": {"worker": [2222]}, "task": GOOD_TASK}),
     ['cluster["worker"][0] is 2222']),
    ("address_negative_port",
     json.dumps({"cluster": {"worker": ["a:-1"]}, "task": GOOD_TASK}), ["'a:-1'"]),
    ("duplicate_address",
     json.dumps({"cluster": {"chief": ["a:1"], "worker": ["b:1", "a:1"]}, "task": GOOD_TASK}),
     ["'a:1' appears twice", 'cluster["chief"][0]', 'cluster["worker"][1]']),
    ("task_type_not_in_cluster",
     json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}),
     ["task[\"type\"] is 'chief'", "not a job"]),
    ("task_type_missing", json.dumps({"cluster": GOOD_CLUSTER, "task": {"index": 0}}),
     ['task["type"] is None']),
    ("task_type_ps",
     json.dumps({"cluster": GOOD_CLUSTER, "task": {"type": "ps", "index": 0}}),
     ["'ps'", "not supported by keras-smp"]),
    ("task_type_evaluator",
     json.dumps({"cluster": GOOD_CLUSTER, "task": {"type": "evaluator", "index": 0}}),
     ["'evaluator'", "not supported by keras-smp"]),
    ("index_string",
     json.dumps({"cluster": GOOD_CLUSTER, "task": {"type": "worker", "index": "1"}}),
     ['task["index"] must be an integer', "'1'"]),
    ("index_bool",
     json.dumps({"cluster": GOOD_CLUSTER, "task": {"type": "worker", "index": True}}),
     ['task["index"] must be an integer', "True"]),
    ("index_float",
     json.dumps({"cluster": GOOD_CLUSTER, "task": {"type": "worker", "index": 1.0}}),
     ['task["index"] must be an integer', "1.0"]),
    ("index_missing_many_tasks",
     json.dumps({"cluster": GOOD_CLUSTER, "task": {"type": "worker"}}),
     ['task["index"] must be an integer', "None"]),
    ("index_out_of_range",
     json.dumps({"cluster": GOOD_CLUSTER, "task": {"type": "worker", "index": 2}}),
     ['task["index"] is 2', "out of range", "0..1"]),
    ("index_negative",
     json.dumps({"cluster": GOOD_CLUSTER, "task": {"type": "worker", "index": -1}}),
     ['task["index"] is -1', "out of range"]),
    ("chief_index_1",
     json.dumps({"cluster": GOOD_CLUSTER, "task": {"type": "chief", "index": 1}}),
     ['task["index"] is 1', 'cluster["chief"]']),
]


@pytest.mark.parametrize("raw, expected", [c[1:] for c in MALFORMED_TF_CONFIG],
                         ids=[c[0] for c in MALFORMED_TF_CONFIG])
def test_malformed_tf_config(raw, expected):
    with pytest.raises(ValueError) as info:
        resolve_cluster(environ={"TF_CONFIG": raw})
    msg = str(info.value)
    assert "TF_CONFIG" in msg
    for part in expected:
        assert part in msg, (part, msg)


# ---------------------------------------------------------------------------
# SLURM
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hostlist, expected",
    [
        ("node1", ["node1"]),
        ("node[01-03,7],gpu5", ["node01", "node02", "node03", "node7", "gpu5"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[001-002]", ["n001", "n002"]),
        ("a,b,c", ["a", "b", "c"]),
        ("gpu[1,3,5]", ["gpu1", "gpu3", "gpu5"]),
        ("x[1-2],y[3-4]", ["x1", "x2", "y3", "y4"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("[1-2]host", ["1host", "2host"]),
        ("host-[5]", ["host-5"]),
        ("cn[0-1].cluster.local", ["cn0.cluster.local", "cn1.cluster.local"]),
    ],
)
def test_expand_hostlist(hostlist, expected):
    assert expand_hostlist(hostlist) == expected


@pytest.mark.parametrize(
    "hostlist, message",
    [("n[1-3", "unmatched '['"), ("n1-3]", "unmatched ']'"), ("n[3-1]", "ends before"),
     ("n[a-b]", "'a-b'"), ("", "non-empty"), ("a,,b", "empty entry"),
     ("n[[1]]", "nested")],
)
def test_expand_hostlist_malformed(hostlist, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        expand_hostlist(hostlist)


@pytest.mark.parametrize(
    "spec, expected",
    [("1", [1]), ("2(x3),1", [2, 2, 2, 1]), ("4(x2)", [4, 4]), ("1,2,3", [1, 2, 3])],
)
def test_parse_tasks_per_node(spec, expected):
    assert parse_tasks_per_node(spec) == expected


@pytest.mark.parametrize("spec", ["", "2(3)", "x", "2(x)"])
def test_parse_tasks_per_node_malformed(spec):
    with pytest.raises(ValueError, match="tasks-per-node"):
        parse_tasks_per_node(spec)


def slurm_env(procid, ntasks, nodelist, tpn=None, step=True, **extra):
    env = {"SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks)}
    env["SLURM_STEP_NODELIST" if step else "SLURM_JOB_NODELIST"] = nodelist
    if tpn is not None:
        env["SLURM_STEP_TASKS_PER_NODE" if step else "SLURM_TASKS_PER_NODE"] = tpn
    env.update(extra)
    return env


def test_slurm_blockwise_ranks_and_ports():
    expected_workers = ("node01:12345", "node01:12346", "node02:12345", "node02:12346",
                        "node03:12345", "node03:12346", "gpu5:12345")
    for rank in range(7):
        info = resolve_cluster(environ=slurm_env(rank, 7, "node[01-03],gpu5", "2(x3),1"))
        assert info.source == "slurm"
        assert info.workers == expected_workers
        assert info.hosts == ("node01", "node01", "node02", "node02", "node03", "node03",
                              "gpu5")
        assert (info.rank, info.task_type, info.task_index) == (rank, "worker", rank)
        assert info.cluster_spec == {"worker": list(expected_workers)}


def test_slurm_job_variables():
    info = resolve_cluster(environ=slurm_env(1, 3, "a,b", "1,2", step=False))
    assert info.workers == ("a:12345", "b:12345", "b:12346")


def test_slurm_step_variables_win_over_job_variables():
    env = slurm_env(0, 2, "s1", "2")
    env.update(SLURM_JOB_NODELIST="j[1-4]", SLURM_TASKS_PER_NODE="1(x4)")
    assert resolve_cluster(environ=env).workers == ("s1:12345", "s1:12346")


def test_slurm_port_base():
    info = resolve_cluster(environ=slurm_env(0, 2, "n1", "2", SMP_PORT_BASE="20000"))
    assert info.workers == ("n1:20000", "n1:20001")


def test_slurm_even_split_without_tasks_per_node():
    info = resolve_cluster(environ=slurm_env(3, 4, "n[1-2]"))
    assert info.hosts == ("n1", "n1", "n2", "n2")


@pytest.mark.parametrize(
    "env, message",
    [
        (slurm_env(5, 4, "n[1-2]", "2(x2)"), "SLURM_PROCID=5 with SLURM_NTASKS=4"),
        (slurm_env(-1, 4, "n[1-2]", "2(x2)"), "SLURM_PROCID=-1"),
        (slurm_env(0, 0, "n1", "1"), "SLURM_NTASKS=0"),
        (slurm_env("x", 4, "n1", "4"), "SLURM_PROCID must be an integer, received 'x'"),
        (slurm_env(0, "four", "n1", "4"), "SLURM_NTASKS must be an integer"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "no node list"),
        (slurm_env(0, 4, "n[1-3]", "2(x2)"), "describes 2 node(s)"),
        (slurm_env(0, 5, "n[1-2]", "2(x2)"), "adds up to 4 tasks but SLURM_NTASKS=5"),
        (slurm_env(0, 3, "n[1-2]"), "do not split evenly"),
        (slurm_env(0, 2, "n1", "2", SMP_PORT_BASE="abc"), "SMP_PORT_BASE"),
        (slurm_env(0, 2, "n1", "2", SMP_PORT_BASE="65535"), "outside 1..65535"),
        (slurm_env(0, 2, "n[1-2", "1(x2)"), "unmatched '['"),
    ],
    ids=["procid_too_big", "procid_negative", "zero_tasks", "procid_not_int",
         "ntasks_not_int", "no_nodelist", "node_count_mismatch", "task_sum_mismatch",
         "uneven_without_tpn", "bad_port_base", "port_overflow", "bad_hostlist"],
)
def test_slurm_inconsistent(env, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_cluster(environ=env)


# ---------------------------------------------------------------------------
# SMP_HOST_MAP
# ---------------------------------------------------------------------------


def test_host_map_with_tf_config():
    env = tf_env({"worker": [f"localhost:{2000 + i}" for i in range(4)]},
                 {"type": "worker", "index": 2}, SMP_HOST_MAP="h0, h0,h1,h1")
    info = resolve_cluster(environ=env)
    assert info.hosts == ("h0", "h0", "h1", "h1")
    topo = Topology.from_cluster(info, partitions=2)
    assert (topo.num_hosts, topo.host_index, topo.local_rank, topo.local_size) == (2, 1, 0, 2)


def test_host_map_single_process():
    assert resolve_cluster(environ={"SMP_HOST_MAP": "box"}).hosts == ("box",)


def test_host_map_with_slurm():
    info = resolve_cluster(environ=slurm_env(0, 2, "n1", "2", SMP_HOST_MAP="a,b"))
    assert info.hosts == ("a", "b")


@pytest.mark.parametrize("host_map, count", [("a,b,c", 3), ("a", 1), ("a,,b,c", 4)])
def test_host_map_wrong_length(host_map, count):
    env = tf_env({"worker": ["l:1", "l:2", "l:3", "l:4"]}, {"type": "worker", "index": 0},
                 SMP_HOST_MAP=host_map)
    with pytest.raises(ValueError) as info:
        resolve_cluster(environ=env)
    msg = str(info.value)
    assert "SMP_HOST_MAP" in msg and f"{count} host label(s)" in msg
    assert "world size is 4" in msg


# ---------------------------------------------------------------------------
# Topology layouts
# ---------------------------------------------------------------------------

LAYOUTS = [
    (w, p, s)
    for w in range(1, 17)
    for p in range(1, w + 1)
    if w % p == 0
    for s in ("cluster", "spread")
]


@pytest.mark.parametrize("world, partitions, strategy", LAYOUTS,
                         ids=[f"w{w}-p{p}-{s}" for w, p, s in LAYOUTS])
def test_layout(world, partitions, strategy):
    hosts = tuple(f"h{r // 3}" for r in range(world))
    topos = [Topology(world, r, hosts, partitions, strategy) for r in range(world)]
    t0 = topos[0]
    dp = world // partitions
    assert (t0.pp_size, t0.dp_size, t0.mp_size) == (partitions, dp, partitions)

    # coords is a bijection onto the pp x dp grid, and rank_of inverts it.
    coords = [t0.coords(r) for r in range(world)]
    assert sorted(coords) == [(p, d) for p in range(partitions) for d in range(dp)]
    for r, (p, d) in enumerate(coords):
        assert t0.rank_of(p, d) == r
        assert (topos[r].pp_rank, topos[r].dp_rank, topos[r].mp_rank) == (p, d, p)

    # pp groups / dp groups each partition the world.
    pp_groups = {t0.pp_group(r) for r in range(world)}
    dp_groups = {t0.dp_group(r) for r in range(world)}
    assert sorted(r for g in pp_groups for r in g) == list(range(world))
    assert sorted(r for g in dp_groups for r in g) == list(range(world))
    assert len(pp_groups) == dp and len(dp_groups) == partitions
    for r in range(world):
        p, d = coords[r]
        pg, dg = t0.pp_group(r), t0.dp_group(r)
        assert topos[r].pp_group() == pg and topos[r].dp_group() == dg
        assert len(pg) == partitions and pg[p] == r
        assert [t0.coords(x) for x in pg] == [(s, d) for s in range(partitions)]
        assert len(dg) == dp and dg[d] == r
        assert [t0.coords(x) for x in dg] == [(p, k) for k in range(dp)]
        # A pp group and a dp group meet in exactly one rank.
        assert set(pg) & set(dg) == {r}

    if strategy == "cluster":
        for g in pp_groups:  # a replica's stages are consecutive ranks
            assert g == tuple(range(g[0], g[0] + partitions))
    else:
        for g in dp_groups:  # a stage's replicas are consecutive ranks
            assert g == tuple(range(g[0], g[0] + dp))


@pytest.mark.parametrize(
    "strategy, rank, coords, pp_group, dp_group",
    [
        ("cluster", 0, (0, 0), (0, 1), (0, 2, 4)),
        ("cluster", 3, (1, 1), (2, 3), (1, 3, 5)),
        ("cluster", 4, (0, 2), (4, 5), (0, 2, 4)),
        ("spread", 0, (0, 0), (0, 3), (0, 1, 2)),
        ("spread", 3, (1, 0), (0, 3), (3, 4, 5)),
        ("spread", 5, (1, 2), (2, 5), (3, 4, 5)),
    ],
)
def test_layout_explicit(strategy, rank, coords, pp_group, dp_group):
    topo = Topology(6, rank, ("h",) * 6, partitions=2, placement_strategy=strategy)
    assert (topo.pp_rank, topo.dp_rank) == coords
    assert topo.pp_group() == pp_group
    assert topo.dp_group() == dp_group


@pytest.mark.parametrize(
    "hosts",
    [
        ("a", "a", "a", "b", "c", "c"),
        ("a", "b", "a", "b", "a", "a"),  # interleaved labels
        ("x",) * 6,
        ("a", "b", "c", "d", "e", "f"),
        ("z", "y", "y", "y", "y", "z"),
    ],
)
def test_local_ranks_uneven_hosts(hosts):
    topos = [Topology(6, r, hosts, partitions=2) for r in range(6)]
    labels = list(dict.fromkeys(hosts))
    assert topos[0].num_hosts == len(labels)
    for r, t in enumerate(topos):
        same = tuple(x for x in range(6) if hosts[x] == hosts[r])
        assert t.host_ranks == same
        assert t.local_size == len(same)
        assert t.local_rank == same.index(r) == t.local_rank_of(r) == topos[0].local_rank_of(r)
        assert t.host_index == labels.index(hosts[r]) == topos[0].host_of(r)
    # Local ranks on each host are 0..local_size-1.
    for label in labels:
        locals_ = sorted(t.local_rank for t in topos if hosts[t.rank] == label)
        assert locals_ == list(range(hosts.count(label)))


def test_from_cluster():
    info = resolve_cluster(environ=tf_env(
        {"chief": ["a:1"], "worker": ["a:2", "b:1", "b:2"]}, {"type": "worker", "index": 2}))
    topo = Topology.from_cluster(info, partitions=2, placement_strategy="spread")
    assert topo == Topology(4, 3, ("a", "a", "b", "b"), 2, "spread")
    assert (topo.pp_rank, topo.dp_rank, topo.local_rank, topo.host_index) == (1, 1, 1, 1)


def test_hosts_list_coerced_to_tuple():
    topo = Topology(2, 0, ["a", "b"])
    assert topo.hosts == ("a", "b")
    hash(topo)


# ---------------------------------------------------------------------------
# Topology validation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, parts",
    [
        (dict(world_size=0, rank=0, hosts=()), ["world_size must be >= 1", "0"]),
        (dict(world_size=2, rank=2, hosts=("a", "a")), ["rank must be in 0..1", "2"]),
        (dict(world_size=2, rank=-1, hosts=("a", "a")), ["rank must be in 0..1", "-1"]),
        (dict(world_size=2, rank=0, hosts=("a", "a"), partitions=0),
         ["partitions must be >= 1", "0"]),
        (dict(world_size=4, rank=0, hosts=("a",) * 4, partitions=3),
         ["partitions=3", "world_size=4", "3 or 6", "divisor of 4 (1, 2, 4)"]),
        (dict(world_size=2, rank=0, hosts=("a",) * 2, partitions=4),
         ["partitions=4", "world_size=2", "e.g. 4)", "(1, 2)"]),
        (dict(world_size=2, rank=0, hosts=("a", "a"), placement_strategy="random"),
         ["placement_strategy", "'random'"]),
        (dict(world_size=2, rank=0, hosts=("a",)), ["one label per rank", "received 1"]),
        (dict(world_size=2, rank=0, hosts="ab"), ["hosts must be a sequence", "'ab'"]),
        (dict(world_size=True, rank=0, hosts=("a",)), ["world_size must be an int", "True"]),
        (dict(world_size=2, rank=1.0, hosts=("a", "a")), ["rank must be an int", "1.0"]),
    ],
    ids=["world0", "rank_high", "rank_negative", "partitions0", "not_divisible",
         "partitions_gt_world", "bad_strategy", "hosts_len", "hosts_str", "bool_world",
         "float_rank"],
)
def test_topology_validation(kwargs, parts):
    with pytest.raises(ValueError) as info:
        Topology(**kwargs)
    msg = str(info.value)
    for part in parts:
        assert part in msg, (part, msg)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda t: t.coords(4), "rank must be an int in 0..3, received 4"),
        (lambda t: t.coords(-1), "received -1"),
        (lambda t: t.rank_of(2, 0), "pp_rank must be an int in 0..1, received 2"),
        (lambda t: t.rank_of(0, 2), "dp_rank must be an int in 0..1, received 2"),
        (lambda t: t.pp_group(9), "received 9"),
        (lambda t: t.dp_group(4), "received 4"),
        (lambda t: t.local_rank_of(4), "received 4"),
        (lambda t: t.host_of(True), "received True"),
    ],
)
def test_topology_bad_arguments(call, message):
    topo = Topology(4, 0, ("a",) * 4, partitions=2)
    with pytest.raises(ValueError, match=re.escape(message)):
        call(topo)




DOCUMENTED = [ClusterInfo, Topology, Topology.from_cluster, Topology.coords, Topology.rank_of,
              Topology.pp_group, Topology.dp_group, Topology.local_rank_of, Topology.host_of,
              resolve_cluster, expand_hostlist, parse_tasks_per_node]


@pytest.mark.parametrize("obj", DOCUMENTED, ids=[o.__qualname__ for o in DOCUMENTED])
def test_docstring_examples_run(obj):
    examples = re.findall(r"```python\n(.*?)```", inspect.getdoc(obj) or "", flags=re.S)
    assert examples
    for code in examples:
        exec(compile(code, f"<{obj.__qualname__} example>", "exec"), {})
