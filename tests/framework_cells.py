"""What every framework's cells must do (tests/test_tensorflow.py, test_paddle.py and
test_horovod.py run these on their own kernels): be refused until the user allows servers
without authentication, train and bring the weights back, name the rank that failed, and stop
on the user's interrupt. The notebook defines `weights_now()`, its model's weights as NumPy
arrays, and `before`, those weights before training; `train(n)` is a %%distribute cell of n
epochs that reports each and keeps `epoch_losses`; `same` is an expression that is True when
both ranks and the notebook hold the same weights."""

import threading


def refused_until_allowed(kernel, cell):
    out = kernel.cell(cell)
    assert not out.ok and "allow_unauthenticated_servers" in out.error["evalue"], out.error_text
    assert len(out.error["traceback"]) == 1  # one line
    assert kernel.value("jupyter_scale.get_session().running") is False  # nothing started, nothing listens


def trains_and_brings_rank_0s_weights_back(kernel, notebook, train, same):
    """Allowed, 2 workers train 4 epochs; returns each rank's epoch losses."""
    kernel.ok("%config ScaleSession.allow_unauthenticated_servers = True\n" + notebook, timeout=120)
    kernel.ok(train(4), timeout=240)
    assert kernel.value("jupyter_scale.get_session().runs[-1].status") == "finished"
    assert kernel.value(same) is True
    assert kernel.value("any((a != b).any() for a, b in zip(before, weights_now()))") is True
    assert kernel.value("len(jupyter_scale.history())") == 8  # report() as for torch: a point per epoch per rank
    return kernel.value("jupyter_scale.get_session().gather('epoch_losses')")


def error_on_rank_1_is_named_and_the_next_cell_trains_on_fresh_workers(kernel, train, same):
    pids = kernel.value("[w['pid'] for w in jupyter_scale.get_session().workers]")
    kernel.ok("snapshot = weights_now()")
    out = kernel.cell(train(3).replace("    report(", "    if rank == 1 and epoch == 1:\n"
                                       "        raise ValueError('bad batch on rank 1')\n    report("), timeout=240)
    assert not out.ok
    # Paddle ends rank 0's process when rank 1 cuts the group's connections (WorkerDied): a
    # consequence, not the cause.
    assert out.error["ename"] in ("RemoteError", "WorkerDied"), out.error_text
    assert out.error["evalue"].startswith("rank 1 failed: ValueError: bad batch on rank 1"), out.error_text
    # The notebook's model is as it was: a failed cell brings nothing back.
    assert kernel.value("all(np.array_equal(a, b) for a, b in zip(snapshot, weights_now()))") is True
    out = kernel.cell(train(1), timeout=300)
    assert out.ok, out.error_text
    assert "restarting the" in out.stdout + out.stderr  # the group forms once per process
    assert kernel.value("[w['pid'] for w in jupyter_scale.get_session().workers]") != pids
    assert kernel.value(same) is True


def interrupt_stops_both_ranks_and_the_next_cell_trains(kernel, train, same):
    timer = threading.Timer(3.0, kernel.manager.interrupt_kernel)

    def on_stream(name, text):
        if "epoch" in text and not timer.is_alive() and not timer.finished.is_set():
            timer.start()

    try:
        out = kernel.cell(train(10_000).replace("    report(", "    print('epoch', epoch, flush=True)\n    report("),
                          timeout=240, on_stream=on_stream)
    finally:
        timer.cancel()
    assert timer.finished.is_set(), "training never started"
    assert not out.ok and out.error["ename"] == "KeyboardInterrupt", out.error_text
    assert kernel.value("jupyter_scale.get_session().runs[-1].status") == "interrupted"
    kernel.ok(train(1), timeout=300)
    assert kernel.value(same) is True
