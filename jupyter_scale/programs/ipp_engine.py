"""ipyparallel's engine, with the worker code (torch: a second or two) imported first: while
the controller starts, instead of after registering, before the first cell. A failed import is
left to the first call, which reports it with its cause (WorkerCallFailed) rather than an
engine dying at start: hence a program run by path (see programs), not `-m` a module of
jupyter_scale's, which would import the package, and torch, outside the try."""

import sys


def main() -> None:
    try:
        import jupyter_scale.worker  # noqa: F401
    except Exception:
        pass
    from ipyparallel.engine.app import main as engine_main

    engine_main()


if __name__ == "__main__":
    sys.path[0] = ""  # the working directory, as `python -c`, not this one (see programs)
    main()
