"""Hosts for the multi-host tests: one network namespace per host on a bridge of our own, each with a veth
pair and an address in 10.203.0.0/24, and a hosts file per namespace (`ip netns exec` bind-mounts
/etc/netns/NS/hosts over /etc/hosts) that stands in for DNS.

The addresses never leave the bridge: the namespaces have no default route, and the test process (in the
root namespace) reaches them through the bridge's own address. A run takes one of eight /27 slots of the
/24 under a lock file, so two runs on one machine never share a subnet; every name carries a random run id,
so a crashed run's leftovers cannot collide with a new one (the next run in its slot removes them).
"""
from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import IO

PREFIX = "kvy"           # every interface and namespace name this module makes starts with it
SUBNET = "10.203.0"      # a /24, only ever inside our namespaces and on our bridge
SLOTS = 8                # /27 slots: 30 addresses each, the bridge takes the first
SLOT_SIZE = 32
NETNS_ETC = Path("/etc/netns")
LOCK_DIR = Path("/tmp")


class Unavailable(Exception):
    """Namespaces cannot be made here (the reason says why); the tests skip."""


def check_available() -> None:
    if os.geteuid() != 0:
        raise Unavailable("network namespaces need root (CI runs as root; run `sudo make test-multihost`)")
    if shutil.which("ip") is None:
        raise Unavailable("the `ip` command (iproute2) is missing: apt-get install -y iproute2")
    probe = f"{PREFIX}probe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        raise Unavailable(f"`ip netns add` fails here: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def ip(*args: str) -> str:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


@dataclass(frozen=True)
class Host:
    name: str       # what the tests call it: "master", "pd1", ...
    netns: str      # its namespace
    address: str    # its address on the bridge
    veth: str       # the bridge's end of its link: down = the host is off the network

    def argv(self, *command: str) -> list[str]:
        """`command` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *command]


class Network:
    """A bridge and the hosts on it; close() removes every namespace, interface and hosts file it made."""

    def __init__(self) -> None:
        check_available()
        self.run_id = secrets.token_hex(2)
        self._lock, slot = _take_slot()
        self._base = slot * SLOT_SIZE
        self.bridge = f"{PREFIX}b{self.run_id}"
        self.hosts: dict[str, Host] = {}
        _remove_leftovers(f"{SUBNET}.{self._base + 1}")
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{SUBNET}.{self._base + 1}/27", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
        except Exception:
            self.close()
            raise

    def address(self, index: int) -> str:
        """The index-th host address of this run's slot (0 is the first host's); also for addresses no
        host holds (a wrong advertised address)."""
        if not 0 <= index < SLOT_SIZE - 3:
            raise ValueError(f"a slot has {SLOT_SIZE - 3} host addresses, asked for #{index}")
        return f"{SUBNET}.{self._base + 2 + index}"

    def add_host(self, name: str) -> Host:
        index = len(self.hosts)
        host = Host(name, f"{PREFIX}{self.run_id}-{name}", self.address(index), f"{PREFIX}{self.run_id}h{index}")
        inner = f"{PREFIX}{self.run_id}n{index}"
        self.hosts[name] = host
        ip("netns", "add", host.netns)
        ip("link", "add", host.veth, "type", "veth", "peer", "name", inner)
        ip("link", "set", host.veth, "master", self.bridge)
        ip("link", "set", host.veth, "up")
        ip("link", "set", inner, "netns", host.netns)
        ip("-n", host.netns, "addr", "add", f"{host.address}/27", "dev", inner)
        ip("-n", host.netns, "link", "set", inner, "up")
        ip("-n", host.netns, "link", "set", "lo", "up")
        return host

    def write_hosts(self, names: dict[str, list[str]]) -> None:
        """The same hosts file in every namespace: each DNS name → the addresses of the hosts listed (a
        name with several is a Kubernetes headless Service), and every host's own name."""
        aliases = {h.address: [h.name] for h in self.hosts.values()}
        for dns, members in names.items():
            for member in members:
                aliases[self.hosts[member].address].append(dns)
        # One line per address: c-ares (gRPC's resolver) reads only the first line of an address that is on
        # several, so `kvyard-backends` would resolve to one backend.
        lines = ["127.0.0.1 localhost", *(f"{a} {' '.join(names)}" for a, names in aliases.items())]
        text = "\n".join(lines) + "\n"
        for host in self.hosts.values():
            folder = NETNS_ETC / host.netns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(text)

    def cut(self, host: Host) -> None:
        """Takes the host off the network: its link goes down; packets to and from it are lost, as when a
        machine's cable is pulled (nothing is refused, connections just stop)."""
        ip("link", "set", host.veth, "down")

    def restore(self, host: Host) -> None:
        ip("link", "set", host.veth, "up")

    def close(self) -> None:
        """Remove everything this run made (safe to call twice, and after a partial setup)."""
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
            shutil.rmtree(NETNS_ETC / host.netns, ignore_errors=True)
            subprocess.run(["ip", "link", "del", host.veth], capture_output=True)  # gone with the peer, usually
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.hosts = {}
        if self._lock is not None:
            self._lock.close()  # releases the slot
            self._lock = None


def _take_slot() -> tuple[IO[str], int]:
    for slot in range(SLOTS):
        f = open(LOCK_DIR / f"kvyard-multihost-slot{slot}.lock", "w")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            continue
        return f, slot
    raise Unavailable(f"all {SLOTS} multi-host slots are taken by other runs on this machine")


def _remove_leftovers(bridge_address: str) -> None:
    """A crashed run in this slot may have left its bridge (with our subnet's route), namespaces and
    hosts files: we hold the slot's lock, so whatever carries its address is a dead run's."""
    for link in json.loads(ip("-j", "addr", "show") or "[]"):
        name = link.get("ifname", "")
        if name.startswith(f"{PREFIX}b") and any(a.get("local") == bridge_address for a in link.get("addr_info", [])):
            run_id = name[len(PREFIX) + 1:]
            for ns in ip("netns", "list").split():
                if ns.startswith(f"{PREFIX}{run_id}-"):
                    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
                    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
            subprocess.run(["ip", "link", "del", name], capture_output=True)
