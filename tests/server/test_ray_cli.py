"""`iterserve serve --data-parallel-size N` refusing bad start-up input: one line, nothing left running."""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="ray[serve] is not installed (pip install 'iterserve[serve]')")


@pytest.mark.parametrize("argv, message", [
    (["--data-parallel-size", "2", "--ray-address", "127.0.0.1:1"], "cannot reach a Ray cluster at 127.0.0.1:1"),
    (["--data-parallel-size", "0"], "data_parallel_size: Input should be greater than or equal to 1"),
    (["--data-parallel-size", "2", "--num-cpus-per-replica", "0"], "--num-cpus-per-replica must be > 0"),
])
def test_bad_start_up_is_one_line_and_leaves_nothing_running(argv, message, capfd):
    from iterserve.server.cli import main
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0], err
    assert not ray.is_initialized()
