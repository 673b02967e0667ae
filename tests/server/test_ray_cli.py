"""`iterserve serve --data-parallel-size N` refusing bad start-up input: one line, nothing left running.
Each is refused before any Ray starts, so these tests start none."""
from __future__ import annotations

import os
import typing

import pytest

ray = pytest.importorskip("ray", reason="ray[serve] is not installed (pip install 'iterserve[serve]')")

from iterserve.config import RouterPolicy  # noqa: E402
from iterserve.router.policy import POLICIES  # noqa: E402
from iterserve.server import ray_cli  # noqa: E402
from iterserve.server.cli import main  # noqa: E402
from tests.server.conftest import wait_for  # noqa: E402


def children() -> set[int]:
    """This process's live descendants (Ray's node processes are started as its children)."""
    parents = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(pid)] = int(fields[1])
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return f"{pid} (gone)"


def refused(argv: list[str], capfd) -> str:
    """The one error line of a refused start-up (argparse may print its usage above it), nothing left behind."""
    before = children()
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    err = capfd.readouterr().err.strip().splitlines()
    errors = [line for line in err if "error:" in line]
    assert len(errors) == 1 and err[-1] == errors[0] and "Traceback" not in "\n".join(err), err
    assert not ray.is_initialized()
    try:
        wait_for(lambda: children() <= before, 15, interval=0.2)
    except AssertionError:
        raise AssertionError(f"left running: {[command(pid) for pid in children() - before]}") from None
    return errors[0]


@pytest.mark.parametrize("argv, message", [
    (["--data-parallel-size", "2", "--ray-address", "127.0.0.1:1"], "cannot reach a Ray cluster at 127.0.0.1:1"),
    (["--data-parallel-size", "2", "--ray-address", "not an address"],
     "ray_address must be auto, local, HOST:PORT or ray://HOST:PORT"),
    (["--ray-address", "127.0.0.1:6379"], "--ray-address places replicas on a Ray cluster: it needs "
                                          "--data-parallel-size > 1"),
    (["--data-parallel-size", "0"], "data_parallel_size: Input should be greater than or equal to 1"),
    (["--data-parallel-size", "2", "--num-cpus-per-replica", "0"],
     "num_cpus_per_replica: Input should be greater than 0"),
    (["--data-parallel-size", "2", "--router", "random"], "argument --router: invalid choice: 'random'"),
])
def test_bad_flags_are_one_line_and_leave_nothing_running(argv, message, capfd, default_model_path):
    assert message in refused(argv, capfd)


def test_a_tensor_parallel_size_the_heads_refuse_is_one_line_before_ray_starts(default_model_path, capfd):
    line = refused(["--data-parallel-size", "2", "--tensor-parallel-size", "2"], capfd)
    assert "tensor_parallel_size 2 does not divide the model's 9 attention heads" in line


def test_more_gpus_than_this_machine_has_is_one_line_before_ray_starts(default_model_path, capfd, monkeypatch):
    monkeypatch.setattr(ray_cli, "_local_gpus", lambda: 1)
    line = refused(["--data-parallel-size", "2", "--device", "cuda"], capfd)
    assert "2 replicas x tensor_parallel_size 1 need 2 GPUs; Ray has 1" in line


def test_a_ray_that_fails_to_start_is_one_line(default_model_path, capfd, monkeypatch):
    def init(**kwargs):
        raise RuntimeError("Failed to start the GCS server\nmore detail")

    monkeypatch.setattr(ray, "init", init)
    assert "cannot start Ray: Failed to start the GCS server" in refused(["--data-parallel-size", "2"], capfd)


def test_replica_gpus_follow_the_device():
    assert ray_cli.replica_gpus("cpu", 1, 4, 8) == 0
    assert ray_cli.replica_gpus("auto", 1, 4, 0) == 0  # no GPU anywhere: the CPU, as auto means
    assert ray_cli.replica_gpus("auto", 2, 4, 8) == 2  # on a GPU cluster each replica reserves its ranks'
    assert ray_cli.replica_gpus("cuda", 2, 2, 4) == 2
    with pytest.raises(ValueError, match="2 replicas x tensor_parallel_size 2 need 4 GPUs; Ray has 3"):
        ray_cli.replica_gpus("auto", 2, 2, 3)


def test_the_router_choices_are_the_policies():
    assert typing.get_args(RouterPolicy) == POLICIES


def test_a_local_ray_short_of_cpus_is_one_line_before_it_starts(default_model_path, capfd, monkeypatch):
    monkeypatch.setattr(ray_cli, "_local_cpus", lambda: 2.0)
    line = refused(["--data-parallel-size", "3", "--num-cpus-per-replica", "1"], capfd)
    assert "3 replicas x num_cpus_per_replica 1 need 3 CPUs; this machine's Ray has 2" in line
