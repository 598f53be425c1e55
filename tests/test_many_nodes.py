"""launcher=local on several machines (issue 15): the same command on every node, one c10d
rendezvous at launcher.rdzv_endpoint. Two "nodes" here are two launcher processes on this host, each with
one CPU worker, meeting at 127.0.0.1.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from conftest import assert_same_float64_weights, on_the_cpu_plan, run_cli, subprocess_env
from helpers import NODES_COMMON as COMMON
from helpers import children, free_port, node
from launcher.launch.workers_address import interface_of, route_toward, serves_rendezvous, workers_address

pytestmark = pytest.mark.slow


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out + err


def errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the nodes' runs must equal: one node with two workers at the same global batch, never interrupted."""
    reference = tmp_path_factory.mktemp("one-node") / "run"
    out = run_cli(*COMMON, "launcher.nproc_per_node=2", f"hydra.run.dir={reference}", cwd=reference.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    return reference


@pytest.mark.parametrize("rendezvous", ["c10d", "static", "c10d-fsdp", "c10d-hybrid"])
def test_two_nodes_train_like_one_node_with_two_workers(tmp_path: Path, one_node: Path, rendezvous: str) -> None:
    """World size 2 from two launchers of one worker each (c10d: ranks by arrival; static: launcher.node_rank);
    the float64 weights equal those of one node with two workers (DDP) at the same global batch, also when the
    nodes shard the model between them (strategy=fsdp), or each over its own worker, a replica a node (hybrid)."""
    run_dir, port = tmp_path / "shared", free_port()
    ranks = (["launcher.node_rank=0"], ["launcher.node_rank=1"]) if rendezvous == "static" else ([], [])
    if rendezvous in ("c10d-fsdp", "c10d-hybrid"):
        ranks = (["strategy=fsdp"], ["strategy=fsdp"])
    if rendezvous == "c10d-hybrid":
        ranks = (["strategy=fsdp", "strategy.shard_size=node"],) * 2
    first, second = node(run_dir, port, *ranks[0]), node(run_dir, port, *ranks[1])
    for proc in (first, second):
        code, text = finish(proc)
        assert code == 0, text[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
    assert_same_float64_weights(run_dir, one_node, 12)
    if rendezvous == "c10d-hybrid":
        assert "then the root; over 1 rank, 2 replicas (hybrid)" in (run_dir / "launcher.log").read_text()


NAMELESS = "nowhere.invalid"  # a name no resolver answers for (RFC 6761's .invalid)


def nameless(*overrides: str) -> list[str]:
    """The launcher's command on a machine whose hostname resolves nowhere: its own UTS namespace (as root) named
    NAMELESS, as a container or cluster node whose name only DNS it cannot reach knows."""
    return ["unshare", "--uts", "sh", "-c", f'hostname {NAMELESS} && exec "$@"', "sh",
            sys.executable, "-m", "launcher", *on_the_cpu_plan(overrides)]


def can_rename_the_host() -> bool:
    try:
        return subprocess.run(nameless()[:6] + ["true"], capture_output=True, timeout=30).returncode == 0
    except OSError:
        return False


def test_the_workers_find_rank_0_s_store_at_an_address_every_node_reaches() -> None:
    assert workers_address("localhost:0") == "localhost"  # one node alone (--standalone)
    assert workers_address("127.0.0.1:29400") == "127.0.0.1"  # this machine serves the endpoint: as the nodes name it
    assert workers_address(f"{NAMELESS}:29400") is None  # torch's own error follows, at the rendezvous
    assert serves_rendezvous("127.0.0.1:29400") is serves_rendezvous(f"{NAMELESS}:29400") is None  # torch's guess
    ipv6 = Path("/proc/net/if_inet6").is_file() and "0" * 31 + "1 " in Path("/proc/net/if_inet6").read_text()
    assert interface_of("127.0.0.1") == "lo" and interface_of("::1") == ("lo" if ipv6 else None)
    route = route_toward("192.0.2.1")  # TEST-NET-1: off this machine, where a route leads there at all
    if route is not None:
        assert workers_address("192.0.2.1:29400") == route[0] != "192.0.2.1"  # this machine's own address
        assert serves_rendezvous("192.0.2.1:29400") is False  # another machine serves it


@pytest.mark.skipif(not can_rename_the_host(), reason="needs root and unshare --uts (util-linux)")
def test_a_machine_whose_name_resolves_nowhere_runs_alone_and_as_two_nodes(tmp_path: Path, one_node: Path) -> None:
    """pytorch#150532: rank 0's agent told the workers its getfqdn(), and its own store's client tried that name for
    300 s before the run failed, one node or two. One node of two workers, and two nodes of one, on a machine named
    NAMELESS; the nodes end equal to one node with two workers that could resolve its name."""
    alone = subprocess.run(nameless(*COMMON, "launcher.nproc_per_node=2", f"hydra.run.dir={tmp_path / 'alone'}"),
                           cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert_same_float64_weights(tmp_path / "alone", one_node, 12)
    run_dir, port = tmp_path / "shared", free_port()
    nodes = [subprocess.Popen(nameless(*COMMON, "launcher.nnodes=2", "launcher.nproc_per_node=1",
                                       f"launcher.rdzv_endpoint=127.0.0.1:{port}", "launcher.rdzv_timeout_s=60",
                                       f"hydra.run.dir={run_dir}"), cwd=tmp_path, env=subprocess_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for proc in nodes:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (out + err)[-3000:]
    assert_same_float64_weights(run_dir, one_node, 12)


@pytest.fixture
def two_machines() -> Iterator[tuple[list[list[str]], list[str]]]:
    """Two machines for the network, one for the files: two network namespaces (each its own loopback) joined by a
    veth pair, the first at 10.213.0.1. This machine's name resolves to no address of theirs, or to the loopback
    each has (here: vm, 127.0.0.1), as a Debian or Ubuntu node's resolves to 127.0.1.1. Yields the commands that
    run a program on each, and their network interfaces."""
    tag = f"{os.getpid() % 100_000}"
    spaces, links = [f"launcher-test-{tag}-{i}" for i in (0, 1)], [f"lt{tag}v{i}" for i in (0, 1)]
    setup = [["ip", "netns", "add", spaces[0]], ["ip", "netns", "add", spaces[1]],
             ["ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1]]]
    for i, (space, link) in enumerate(zip(spaces, links)):
        setup += [["ip", "link", "set", link, "netns", space],
                  ["ip", "-n", space, "addr", "add", f"10.213.0.{i + 1}/24", "dev", link],
                  ["ip", "-n", space, "link", "set", link, "up"], ["ip", "-n", space, "link", "set", "lo", "up"]]
    try:
        for command in setup:
            made = subprocess.run(command, capture_output=True, text=True, timeout=30)
            if made.returncode != 0:
                pytest.skip(f"needs root and iproute2's network namespaces: {' '.join(command)}: {made.stderr.strip()}")
        yield [["ip", "netns", "exec", space] for space in spaces], links
    finally:
        for space in spaces:  # (takes its end of the veth pair with it)
            subprocess.run(["ip", "netns", "del", space], capture_output=True, timeout=30)


def test_two_machines_whose_names_resolve_to_loopback_meet_at_an_address(tmp_path: Path, one_node: Path,
                                                                         two_machines) -> None:
    """pytorch#73656: the endpoint is the first machine's address, which torch's guess (its name's address) did not
    match, so no node served the rendezvous; the workers were told the name of rank 0's machine, which is each
    machine's own loopback; gloo bound the loopback its name resolves to. Each waited minutes, then failed. Now
    the first serves it, the workers meet at its address, gloo binds the veth's interface, and the nodes train as
    one node with two workers."""
    machines, interfaces = two_machines
    endpoint = f"10.213.0.1:{free_port()}"
    for machine, interface, serves in zip(machines, interfaces, ("True", "False")):
        chosen = subprocess.run([*machine, sys.executable, "-c", "from launcher.launch import workers_address as w; "
                                 f"print(w.serves_rendezvous('{endpoint}'), w.gloo_interface('{endpoint}'))"],
                                env=subprocess_env(), capture_output=True, text=True, timeout=60)
        assert chosen.stdout.strip() == f"{serves} {{'GLOO_SOCKET_IFNAME': '{interface}'}}", chosen.stderr[-2000:]
    run_dir = tmp_path / "shared"
    args = on_the_cpu_plan([*COMMON, "launcher.nnodes=2", "launcher.nproc_per_node=1", "launcher.rdzv_timeout_s=60",
                            f"launcher.rdzv_endpoint={endpoint}", "dist.startup_timeout_s=60",
                            f"hydra.run.dir={run_dir}"])
    nodes = []
    for machine in machines:
        nodes.append(subprocess.Popen([*machine, sys.executable, "-m", "launcher", *args], cwd=tmp_path,
                                      env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        time.sleep(1)  # (the first serves the rendezvous)
    for proc in nodes:
        code, text = finish(proc)
        assert code == 0, text[-3000:]
    assert_same_float64_weights(run_dir, one_node, 12)


def test_nodes_that_resolved_different_configs_stop_naming_the_keys(tmp_path: Path) -> None:
    run_dir, port = tmp_path / "shared", free_port()
    first, second = node(run_dir, port), node(run_dir, port, "optimizer.lr=0.5")
    for proc in (first, second):
        code, text = finish(proc)
        assert code != 0 and len(errors(text)) == 1, text[-3000:]
        assert "resolved another optimizer.lr than the node of rank 0" in errors(text)[0], errors(text)


def test_a_node_alone_or_an_endpoint_nobody_serves_is_one_line_within_the_timeout(tmp_path: Path) -> None:
    for endpoint in (f"127.0.0.1:{free_port()}",  # this node serves it, the other never comes
                     "192.0.2.1:29400"):  # TEST-NET-1: no host answers there
        started = time.monotonic()
        out = run_cli(*COMMON, "launcher.nnodes=2", "launcher.nproc_per_node=1", f"launcher.rdzv_endpoint={endpoint}",
                      "launcher.rdzv_timeout_s=5", f"hydra.run.dir={tmp_path / 'alone'}", cwd=tmp_path, timeout=120)
        assert out.returncode == 1 and len(errors(out.stderr)) == 1, out.stderr[-3000:]
        assert f"the rendezvous of 2 nodes at {endpoint} failed" in errors(out.stderr)[0]
        assert time.monotonic() - started < 60


def test_several_nodes_need_an_endpoint_and_a_shared_run_dir(tmp_path: Path) -> None:
    out = run_cli(*COMMON, "launcher.nnodes=2", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 2 and "launcher.nnodes=2 needs launcher.rdzv_endpoint=<host>:<port>" in out.stderr
    out = run_cli(*COMMON, "launcher.nnodes=2", "launcher.rdzv_endpoint=127.0.0.1:29400", cwd=tmp_path)
    assert out.returncode == 2 and "give every node the same hydra.run.dir" in out.stderr, out.stderr


def test_an_elastic_run_goes_on_without_a_lost_node(tmp_path: Path, one_node: Path) -> None:
    """launcher.nnodes=1:2: the second node (its launcher and its worker) is SIGKILLed after the step-4
    checkpoint. The first node's agent restarts its worker in a world of one node, which resumes from the
    last checkpoint at the same global batch (accumulation 2 -> 4) and ends equal, in float64, to one node
    with two workers that never lost anything."""
    run_dir, port = tmp_path / "shared", free_port()
    elastic = ("launcher.nnodes=1:2", "launcher.max_restarts=1", "train.ckpt_every=4", "data.sleep_s=0.1")
    first = node(run_dir, port, *elastic)
    time.sleep(2)  # the first node serves the rendezvous: it must outlive the second
    second = node(run_dir, port, *elastic)
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "4" / "COMPLETE").exists():
        assert time.monotonic() < deadline and first.poll() is None, "no checkpoint at step 4"
        time.sleep(0.05)
    for pid in [*children(second.pid), second.pid]:
        os.kill(pid, signal.SIGKILL)
    second.communicate()
    code, text = finish(first)
    assert code == 0, text[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["restarts"] == 1 and summary["resumed_from"] >= 4
    assert_same_float64_weights(run_dir, one_node, 12)
