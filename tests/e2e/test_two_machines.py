"""Two "machines" on one host: two network namespaces joined by a veth pair.

Each namespace runs `shardkit demo --nnodes 2` (torchrun, static rendezvous) as its own
node. The only addresses involved are the two the test gives its own namespaces
(192.168.77.1/30 and 192.168.77.2/30, on interfaces that exist only inside them), so all
rendezvous, gloo and checkpoint-coordination traffic crosses the veth pair and nothing
else. Both nodes train, rank 0 is preempted by a real SIGTERM, both checkpoint the same
step into the shared --out directory, and a second torchrun on each node resumes from it.
Skipped, with the reason, where namespaces cannot be created (not root, no iproute2).
"""

import os
import shutil
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
