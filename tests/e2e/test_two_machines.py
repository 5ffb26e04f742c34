"""Two "machines" on one host: two network namespaces joined by a veth pair.

Each namespace runs `shardkit demo --nnodes 2` (torchrun, static rendezvous) as its own
node. The only addresses involved are the two the test gives its own namespaces
(192.168.77.1/30 and 192.168.77.2/30, on interfaces that exist only inside them), so all
rendezvous, gloo and checkpoint-coordination traffic crosses the veth pair and nothing
else. Both nodes train, rank 0 is preempted by a real SIGTERM, both checkpoint the same
step into the shared --out directory, and a second torchrun on each node resumes from it.
The RAM-tier tests below run `two_machine_tiers.py` the same way (one rank per machine):
a lost machine restores from its peer's replica without storage, and a shard whose two
copies are both lost falls back to storage.
Skipped, with the reason, where namespaces cannot be created (not root, no iproute2).
"""

import os
import shutil
import signal
import subprocess
import sys

import pytest

ADDR = ("192.168.77.1", "192.168.77.2")


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def namespaces():
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed: cannot create network namespaces")
    tag = f"{os.getpid() % 100000}"
    ns = (f"sk2m_a_{tag}", f"sk2m_b_{tag}")
    veth = (f"sk2a{tag}", f"sk2b{tag}")  # interface names must stay under 16 chars
    made = []
    try:
        first = _ip("netns", "add", ns[0])
        if first.returncode != 0:
            pytest.skip(f"cannot create a network namespace: {first.stderr.strip()}")
        made.append(ns[0])
        steps = [
            ("netns", "add", ns[1]),
            ("link", "add", veth[0], "type", "veth", "peer", "name", veth[1]),
            ("link", "set", veth[0], "netns", ns[0]),
            ("link", "set", veth[1], "netns", ns[1]),
        ]
        for i in range(2):
            steps += [
                ("-n", ns[i], "addr", "add", f"{ADDR[i]}/30", "dev", veth[i]),
                ("-n", ns[i], "link", "set", veth[i], "up"),
                ("-n", ns[i], "link", "set", "lo", "up"),
            ]
        for step in steps:
            result = _ip(*step)
            if step[:2] == ("netns", "add") and result.returncode == 0:
                made.append(step[2])
            if result.returncode != 0:  # the environment, not shardkit: say why and skip
                pytest.skip(
                    f"cannot build the two namespaces: ip {' '.join(step)}: {result.stderr}"
                )
        yield ns, veth
    finally:
        for name in made:  # deleting a namespace also deletes the veth end inside it
            _ip("netns", "del", name)


def test_demo_trains_checkpoints_and_resumes_across_two_namespaces(namespaces, tmp_path):
    ns, veth = namespaces
    out = tmp_path / "shared"  # both "machines" see this directory: the shared storage
    procs = []
    for node in range(2):
        env = dict(os.environ, GLOO_SOCKET_IFNAME=veth[node], OMP_NUM_THREADS="1")
        cmd = [
            *("ip", "netns", "exec", ns[node], sys.executable, "-m", "shardkit", "demo"),
            *("--nnodes", "2", "--node-rank", str(node), "--nproc", "1"),
            *("--master-addr", ADDR[0], "--master-port", "29511"),
            *("--strategy", "ddp", "--hook", "powersgd", "--steps", "40", "--save-every", "10"),
            *("--out", str(out)),
        ]
        log = open(tmp_path / f"node{node}.log", "w+")
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    try:
        codes = [p.wait(timeout=240) for p, _ in procs]
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
    logs = []
    for _, log in procs:
        log.seek(0)
        logs.append(log.read())
        log.close()
    assert codes == [0, 0], "\n\n".join(f"node {i}:\n{text[-4000:]}" for i, text in enumerate(logs))
    node0 = logs[0]
    assert "preempted (SIGTERM) at step 20; checkpoint saved" in node0
    assert "resumed from step 20" in node0
    assert "powersgd hook, 2 ranks" in node0
    accuracy = float(next(x for x in node0.splitlines() if "accuracy" in x).split()[1])
    assert 0.5 < accuracy <= 1.0  # 40 steps: learning happened; `make demo` checks >= 0.95
    assert (out / "model.safetensors").is_file()
    for node in range(2):  # the ranks really talked over the veth pair
        sent = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                ns[node],
                "cat",
                f"/sys/class/net/{veth[node]}/statistics/tx_bytes",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert int(sent.stdout) > 100_000, (node, sent.stdout, sent.stderr)
    steps = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert steps == ["step_00000030", "step_00000039"]  # the demo keeps the newest two


# --- a lost machine and the RAM tier (issue 18) -------------------------------------------
# One rank per namespace, so rank 1's peer (the replica of its shard) is rank 0 on the
# other "machine". Each machine has its own RAM-tier directory (the namespaces share
# /dev/shm); the storage directory is shared. Phase 1 saves steps 0..7 (RAM every step,
# storage at 0 and 5), then both machines' processes are SIGKILLed (node A's too: under
# torchrun --max-restarts its ranks would be restarted as well; the RAM tier outlives them).

TIERS_SCRIPT = os.path.join(os.path.dirname(__file__), "two_machine_tiers.py")
TIERS_STEPS = 8


def _tier_phase(ns, veth, port, args, *, wait_for=None):
    """Run the script on both nodes; with ``wait_for``, return once each printed it."""
    procs = []
    for node in range(2):
        env = dict(os.environ, GLOO_SOCKET_IFNAME=veth[node], OMP_NUM_THREADS="1")
        env["PYTHONUNBUFFERED"] = "1"
        cmd = [
            *("ip", "netns", "exec", ns[node], sys.executable, "-m", "torch.distributed.run"),
            *("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1"),
            *("--master-addr", ADDR[0], "--master-port", str(port), TIERS_SCRIPT),
            *args(node),
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                start_new_session=True,  # one process group per "machine", to kill it whole
            )
        )
    if wait_for is not None:
        seen = []
        for p in procs:
            lines = []
            for line in p.stdout:  # blocks until the line comes or the process ends
                lines.append(line)
                if line.startswith(wait_for):
                    break
            seen.append("".join(lines))
        return procs, seen
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        _kill(procs)
    assert [p.returncode for p in procs] == [0, 0], "\n\n".join(outs)
    return procs, outs


def _kill(procs):
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=60)


def _train_then_lose_both_machines(ns, veth, tmp_path):
    storage, ram = tmp_path / "storage", [tmp_path / "ram_a", tmp_path / "ram_b"]
    procs, seen = _tier_phase(
        ns,
        veth,
        29521,
        lambda node: ["train", str(storage), str(ram[node]), str(TIERS_STEPS)],
        wait_for="READY",
    )
    try:
        workers = []
        for node, text in enumerate(seen):
            assert f"READY {node} " in text, f"node {node}:\n{text[-4000:]}"
            workers.append(int(text.split(f"READY {node} ")[1].split()[0]))
        for pid in workers[::-1]:  # machine B's rank first, then A's
            os.kill(pid, signal.SIGKILL)  # torchrun starts its ranks in their own session
    finally:
        _kill(procs[::-1])
    steps = sorted(p.name for p in storage.iterdir() if p.name.startswith("step_"))
    assert steps == ["step_00000000", "step_00000005"]  # storage never had steps 6 and 7
    for node in range(2):  # each machine holds its own copy and its peer's replica of 7
        other = 1 - node
        assert (ram[node] / "local" / f"rank_{node:05d}" / "step_00000007").is_dir()
        assert (ram[node] / "replica" / f"rank_{other:05d}" / "step_00000007").is_dir()
    return storage, ram


def _snapshot(root):
    return {
        os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
        for d, _, files in os.walk(root)
        for f in files
    }


def test_lost_machine_restores_from_the_peer_replica_without_storage(namespaces, tmp_path):
    ns, veth = namespaces
    storage, ram = _train_then_lose_both_machines(ns, veth, tmp_path)
    shutil.rmtree(ram[1])  # machine B is gone: its RAM with it
    before = _snapshot(storage)
    _, outs = _tier_phase(ns, veth, 29522, lambda node: ["restore", str(storage), str(ram[node])])
    text = "\n".join(outs)
    # step 7 exists only in RAM: rank 0 from its own copy, rank 1 from the replica on A
    assert "RESTORED 0 7 local local,peer" in outs[0], text[-4000:]
    assert "RESTORED 1 7 peer local,peer" in outs[1], text[-4000:]
    assert _snapshot(storage) == before  # storage was not written to
    leftovers = [f for r in ram if r.exists() for f in _snapshot(r)]
    assert leftovers == []  # the clean exit removed the copies (B's re-made one included)


def test_both_copies_of_a_shard_lost_falls_back_to_storage(namespaces, tmp_path):
    ns, veth = namespaces
    storage, ram = _train_then_lose_both_machines(ns, veth, tmp_path)
    shutil.rmtree(ram[1] / "local" / "rank_00001")  # rank 1's own copies, on machine B
    shutil.rmtree(ram[0] / "replica" / "rank_00001")  # and their replicas, on machine A
    _, outs = _tier_phase(ns, veth, 29523, lambda node: ["restore", str(storage), str(ram[node])])
    text = "\n".join(outs)
    # RAM has no step of rank 1 left (nor step 5 of rank 0: it keeps 6 and 7), so every
    # rank reads storage's step 5
    assert "RESTORED 0 5 persistent persistent,persistent" in outs[0], text[-4000:]
    assert "RESTORED 1 5 persistent persistent,persistent" in outs[1], text[-4000:]
