"""The session's settings live in its configuration (`c.ScaleSession.<name>`), each with its
help, and reach the processes they govern: the write watch's switch in the kernel at once."""

import pytest
from traitlets.config import Config

from jupyter_scale import writewatch
from jupyter_scale.session import ScaleSession
from jupyter_scale.settings import SessionSettings


def test_every_setting_is_configurable_with_help_and_the_timeouts_are_apart():
    traits = SessionSettings.class_traits(config=True)
    assert {"start_timeout", "call_timeout", "stop_timeout", "write_watch"} <= set(traits)
    assert all(t.help and t.help.strip() for t in traits.values()), [n for n, t in traits.items() if not t.help]
    config = Config()
    config.ScaleSession.start_timeout, config.ScaleSession.call_timeout = 300.0, 7.0
    config.ScaleSession.stop_timeout = 2.0
    session = ScaleSession(config=config)
    assert (session.start_timeout, session.call_timeout, session.stop_timeout) == (300.0, 7.0, 2.0)
    assert "call_timeout" in ScaleSession.class_get_help()


def test_the_write_watch_switch_is_a_setting_that_reaches_the_kernel():
    probe = writewatch.WriteWatch()
    watching = probe.watching
    probe.close()  # one userfaultfd at a time watches the process's memory
    if not watching:
        pytest.skip("this system refuses userfaultfd: the watch is off whatever the setting")
    config = Config()
    config.ScaleSession.write_watch = False
    try:
        session = ScaleSession(config=config)
        assert not writewatch.watch().watching  # every tensor hashed whole
        session.write_watch = True  # as %config does
        assert writewatch.watch().watching
    finally:
        writewatch.enable(True)
