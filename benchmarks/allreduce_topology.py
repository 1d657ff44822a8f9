"""Gradient all-reduce across 2 emulated hosts: ring vs hierarchical vs the link bound.

Two emulated hosts, each a network namespace this benchmark creates, joined
by a veth pair whose two ends are shaped with tc (default 200 Mbit/s each
way, plus 1 ms delay when the kernel has netem). Two worker processes per
host (4 in all) form one TensorFlow cluster (TF_CONFIG with the hosts' own
addresses, so keras-smp sees 2 hosts from the cluster spec, no emulation
flag); traffic inside a host goes over that namespace's loopback, traffic
between hosts over the shaped link. Every worker all-reduces 64 MB of
float32 "gradients" (4 tensors, fused) with `SMPStrategy`'s gradient sync,
once per algorithm, side by side in one run:

- ring: one flat collective over the 4 workers; each direction of the link
  carries 2(n-1)/n x 64 MB = 96 MB;
- hierarchical: sum inside each host, all-reduce one half per local rank
  across hosts (in parallel), share back inside the host; each direction
  carries 64 MB, the least any all-reduce over 2 hosts can send;
- the link bound: 64 MB / the link's bandwidth.

Prints the median of `--reps` timed all-reduces (after a warm-up), the
ratios, the TCP throughput the shaped link really gives, and whether the
targets hold: hierarchical <= 0.70x ring and <= 1.3x the bound. Every result
is checked against the exact sum. Needs root (network namespaces); without
permission it says so and exits 0.

    python benchmarks/allreduce_topology.py              # ~2 minutes
    python benchmarks/allreduce_topology.py --mbytes 16 --rate-mbit 400
"""

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST_IPS = ("10.77.0.1", "10.77.0.2")
WORKERS_PER_HOST = 2
TENSORS = 4


# ---- worker (runs inside a namespace) -------------------------------------

def worker(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras_smp

    strategy = keras_smp.SMPStrategy(
        allreduce=args.worker, fusion_threshold_mb=args.mbytes,
        collective_timeout_seconds=args.timeout)
    import tensorflow as tf

    n = strategy.num_replicas_in_sync
    rank = keras_smp.rank()
    elements = int(args.mbytes * 1e6) // 4 // TENSORS

    @tf.function
    def step(scale):
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            # Replica r contributes (r + 1) * scale everywhere.
            value = tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32) * scale
            grads = [tf.fill([elements], value) for _ in range(TENSORS)]
            out = ctx.all_reduce(tf.distribute.ReduceOp.SUM, grads)
            # Small checks instead of fetching 64 MB: min and max of each.
            return tf.stack([tf.reduce_min(t) for t in out]
                            + [tf.reduce_max(t) for t in out])
        return strategy.experimental_local_results(
            strategy.run(replica_fn))[0]

    expected = n * (n + 1) / 2
    times = []
    for rep in range(args.reps + 1):
        start = time.perf_counter()
        checks = step(tf.constant(1.0 + rep)).numpy()
        elapsed = time.perf_counter() - start
        if not (checks == expected * (1.0 + rep)).all():
            raise AssertionError(
                f"rank {rank}: all-reduce gave {sorted(set(checks))}, "
                f"expected {expected * (1.0 + rep)}")
        if rep:  # rep 0 warms up (tracing, group set-up)
            times.append(elapsed)
    if rank == 0:
        print("RESULT " + json.dumps({
            "algorithm": strategy.allreduce_algorithm, "replicas": n,
            "hosts": strategy.topology.num_hosts,
            "buckets": strategy.gradient_sync.buckets_traced,
            "times": times}), flush=True)


# ---- namespaces and links --------------------------------------------------

def _run(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


class EmulatedHosts:
    """Two network namespaces joined by a shaped veth pair; removed on exit."""

    def __init__(self, rate_mbit, delay_ms, queue_ms=100):
        tag = f"{os.getpid() % 100000}"
        self.namespaces = (f"ksmp{tag}a", f"ksmp{tag}b")
        self.links = (f"ks{tag}a", f"ks{tag}b")
        self.rate_mbit, self.delay_ms = rate_mbit, delay_ms
        self.queue_ms = queue_ms
        self.shaping = None

    def __enter__(self):
        try:
            self._create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc):
        self.remove()

    def _check(self, proc, what):
        if proc.returncode:
            raise OSError(f"{what}: {proc.stderr.strip() or proc.stdout.strip()}")

    def _create(self):
        for ns in self.namespaces:
            self._check(_run("ip", "netns", "add", ns), f"ip netns add {ns}")
        a, b = self.links
        self._check(_run("ip", "link", "add", a, "type", "veth", "peer",
                         "name", b), "ip link add veth")
        for ns, link, ip in zip(self.namespaces, self.links, HOST_IPS):
            self._check(_run("ip", "link", "set", link, "netns", ns),
                        f"move {link} to {ns}")
            self._check(_run("ip", "-n", ns, "addr", "add", f"{ip}/24",
                             "dev", link), f"address {ip}")
            for dev in (link, "lo"):
                self._check(_run("ip", "-n", ns, "link", "set", dev, "up"),
                            f"{dev} up in {ns}")
        for ns, link in zip(self.namespaces, self.links):
            self.shaping = self._shape(ns, link)

    def _shape(self, ns, link):
        rate = f"{self.rate_mbit}mbit"
        if self.delay_ms:
            netem = _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev",
                         link, "root", "netem", "delay", f"{self.delay_ms}ms",
                         "rate", rate, "limit", "100000")
            if not netem.returncode:
                return f"netem rate {rate} delay {self.delay_ms} ms"
        tbf = _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev",
                   link, "root", "tbf", "rate", rate, "burst", "64kb",
                   "latency", f"{self.queue_ms}ms")
        self._check(tbf, f"tc tbf on {link}")
        note = " (netem unavailable in this kernel: no added delay)" if (
            self.delay_ms) else ""
        return f"tbf rate {rate} queue {self.queue_ms:g} ms{note}"

    def remove(self):
        for ns in self.namespaces:
            _run("ip", "netns", "del", ns)  # also removes its veth end

    def exec_prefix(self, host):
        return ["ip", "netns", "exec", self.namespaces[host]]


def link_throughput(hosts, mbytes=16, port=5999):
    """Measured TCP throughput host 0 -> host 1 through the shaped link."""
    code = (
        "import socket,sys,time\n"
        "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
        f"s.bind(('0.0.0.0',{port}));s.listen(1);c,_=s.accept();n=0;t=None\n"
        "while True:\n"
        "    b=c.recv(1<<20)\n"
        "    if not b: break\n"
        "    t=t or time.perf_counter();n+=len(b)\n"
        "print(n*8/(time.perf_counter()-t)/1e6)\n")
    server = subprocess.Popen(hosts.exec_prefix(1) + [sys.executable, "-c", code],
                              stdout=subprocess.PIPE, text=True)
    try:
        client = (
            "import socket,time\n"
            "for _ in range(100):\n"
            "    try:\n"
            f"        c=socket.create_connection(('{HOST_IPS[1]}',{port}));break\n"
            "    except OSError: time.sleep(0.05)\n"
            f"c.sendall(b'x'*{int(mbytes * 1e6)});c.close()\n")
        subprocess.run(hosts.exec_prefix(0) + [sys.executable, "-c", client],
                       timeout=120, check=True)
        out, _ = server.communicate(timeout=60)
        return float(out.strip())
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


# ---- one cluster run --------------------------------------------------------

def run_cluster(hosts, algorithm, args, base_port, per_host=WORKERS_PER_HOST):
    addresses = [f"{HOST_IPS[h]}:{base_port + i}"
                 for i, h in enumerate(_worker_hosts(per_host))]
    procs, outputs = [], []
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    for k in ("SMP_HOST_MAP", "SMP_CONFIG", "SLURM_PROCID"):
        env.pop(k, None)
    try:
        for i, h in enumerate(_worker_hosts(per_host)):
            env["TF_CONFIG"] = json.dumps({
                "cluster": {"worker": addresses},
                "task": {"type": "worker", "index": i}})
            procs.append(subprocess.Popen(
                hosts.exec_prefix(h) + [
                    sys.executable, os.path.abspath(__file__),
                    "--worker", algorithm, "--mbytes", str(args.mbytes),
                    "--reps", str(args.reps), "--timeout", str(args.timeout)],
                env=dict(env), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True))
            outputs.append([])
        readers = [threading.Thread(target=lambda p=p, o=o: o.extend(p.stdout),
                                    daemon=True)
                   for p, o in zip(procs, outputs)]
        for r in readers:
            r.start()
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs)
                      if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for p in procs:  # only the processes started here, by pid
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait()
    for r in readers:
        r.join(timeout=5)
    for line in outputs[0]:
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    bad = next((i for i, p in enumerate(procs) if p.returncode), 0)
    raise RuntimeError(
        f"{algorithm}: worker {bad} exited {procs[bad].returncode}:\n"
        + "".join(outputs[bad][-30:]))


def _worker_hosts(per_host=WORKERS_PER_HOST):
    return [h for h in range(len(HOST_IPS)) for _ in range(per_host)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mbytes", type=float, default=64.0,
                   help="float32 gradient megabytes (1e6 bytes) per worker")
    p.add_argument("--rate-mbit", type=int, default=200,
                   help="inter-host link rate, each direction")
    p.add_argument("--delay-ms", type=float, default=1.0,
                   help="inter-host delay (needs netem)")
    p.add_argument("--queue-ms", type=float, default=100.0,
                   help="link queue (tbf latency): data buffered per direction")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds per cluster run")
    p.add_argument("--algorithms", default="ring,hierarchical")
    p.add_argument("--no-floor", action="store_true",
                   help="skip the 1-worker-per-host reference run")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        print(f"allreduce_topology: skipped: {', '.join(missing)} not found "
              "(Debian package iproute2); this benchmark emulates hosts with "
              "network namespaces and tc.")
        return 0
    try:
        hosts_cm = EmulatedHosts(args.rate_mbit, args.delay_ms, args.queue_ms)
        hosts = hosts_cm.__enter__()
    except OSError as e:
        print(f"allreduce_topology: skipped: cannot create network namespaces "
              f"and shaped links here ({e}). Run as root on Linux.")
        return 0
    try:
        return report(hosts, args)
    finally:
        hosts_cm.__exit__(None, None, None)


def report(hosts, args):
    n = len(_worker_hosts())
    mb = args.mbytes
    bound = mb * 8 / args.rate_mbit  # seconds for mb MB to cross once
    print(f"2 emulated hosts x {WORKERS_PER_HOST} workers, link "
          f"{hosts.shaping} each way; all-reduce of {mb:g} MB float32 per "
          f"worker, median of {args.reps} after a warm-up")
    print(f"network namespaces: {' '.join(hosts.namespaces)} (removed on exit)")
    tput = link_throughput(hosts)
    print(f"TCP throughput through the link: {tput:.0f} Mbit/s "
          f"(nominal {args.rate_mbit})")
    crossing = {"ring": 2 * (n - 1) / n * mb, "hierarchical": mb}
    results = {}
    for k, algorithm in enumerate(args.algorithms.split(",")):
        r = run_cluster(hosts, algorithm, args, base_port=21000 + 100 * k)
        assert r["hosts"] == 2 and r["replicas"] == n, r
        results[algorithm] = statistics.median(r["times"])
        print(f"  {algorithm:<13} {results[algorithm]:6.2f} s  "
              f"(runs {', '.join(f'{t:.2f}' for t in r['times'])}; "
              f"{crossing.get(algorithm, float('nan')):g} MB cross the link "
              f"each way, alone {crossing.get(algorithm, 0) * 8 / args.rate_mbit:.2f} s)")
    if not args.no_floor:
        # What TensorFlow's collectives achieve over this link with nothing
        # else to do: 1 worker per host, the 64 MB cross once each way.
        r = run_cluster(hosts, "ring", args, base_port=29000, per_host=1)
        floor = statistics.median(r["times"])
        print(f"  {'1 per host':<13} {floor:6.2f} s  (1 worker per host: "
              f"the cross-host all-reduce alone, {mb:g} MB each way)")
    print(f"  {'link bound':<13} {bound:6.2f} s  ({mb:g} MB / "
          f"{args.rate_mbit} Mbit/s)")
    if "ring" in results and "hierarchical" in results:
        vs_ring = results["hierarchical"] / results["ring"]
        vs_bound = results["hierarchical"] / bound
        print(f"hierarchical / ring  = {vs_ring:.3f}x  (target <= 0.70x: "
              f"{'met' if vs_ring <= 0.70 else 'MISSED'})")
        print(f"hierarchical / bound = {vs_bound:.3f}x  (target <= 1.30x: "
              f"{'met' if vs_bound <= 1.30 else 'MISSED'})")
        print(f"ring / bound         = {results['ring'] / bound:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
