"""The magics in a real kernel: loading starts nothing, bad input starts nothing."""

import pytest


def test_load_ext_starts_nothing_and_cells_run_locally(fresh_kernel):
    k = fresh_kernel
    assert k.descendants() == []
    assert "no cluster running" in k.ok("%scale").stdout
    # The same training cell, without %%distribute: helpers are no-ops, report is local.
    k.ok("""
model = nn.Linear(4, 2)
loader = jupyter_scale.shard(DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4))
model = jupyter_scale.wrap(model)
for x, y in loader:
    loss = nn.functional.cross_entropy(model(x), y)
    report(loss=loss)
assert isinstance(model, nn.Linear)
assert len(jupyter_scale.history()) == 4
""")
    # The README's loop, as it is under %%distribute, runs locally too.
    from test_automatic import NOTEBOOK, README_LOOP

    k.ok(NOTEBOOK)
    k.ok(README_LOOP.split("\n", 1)[1])
    assert k.value("len(jupyter_scale.history())") == 4 + 3 * 32
    assert k.descendants() == []


@pytest.mark.parametrize(
    "line, message",
    [
        ("%%distribute --workers 0", "--workers must be at least 1"),
        ("%%distribute --workers -3", "--workers must be at least 1"),
        ("%%distribute --workers abc", "--workers takes a whole number"),
        ("%%distribute --bogus", "unrecognized arguments: --bogus"),
        ("%%distribute --backend nosuch", "unknown backend 'nosuch'"),
        ("%%distribute --timeout -1", "--timeout must be more than 0"),
        ("%%distribute --timeout soon", "--timeout takes a number"),
        ("%%distribute --pull 1x", "--pull takes comma-separated variable names"),
        ("%scale explode", "invalid choice: 'explode'"),
        ("%scale stop --workers 2", "--workers goes with start, restart or connect"),
        ("%scale connect", "connect to what?"),
        ("%scale start tcp://127.0.0.1:8786", "goes with connect, not start"),
        ("%scale connect tcp://127.0.0.1:8786 --profile p", "not both"),
        ("%scale connect ipcontroller-client.json --profile p", "not both"),
        ("%scale connect tcp://127.0.0.1:8786 --backend dask --profile p", "find an ipyparallel cluster, not a Dask"),
        ("%scale connect tcp://127.0.0.1:8786 --backend ipyparallel", "does not name an ipyparallel cluster"),
        ("%scale connect nosuch://127.0.0.1:10001", "no installed engine connects to nosuch://127.0.0.1:10001"),
        ("%scale connect ray://127.0.0.1:10001 --tls-cert c.pem --tls-ca-file ca.pem", "found by its address alone"),
        ("%scale connect --profile p --tls-cert c.pem --tls-ca-file ca.pem", "TLS files go with a Dask scheduler"),
        ("%scale start --tls-cert c.pem", "go with connect, not start"),
        ("%scale export", "the following arguments are required: directory"),
        ("%scale export job --to kubernetes", "--to takes some of torchrun,slurm"),
        ("%scale export job --nodes 0", "--nodes must be at least 1"),
        ("%scale connect tcp://127.0.0.1:8786 --rendezvous rank0", "--rendezvous takes an IP address or a network"),
        ("%scale start --rendezvous 10.0.0.0/8", "--rendezvous goes with connect, not start"),
    ],
)
def test_bad_arguments_are_one_line_usage_errors(kernel_for_usage, line, message):
    k = kernel_for_usage
    body = "\nprint('ran')" if line.startswith("%%") else ""
    out = k.cell(line + body)
    # IPython prints a UsageError as one line on stderr, with no traceback.
    assert out.stderr.startswith("UsageError: "), out.stderr
    assert message in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert "ran" not in out.stdout
    assert k.descendants() == []  # nothing started


def test_empty_cell_is_a_usage_error(kernel_for_usage):
    for cell in ("%%distribute\n", "%%distribute\n   \n"):
        out = kernel_for_usage.cell(cell)
        assert out.stderr.startswith("UsageError: "), out.stderr
        # IPython's own words for an empty body; ours for one of blanks.
        assert "the cell body is empty" in out.stderr or "needs a cell body" in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1
    assert kernel_for_usage.descendants() == []


@pytest.fixture(scope="module")
def kernel_for_usage():
    from conftest import SETUP
    from kernel import Kernel

    k = Kernel()
    k.ok(SETUP)
    yield k
    assert k.descendants() == []
    k.shutdown()


def test_scale_start_restart_stop(fresh_kernel):
    k = fresh_kernel
    k.ok("%scale start --workers 2")
    first = k.value("[w['pid'] for w in jupyter_scale.get_session().workers]")
    assert "2 workers" in k.ok("%scale status").stdout
    again = k.cell("%scale start")
    assert "UsageError: a cluster of 2 workers is already running" in again.stderr
    k.ok("%scale restart")
    second = k.value("[w['pid'] for w in jupyter_scale.get_session().workers]")
    assert len(second) == 2 and not set(first) & set(second)  # fresh worker processes
    out = k.ok("%%distribute\nprint('up', rank)")
    assert "[rank 1] up 1" in out.stdout and "starting" not in out.stdout  # reused, not restarted
    assert "stopped 2 workers" in k.ok("%scale stop").stdout
    assert k.descendants() == []
