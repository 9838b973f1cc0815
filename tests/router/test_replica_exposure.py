"""What a server of replicas shows the network: every process of it (the front end, Ray's GCS and raylet, the
replica actors, Ray's agents) listens on loopback only, and the open ``/health`` says whether each replica is
healthy, not its process id or the machine's name.

Found by attacking the server: with ``--data-parallel-size 2``, Ray's GCS, raylets, the actors and its agents
listened on every interface (Ray swaps a loopback node address for the machine's own), and the open
``/health`` showed each replica's PID and the host name.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import httpx
import pytest

from conveyor.engine.replicas import RAY_LOOPBACK_ENV, ReplicaSettings, ray_start
from conveyor.entrypoints.openai.api_server import public_health
from tests.serving import running_server

KEY = "exposure-key"


def test_a_ray_started_here_keeps_to_loopback_unless_told_otherwise() -> None:
    options, environment = ray_start(ReplicaSettings(), cpus=4)
    assert options["_node_ip_address"] == "127.0.0.1" and environment == {RAY_LOOPBACK_ENV: "0"}
    options, environment = ray_start(ReplicaSettings(ray_host="10.1.2.3"), cpus=4)
    assert options["_node_ip_address"] == "10.1.2.3" and environment == {}, "other machines may join"
    options, environment = ray_start(ReplicaSettings(ray_address="auto"), cpus=4)
    assert options == {"address": "auto", "log_to_driver": False} and environment == {}


def test_the_open_health_shows_state_only() -> None:
    report = {"router_policy": "cache-aware", "failover": {"retried": 0},
              "replicas": [{"replica": 0, "healthy": True, "pid": 41, "host": "box", "restarts": 0}]}
    assert public_health(report) == {"replicas": [{"replica": 0, "healthy": True}]}


def _process_tree(root: int) -> set[int]:
    """``root`` and every process descended from it, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += children.get(pid, [])
    return tree


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} write it: 32-bit words in the machine's (little-endian) byte order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _listeners() -> dict[str, str]:
    """Every listening TCP socket of the machine: inode -> "address:port"."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                host, port = fields[1].split(":")
                found[fields[9]] = f"{_address(host)}:{int(port, 16)}"
    return found


def _loopback(where: str) -> bool:
    address = ipaddress.ip_address(where.rsplit(":", 1)[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _sockets_of(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass  # a process that ended, or one not ours to read
    return inodes


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    pytest.importorskip("ray", reason="the replica tests need the ray extra: pip install 'conveyor[ray]'")
    with running_server(tiny_model_dir, "--data-parallel-size", "2", "--num-threads", "1", "--num-kv-blocks", "256",
                        api_key=KEY) as running:
        yield running


def test_every_process_of_the_server_listens_on_loopback_only(served) -> None:
    listeners = _listeners()
    mine = {pid: sorted(listeners[inode] for inode in _sockets_of(pid) if inode in listeners)
            for pid in _process_tree(served.process.pid)}
    listening = {pid: where for pid, where in mine.items() if where}
    assert len(listening) >= 5, f"the front end, GCS, raylet and two replicas listen: {listening}"
    exposed = {pid: where for pid, where in listening.items() if not all(_loopback(w) for w in where)}
    assert exposed == {}, f"listening beyond loopback: {exposed}"


def test_health_without_the_key_shows_state_and_with_it_more(served) -> None:
    public = httpx.get(f"{served.base}/health", timeout=10)
    assert public.status_code == 200, public.text
    assert public.json() == {"replicas": [{"replica": 0, "healthy": True}, {"replica": 1, "healthy": True}]}
    keyed = httpx.get(f"{served.base}/health", headers=served.headers, timeout=10).json()
    assert all(replica["pid"] and replica["host"] for replica in keyed["replicas"]), keyed
    assert keyed["router_policy"] == "cache-aware" and "failover" in keyed
