"""Property: whatever the magic line, the user gets a UsageError or a valid call, never a traceback.

The parsing layer is tested alone here (random lines would otherwise start clusters): the
Session methods the magics call are replaced by recorders that check what they were given.
The real magics on real clusters are tested in test_magics.py.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError
from IPython.testing.globalipapp import get_ipython

from jupyter_scale.magics import ScaleMagics
from jupyter_scale.session import ScaleSession

TOKENS = st.sampled_from([
    "--workers", "-n", "--pull", "--timeout", "--backend", "--steps", "--manual", "--profile",
    "--cluster-id", "--bogus", "-x", "0", "-3", "2", "4", "abc", "1.5", "-1", "1e3", "nan", "inf",
    "a,b", "1x", ",", "dask", "ipyparallel", "nosuch", "tcp://127.0.0.1:8786", "x.json", "=",
    "--workers=2", "--timeout=0", "'", '"', "status", "start", "stop", "restart", "connect", "explode",
    "--launcher", "local", "slurm", "mpi", "--partition", "--time", "10:00", "--mem", "16G", "--cpus-per-worker",
    "--gpus-per-worker", "--account", "--qos", "--shard", "--mixed-precision", "bf16", "fp8", "--cpu-offload",
    "--keep-sharded", "ray://127.0.0.1:10001", "--tls-cert", "c.pem", "--framework", "tensorflow", "paddle",
])
LINES = st.lists(st.one_of(TOKENS, st.text(max_size=8)), max_size=6).map(" ".join)


class Recorder(ScaleSession):
    """A session that records calls instead of starting clusters, and checks their arguments."""

    def run(self, code, *, workers=None, pull=(), timeout=None, manual=False, steps=None, launcher=None,
            launcher_options=None, shard=False, keep_sharded=False, framework=None, log_to=None, log_as=None):
        assert not (shard and manual)
        assert log_to is None or (isinstance(log_to, list) and all(isinstance(t, str) for t in log_to))
        assert log_as in (None, "ranks", "mean")
        assert framework in (None, "torch", "tensorflow", "paddle", "horovod")
        assert shard is False or shard is True or set(shard) <= {"mixed_precision", "offload"}
        assert isinstance(keep_sharded, bool)
        assert workers is None or (isinstance(workers, int) and workers >= 1)
        assert launcher in (None, "local", "slurm", "mpi")
        assert not launcher_options or launcher in (None, "slurm")
        assert timeout is None or timeout > 0
        assert steps is None or (isinstance(steps, int) and steps >= 1)
        assert all(name.isidentifier() for name in pull)
        assert code.strip()

    def start(self, workers=None, launcher=None, **launcher_options):
        assert workers is None or workers >= 1
        assert not launcher_options or launcher in (None, "slurm")

    def restart(self, workers=None, launcher=None, **launcher_options):
        assert workers is None or workers >= 1
        assert not launcher_options or launcher in (None, "slurm")

    def stop(self):
        pass

    def connect(self, address=None, *, workers=None, backend=None, profile=None, cluster_id=None, url_file=None,
                tls=None):
        assert address or profile or cluster_id
        assert backend in (None, "dask", "ipyparallel")
        assert workers is None or workers >= 1
        assert tls is None or (address and {"ca_file", "cert"} <= set(tls))


@pytest.fixture(scope="module")
def magics():
    shell = get_ipython()
    return ScaleMagics(shell, Recorder(namespace={}, shell=shell))


def _call_or_usage_error(fn, *args):
    try:
        fn(*args)
    except UsageError as exc:
        message = str(exc)
        assert message and "\n" not in message.strip(), message  # one line
        assert "Traceback" not in message


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(line=LINES)
def test_any_distribute_line_is_a_usage_error_or_a_valid_run(magics, line):
    _call_or_usage_error(magics.distribute, line, "print(rank)")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(line=LINES)
def test_any_scale_line_is_a_usage_error_or_a_valid_call(magics, line):
    _call_or_usage_error(magics.scale, line)


def test_the_recording_session_takes_what_the_real_one_takes():
    # Hypothesis reaches each magic line by chance: a stand-in that lags behind the real
    # session's signature would fail only now and then.
    import inspect

    for name in ("connect", "start", "restart", "run", "stop"):
        if name in vars(Recorder):
            assert (list(inspect.signature(getattr(Recorder, name)).parameters)
                    == list(inspect.signature(getattr(ScaleSession, name)).parameters)), name
