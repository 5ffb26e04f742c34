"""The world the environment describes: never silently a world of one."""

import pytest

from shardkit.runtime import _rendezvous
from shardkit.runtime._runtime import env_world

DIST = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS", "SLURM_PROCID")


@pytest.fixture
def env(monkeypatch):
    for name in DIST:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_no_environment_is_a_world_of_one(env):
    assert env_world() is None
    env.setenv("WORLD_SIZE", "1")
    assert env_world() is None


def test_torchrun_environment(env):
    for k, v in dict(WORLD_SIZE="3", RANK="2", MASTER_ADDR="h", MASTER_PORT="1").items():
        env.setenv(k, v)
    assert env_world() == (2, 3)


def test_slurm_environment(env):
    for k, v in dict(SLURM_NTASKS="4", SLURM_PROCID="1", MASTER_ADDR="h", MASTER_PORT="1").items():
        env.setenv(k, v)
    assert env_world() == (1, 4)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (dict(WORLD_SIZE="2"), "RANK is not"),
        (dict(WORLD_SIZE="2", RANK="0"), "MASTER_ADDR is not"),
        (dict(WORLD_SIZE="2", RANK="0", MASTER_ADDR="h"), "MASTER_PORT is not"),
        (dict(WORLD_SIZE="2", RANK="2", MASTER_ADDR="h", MASTER_PORT="1"), "RANK=2 is outside"),
        (dict(WORLD_SIZE="two"), "WORLD_SIZE='two' is not an integer"),
    ],
)
def test_incomplete_description_raises_naming_the_variable(env, values, message):
    for k, v in values.items():
        env.setenv(k, v)
    with pytest.raises(ValueError, match=message):
        env_world()


def test_xla_rendezvous_is_registered_and_resolves_a_world_of_one(env):
    import torch.distributed as dist

    store, rank, size = next(dist.rendezvous("xla://"))
    assert (rank, size) == (0, 1)
    store.set("k", "v")
    assert store.get("k") == b"v"
    assert _rendezvous.SCHEME == "xla"


def test_a_long_wait_at_exit_says_why_on_stderr(monkeypatch, capsys):
    """A rank that finished waits at exit for the others; when one of them is stuck in a
    collective only it called (`if rank == 0: st.full_tensor()`), that wait lasted the
    group's timeout (10 minutes) with no word. Now it says why after a while."""
    from shardkit.runtime._teardown import wait_at_exit

    class Work:  # completes after a few polls, as a barrier the others reach late
        polls, waited = 0, False

        def is_completed(self):
            self.polls += 1
            return self.polls > 12

        def wait(self):
            self.waited = True

    monkeypatch.setenv("SHARDKIT_EXIT_WAIT_WARN", "0.01")
    work = Work()
    assert wait_at_exit(work, 1)
    err = capsys.readouterr().err
    assert work.waited and "rank 1 reached the end of the program and has waited" in err
    assert "every rank" in err
    monkeypatch.setenv("SHARDKIT_EXIT_WAIT_WARN", "30")
    assert wait_at_exit(Work(), 1)  # a short wait says nothing
    assert capsys.readouterr().err == ""


def test_the_wait_at_exit_is_bounded(monkeypatch, capsys):
    """A rank that finished waited at exit until the group's timeout (10 minutes) when
    another was stuck in a collective only it called; now it leaves after
    SHARDKIT_EXIT_WAIT_MAX seconds, saying so, and its exit fails the stuck rank."""
    from shardkit.runtime._teardown import wait_at_exit

    class Never:  # a barrier some rank never reaches
        def is_completed(self):
            return False

        def wait(self):
            raise AssertionError("waited on a barrier that never completes")

    monkeypatch.setenv("SHARDKIT_EXIT_WAIT_MAX", "0.05")
    assert not wait_at_exit(Never(), 1)
    assert "leaves without them (SHARDKIT_EXIT_WAIT_MAX)" in capsys.readouterr().err


def test_a_blank_variable_counts_as_unset(env):
    env.setenv("WORLD_SIZE", "  ")
    assert env_world() is None


def test_hybrid_mesh_names_a_bad_local_world_size(monkeypatch):
    from shardkit.spmd import HybridMesh

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE='two' is not an integer"):
        HybridMesh(ici_mesh_shape=(1,), dcn_mesh_shape=(2,))


def test_replica_thread_count_ignores_a_bad_local_world_size(monkeypatch):
    from shardkit.checkpoint._core._replicas import _cores

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    assert _cores() >= 1
